"""Logical axis names mapped to physical mesh axes by rules (MaxText style).

Layers name their dimensions in the field's words (``("embed", "mlp")`` for a
dense kernel, ``("batch", "embed")`` for activations); rules map each logical name
to a tuple of physical axes (``mesh.py``). The five parallelism dimensions
(GEM's 2D FSDP + EP for the dense side, 2D model parallelism for the sparse side) are
logical names too:

  dense DDP replica  ``batch`` over every axis (data parallel), params replicated
                     over ``replica``
  dense FSDP         ``embed`` / ``mlp`` / ``fsdp_shard`` -> ``fsdp`` (params and optimizer
                     state sharded within a zone, gathered for use)
  dense EP           ``expert`` -> ``expert`` (host NVLink)
  sparse MP group    ``table_rows`` -> ``fsdp`` (row-wise tables; all-to-all of ids
                     and embeddings)
  sparse copy shard  ``table_copy`` -> ``expert`` (each replica's copy sharded over
                     NVLink, all-gathered on demand)

Resolving names to a PartitionSpec: dims are taken left to right; a dim gets the
physical axes its rule names, minus axes the mesh lacks, minus axes an earlier dim
already used, and (when the dim size is known) minus axes that would not divide
it (kept greedily in rule order). So ``("batch", "embed")`` activations put batch on
every axis and leave ``embed`` replicated, while an ``("embed", "mlp")`` kernel is
FSDP-sharded on its first dim.

Override from a flag: ``--logical_rules="mlp=fsdp,embed=,batch=replica+fsdp"``
(``name=`` means replicated).
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

Rules = Mapping[str, tuple[str, ...]]

DEFAULT_RULES: dict[str, tuple[str, ...]] = {
    # activations
    "batch": ("replica", "fsdp", "expert"),
    "tokens": ("replica", "fsdp", "expert"),  # packed jagged tokens [devices x T, ...]
    "length": (),
    "features": (),
    # dense params: FSDP within the zone, replicated across replicas
    "embed": ("fsdp",),
    "mlp": ("fsdp",),
    "heads": (),
    "kv": (),
    "fsdp_shard": ("fsdp",),  # fallback FSDP dim picked by shard_params
    "norm": (),
    # expert parallelism on the host tier
    "expert": ("expert",),
    # sparse tables
    "vocab": (),
    "table_rows": ("fsdp",),
    "table_copy": ("expert",),
    "table_dim": (),
}


def parse_rules(text: str, base: Rules | None = None) -> dict[str, tuple[str, ...]]:
    """Apply ``name=axis+axis,name=,...`` overrides to ``base`` (default DEFAULT_RULES)."""
    rules = dict(DEFAULT_RULES if base is None else base)
    if not text or not text.strip():
        return rules
    for part in text.split(","):
        part = part.strip()
        if "=" not in part:
            raise ValueError(f"--logical_rules: cannot parse {part!r} in {text!r}; expected name=axis+axis or name=")
        name, axes = (s.strip() for s in part.split("=", 1))
        if not name.isidentifier():
            raise ValueError(f"--logical_rules: bad logical name {name!r} in {text!r}")
        phys = tuple(a.strip() for a in axes.split("+") if a.strip())
        if len(set(phys)) != len(phys):
            raise ValueError(f"--logical_rules: {name!r} repeats a physical axis: {axes!r}")
        rules[name] = phys
    return rules


def to_flax_rules(rules: Rules) -> tuple[tuple[str, Any], ...]:
    """Rules in flax's ``nnx.logical_axis_rules`` form (no conflict resolution there)."""
    return tuple((k, (v if len(v) > 1 else (v[0] if v else None))) for k, v in rules.items())


def logical_to_spec(names: Sequence[str | None], rules: Rules | None = None, mesh: Mesh | None = None,
                    shape: Sequence[int] | None = None) -> PartitionSpec:
    """PartitionSpec for dims named ``names`` (None = replicated dim).

    mesh: drops physical axes the mesh lacks and enables divisibility checks
      (default: the current mesh from ``jax.set_mesh``, if any).
    shape: the array's shape; axes whose size would not divide a dim are skipped.
    """
    rules = DEFAULT_RULES if rules is None else rules
    mesh = _current_mesh() if mesh is None else mesh
    sizes = dict(mesh.shape) if mesh is not None else None
    if shape is not None and len(shape) != len(names):
        raise ValueError(f"logical names {tuple(names)} do not match array rank {len(shape)} (shape {tuple(shape)})")
    used: set[str] = set()
    out = []
    for i, name in enumerate(names):
        if name is None:
            out.append(None)
            continue
        if name not in rules:
            raise ValueError(f"logical axis {name!r} has no rule; known: {sorted(rules)}")
        chosen, prod = [], 1
        for ax in rules[name]:
            if ax in used or (sizes is not None and ax not in sizes):
                continue
            n = sizes[ax] if sizes is not None else 1
            if shape is not None and sizes is not None and shape[i] % (prod * n):
                continue
            chosen.append(ax)
            prod *= n
        used.update(chosen)
        out.append(None if not chosen else chosen[0] if len(chosen) == 1 else tuple(chosen))
    return PartitionSpec(*out)


def logical_sharding(names: Sequence[str | None], mesh: Mesh, rules: Rules | None = None,
                     shape: Sequence[int] | None = None) -> NamedSharding:
    """NamedSharding on ``mesh`` for dims named ``names``."""
    return NamedSharding(mesh, logical_to_spec(names, rules, mesh, shape))


def with_logical_constraint(x: jax.Array, names: Sequence[str | None], rules: Rules | None = None,
                            mesh: Mesh | None = None) -> jax.Array:
    """``with_sharding_constraint`` by logical names; a no-op when no mesh is set or given.

    x: any array whose rank equals len(names). Uses ``mesh`` if given, else the
    mesh of the enclosing ``jax.set_mesh`` (also inside jit).
    """
    if mesh is not None:
        return jax.lax.with_sharding_constraint(x, logical_sharding(names, mesh, rules, x.shape))
    ctx = _current_mesh()
    if ctx is None:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(names, rules, ctx, x.shape))


def fsdp_spec(shape: Sequence[int], mesh: Mesh, rules: Rules | None = None) -> PartitionSpec:
    """Shard the largest dim divisible by the ``fsdp_shard`` axes; replicated if none divides."""
    rules = DEFAULT_RULES if rules is None else rules
    axes = tuple(a for a in rules.get("fsdp_shard", ()) if a in mesh.shape)
    n = math.prod(mesh.shape[a] for a in axes)
    if not axes or n == 1:
        return PartitionSpec()
    for d in sorted(range(len(shape)), key=lambda d: (-shape[d], d)):
        if shape[d] % n == 0:
            spec = [None] * len(shape)
            spec[d] = axes[0] if len(axes) == 1 else axes
            return PartitionSpec(*spec)
    return PartitionSpec()


def param_shardings(state: Any, mesh: Mesh, rules: Rules | None = None) -> Any:
    """A NamedSharding per array leaf of ``state`` (an nnx.State, or any pytree).

    nnx Variables with ``out_sharding`` metadata (logical names) use the rules;
    other arrays get FSDP over their largest divisible dim (``fsdp_spec``);
    scalars are replicated. The result mirrors ``state``'s structure with Variables
    replaced by their sharding.
    """

    def one(leaf):
        if isinstance(leaf, nnx.Variable):
            value = leaf.get_value()
            names = leaf.get_metadata().get("out_sharding")
        else:
            value, names = leaf, None
        shape = np.shape(value)
        if names:
            spec = logical_to_spec(tuple(names), rules, mesh, shape)
        else:
            spec = fsdp_spec(shape, mesh, rules)
        return NamedSharding(mesh, spec)

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def shard_params(state: Any, rules: Rules | None, mesh: Mesh) -> Any:
    """``state`` with every array placed by ``param_shardings`` (device_put; keeps Variables)."""
    shardings = param_shardings(state, mesh, rules)

    def put(leaf, sharding):
        if isinstance(leaf, nnx.Variable):
            return leaf.replace(jax.device_put(leaf.get_value(), sharding))
        return jax.device_put(leaf, sharding)

    return jax.tree.map(put, state, shardings, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _current_mesh():
    """The (abstract) mesh set by ``jax.set_mesh``, or None; works inside jit."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return None
    return mesh
