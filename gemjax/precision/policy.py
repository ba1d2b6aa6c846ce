"""Precision policy: which linear layers of a built model run their GEMMs in FP8.

    policy = Policy.from_model_config(cfg.model)
    model = apply_policy(model, policy)     # gemjax.models.gem.build_model calls this

A layer's region comes from where it sits in the model (its nnx graph path), the first
rule that matches:

    heads        under the model's `head` (the task towers)
    router       a mixture of experts' router (`router`)
    attn_proj    a q_proj / k_proj / v_proj / out_proj (every attention block: sequence
                 encoders, pyramid, InterFormer self / CLS / cross-layer attention, PMA,
                 the personalized FFN)
    wukong       a Wukong layer's MLP (`fmb_mlp`)
    sequence     other linears of the sequence encoders (`encoders`, `pyramid`: FFNs)
    interformer  other linears under `interformer` (x_summary MLPs, gates, FFNs)
    inputs       the dense feature projection (`dense_proj`)
    other        anything else

and, independently, `last`: every linear of the last entry of the model's outermost
`layers` list (the last InterFormer layer, or GEMv0's last Wukong layer) and of the
InterFormer's `final_cross`. A linear runs FP8 when precision == "fp8", its region is in
`regions` and neither its region nor (for a last-layer linear) "last" is in `exclude`.
The others keep model.dtype (BF16 in the large presets).

An FP8 linear gets an `Fp8DotGeneral` as its nnx.Linear.dot_general: the forward, dgrad
and wgrad of its GEMM go through gemjax.precision.gemm.fp8_dot with the policy's Recipe.
The projections written as einsums (Wukong's LCB / residual token mixes, contractions over
the few token slots) stay in model.dtype. With precision == "bf16" apply_policy returns the
model untouched, so every program is the one without a policy.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
from flax import nnx
from jax import lax

from gemjax.precision.delayed import fp8_dot_delayed
from gemjax.precision.gemm import FAST_ACCUMS, SCALINGS, WGRADS, Recipe, fp8_dot

PRECISIONS = ("bf16", "fp8")
REGIONS = ("heads", "router", "attn_proj", "wukong", "sequence", "interformer", "inputs", "other")
EXCLUDES = REGIONS + ("last",)
_PROJ = ("q_proj", "k_proj", "v_proj", "out_proj")


def _names(value: str, known: tuple[str, ...], field: str) -> frozenset[str]:
    names = frozenset(n.strip() for n in value.split("+") if n.strip())
    bad = sorted(names - set(known))
    if bad:
        raise ValueError(f"model.{field}: unknown names {bad}; known: {', '.join(known)}")
    return names


@dataclasses.dataclass(frozen=True)
class Policy:
    """precision: "bf16" (no FP8) or "fp8"; regions / exclude: region names (module
    docstring; exclude may also name "last"; in ModelConfig "+"-separated, e.g.
    fp8_regions="wukong+attn_proj"); recipe: how FP8 GEMMs quantize; amax_history, margin:
    the history length and scale headroom (a power of two) of recipe.scaling "delayed"."""
    precision: str = "bf16"
    regions: frozenset[str] = frozenset()
    exclude: frozenset[str] = frozenset()
    recipe: Recipe = Recipe()
    amax_history: int = 16
    margin: int = 0

    @classmethod
    def from_model_config(cls, m) -> Policy:
        """From ModelConfig's precision fields; ValueError naming a bad field."""
        if m.precision.format not in PRECISIONS:
            raise ValueError(f"model.precision.format must be one of {PRECISIONS}, got {m.precision.format!r}")
        if m.precision.scaling not in SCALINGS:
            raise ValueError(f"model.precision.scaling must be one of {SCALINGS}, got {m.precision.scaling!r}")
        if m.precision.grad_fmt not in ("e4m3", "e5m2"):
            raise ValueError(f"model.precision.grad_fmt must be e4m3 or e5m2, got {m.precision.grad_fmt!r}")
        if m.precision.wgrad_dtype not in WGRADS:
            raise ValueError(f"model.precision.wgrad_dtype must be one of {WGRADS}, got {m.precision.wgrad_dtype!r}")
        if m.precision.fast_accum not in FAST_ACCUMS:
            raise ValueError(f"model.precision.fast_accum must be one of {FAST_ACCUMS}, "
                             f"got {m.precision.fast_accum!r}")
        if m.precision.amax_history < 1:
            raise ValueError(f"model.precision.amax_history must be >= 1, got {m.precision.amax_history}")
        if not 0 <= m.precision.margin <= 16:
            raise ValueError(f"model.precision.margin must be in [0, 16], got {m.precision.margin}")
        return cls(precision=m.precision.format,
                   regions=_names(m.precision.regions, REGIONS, "precision.regions"),
                   exclude=_names(m.precision.exclude, EXCLUDES, "precision.exclude"),
                   recipe=Recipe(scaling=m.precision.scaling, grad_fmt=m.precision.grad_fmt,
                                 wgrad=m.precision.wgrad_dtype, fast_accum=m.precision.fast_accum),
                   amax_history=m.precision.amax_history, margin=m.precision.margin)

    def is_fp8(self, region: str, last: bool) -> bool:
        return (self.precision == "fp8" and region in self.regions
                and region not in self.exclude and not (last and "last" in self.exclude))


@dataclasses.dataclass(frozen=True)
class Fp8DotGeneral:
    """A drop-in `dot_general` for nnx.Linear: the linear contraction x [..., K] @ w [K, N]
    through fp8_dot(recipe); any other contraction through lax.dot_general unchanged."""
    recipe: Recipe = Recipe()

    def __call__(self, lhs, rhs, dimension_numbers, precision=None,
                 preferred_element_type=None, out_sharding=None):
        (lc, rc), (lb, rb) = dimension_numbers
        linear = (tuple(lc) == (lhs.ndim - 1,) and tuple(rc) == (0,) and not lb and not rb)
        if rhs.ndim != 2 or out_sharding is not None or not linear:
            return lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                                   preferred_element_type=preferred_element_type,
                                   out_sharding=out_sharding)
        y = self._dot(lhs, rhs)
        return y if preferred_element_type is None else y.astype(preferred_element_type)

    def _dot(self, lhs, rhs):
        return fp8_dot(lhs, rhs, self.recipe)


@dataclasses.dataclass(frozen=True, eq=False)
class DelayedDotGeneral(Fp8DotGeneral):
    """Fp8DotGeneral bound to one linear's amax history hist [3, H] for a step:
    gemjax.precision.delayed.fp8_dot_delayed(x, w, hist, recipe, axes, margin), whose
    cotangent of hist is the next history. Set on a merged model inside the step
    (`bind_histories`), never split into a graphdef."""
    hist: Any = None
    axes: tuple[str, ...] = ()
    margin: int = 0

    def _dot(self, lhs, rhs):
        return fp8_dot_delayed(lhs, rhs, self.hist, self.recipe, self.axes, self.margin)


def delayed_linears(model: nnx.Module) -> list[str]:
    """fp8_linears whose recipe scales from an amax history ("delayed"): the keys of the
    train state's "fp8_meta"."""
    return sorted("/".join(map(str, p)) for p, n in nnx.iter_graph(model)
                  if isinstance(n, nnx.Linear) and isinstance(n.dot_general, Fp8DotGeneral)
                  and n.dot_general.recipe.scaling == "delayed")


def bind_histories(model: nnx.Module, hists: dict, axes: tuple[str, ...], margin: int) -> None:
    """Gives each linear of `hists` ({delayed_linears key: [3, H]}) a DelayedDotGeneral
    with its history (in place; inside a traced step)."""
    for path, node in nnx.iter_graph(model):
        key = "/".join(map(str, path))
        if key in hists:
            node.dot_general = DelayedDotGeneral(node.dot_general.recipe, hists[key],
                                                 tuple(axes), margin)


def region_of(path: tuple) -> str:
    """The region (module docstring) of the linear at nnx graph path `path`."""
    names = [str(p) for p in path]
    if names and names[0] == "head":
        return "heads"
    if names and names[-1] == "router":
        return "router"
    if names and names[-1] in _PROJ:
        return "attn_proj"
    if "fmb_mlp" in names:
        return "wukong"
    if names and names[0] in ("encoders", "pyramid"):
        return "sequence"
    if names and names[0] == "interformer":
        return "interformer"
    if names and names[0] == "dense_proj":
        return "inputs"
    return "other"


def _outer_layers(path: tuple) -> tuple[tuple, int] | None:
    """(path prefix up to the outermost `layers` list, the index under it), or None."""
    for i, p in enumerate(path[:-1]):
        if p == "layers" and isinstance(path[i + 1], int):
            return tuple(path[:i + 1]), path[i + 1]
    return None


def linear_regions(model: nnx.Module) -> dict[tuple, tuple[str, bool]]:
    """{graph path of each nnx.Linear: (region, is in the last layer)}."""
    linears = [(tuple(p), n) for p, n in nnx.iter_graph(model) if isinstance(n, nnx.Linear)]
    last_index: dict[tuple, int] = {}
    for path, _ in linears:
        outer = _outer_layers(path)
        if outer:
            last_index[outer[0]] = max(last_index.get(outer[0], -1), outer[1])
    out = {}
    for path, _ in linears:
        outer = _outer_layers(path)
        last = "final_cross" in path or (outer is not None and outer[1] == last_index[outer[0]])
        out[path] = (region_of(path), last)
    return out


def apply_policy(model: nnx.Module, policy: Policy) -> nnx.Module:
    """Sets Fp8DotGeneral(policy.recipe) as the dot_general of each linear the policy puts
    in FP8 (in place); returns the model. precision "bf16": the model untouched."""
    if policy.precision != "fp8":
        return model
    regions = linear_regions(model)
    fp8 = Fp8DotGeneral(policy.recipe)
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Linear) and policy.is_fp8(*regions[tuple(path)]):
            node.dot_general = fp8
    return model


def fp8_linears(model: nnx.Module) -> list[str]:
    """'/'-joined graph paths of the linears running FP8 (sorted)."""
    return sorted("/".join(map(str, p)) for p, n in nnx.iter_graph(model)
                  if isinstance(n, nnx.Linear) and isinstance(n.dot_general, Fp8DotGeneral))


def fp8_kernels(model: nnx.Module) -> dict[tuple, tuple[Recipe, str | None]]:
    """{graph path of each FP8 linear's kernel param (the linear's path + ("kernel",)):
    (its Recipe, the dtype its GEMM reads the kernel in: the linear's dtype, None for
    the kernel's own)}."""
    out = {}
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Linear) and isinstance(node.dot_general, Fp8DotGeneral):
            dtype = None if node.dtype is None else str(jnp.dtype(node.dtype))
            out[tuple(path) + ("kernel",)] = (node.dot_general.recipe, dtype)
    return out
