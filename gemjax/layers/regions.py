"""Activation-checkpointing regions: named parts of a model's forward, each run under
one policy that decides what its backward keeps from the forward.

    plan = parse_plan("seq:recompute/attention:save/interaction:offload")
    set_plan(model, plan)                    # every submodule with a `remat_plan` attribute
    y = run(self.remat_plan, "attention", block_fn, x, jagged)   # inside such a module

Regions (non-overlapping; a region is every block the model runs under its name):
  pyramid      the pyramid sequence encoder (every level of every sequence)
  cross        each Cross Arch (x_sum / s_sum summaries, per layer and the final one)
  seq          the Sequence Arch minus its self-attention, per layer: personalized FFN
               (with its norm and residual), FFN and the CLS update
  attention    the Sequence Arch self-attention (norm, projections, kernel, residual)
  interaction  the Interaction Arch (Wukong or the mixture of Wukong experts)
  heads        the multi-domain head
Policies:
  save         the block runs as written: autodiff keeps what it needs (no wrapper at
               all, so a plan of only "save" traces exactly the unwrapped program)
  recompute    jax.checkpoint, policy nothing_saveable: the backward keeps the block's
               inputs and recomputes everything inside it
  offload      jax.checkpoint, policy save_and_offload_only_these_names: the tensors
               tagged inside the block (TAGS: attention q/k/v and outputs, MLP hidden
               activations) go to pinned host memory in the forward and come back for
               the backward; the rest is recomputed. On CPU the "device" is host memory
               already, so the program copies within host RAM (it runs, saves nothing)
  quantize     the block's floating inputs are kept in FP8 E4M3 with per-block scales
               and the block is recomputed from them in the backward
               (gemjax.precision.saved.quantized_residuals; the forward is exact)

State is explicit, in static module attributes (part of the graphdef, no global or
thread-local setting):
  remat_plan    on the modules that run regions (the teacher, InterFormer and its
                layers): parse_plan's tuple, () by default; `set_plan` sets it on every
                module of a model that has the attribute
  offload_tags  (OFFLOAD_ATTR) on the modules that tag tensors (MLP, the jagged
                attentions, HSTU blocks): False by default. `run` sets it to True on the
                copy of the block's module it merges inside an offloaded block, so
                `tag(x, name, self.offload_tags)` marks x (jax checkpoint_name) only
                there and returns x itself elsewhere (no checkpoint_name in the program).
Every wrapper traces its block at once, at the call.
"""

from __future__ import annotations

from typing import Callable, Mapping

import jax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from gemjax.precision.saved import quantized_residuals

REGIONS = ("pyramid", "cross", "seq", "attention", "interaction", "heads")
POLICIES = ("save", "recompute", "offload", "quantize")
# checkpoint names of the tensors an offloaded block sends to the host
TAGS = ("attn.qkv", "attn.out", "mlp.hidden")
FLAG = "train.remat"
# the module attribute that turns `tag` on (module docstring)
OFFLOAD_ATTR = "offload_tags"

# a plan: parse_plan's ((region, policy), ...) or a {region: policy} dict
Plan = tuple[tuple[str, str], ...] | Mapping[str, str]


def parse_plan(text: str, flag: str = FLAG) -> tuple[tuple[str, str], ...]:
    """"none" / "" -> () (every region saves); "region:policy/..." (items separated by "/"
    or ",": "/" passes through --override, whose items are comma-separated) ->
    ((region, policy), ...) in REGIONS order, regions not named keeping "save";
    "all:policy" sets every region (later items override it). Raises ValueError naming
    `flag` and the bad item."""
    text = (text or "").strip()
    if text in ("", "none"):
        return ()
    if text == "auto":
        raise ValueError(f"{flag}=auto is a request for the planner: resolve it with "
                         f"gemjax.train.remat.resolve(cfg) (experiments/train.py does) before "
                         f"building the model")
    plan: dict[str, str] = {}
    for item in text.replace("/", ",").split(","):
        region, sep, policy = item.strip().partition(":")
        if not sep or policy not in POLICIES or region not in REGIONS + ("all",):
            raise ValueError(f"{flag}: bad item {item.strip()!r} in {text!r}; expected "
                             f"region:policy with region one of {', '.join(REGIONS)} or all, "
                             f"policy one of {', '.join(POLICIES)}; or none / auto")
        for r in (REGIONS if region == "all" else (region,)):
            plan[r] = policy
    return tuple((r, plan[r]) for r in REGIONS if plan.get(r, "save") != "save")


def format_plan(plan: Plan) -> str:
    """The flag text of a plan (inverse of parse_plan, "/"-separated): "none" when every
    region saves."""
    items = dict(plan)
    text = "/".join(f"{r}:{items[r]}" for r in REGIONS if items.get(r, "save") != "save")
    return text or "none"


def set_plan(model: nnx.Module, plan: Plan) -> nnx.Module:
    """Set `remat_plan` = plan (parse_plan's form or a dict, stored as ((region, policy),
    ...)) on every module of `model` that has that attribute; returns `model`."""
    model.set_attributes(raise_if_not_found=False, remat_plan=tuple(dict(plan).items()))
    return model


def policy_of(plan: Plan, region: str) -> str:
    """`plan`'s policy for `region` ("save" when the plan does not name it)."""
    return dict(plan).get(region, "save")


def tag(x: jax.Array, name: str, on: bool) -> jax.Array:
    """x, marked as checkpoint name `name` (one of TAGS) when `on` (the calling module's
    offload_tags, True only inside an offloaded block); else x itself."""
    return checkpoint_name(x, name) if on else x


def _offloaded(fn: Callable) -> Callable:
    policy = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=list(TAGS),
        offload_src="device", offload_dst="pinned_host")
    return jax.checkpoint(fn, policy=policy)


def wrap(policy: str, fn: Callable, exact: int = 0) -> Callable:
    """fn under `policy` (module docstring); "save" returns fn itself. exact: leading
    arguments of fn (parameters) that "quantize" keeps as they are. Under "offload" the
    tensors fn tags (modules with offload_tags True) go to the host; `run` turns the
    tags on."""
    if policy == "save":
        return fn
    if policy == "recompute":
        return jax.checkpoint(fn, policy=jax.checkpoint_policies.nothing_saveable)
    if policy == "offload":
        return _offloaded(fn)
    if policy == "quantize":
        return quantized_residuals(fn, exact=exact)
    raise ValueError(f"{FLAG}: unknown policy {policy!r}; one of {', '.join(POLICIES)}")


def run(plan: Plan, region: str, fn: Callable, *args):
    """fn(*args) under `plan`'s policy for `region` (plan: the calling module's
    remat_plan).

    fn: an nnx Module (its __call__) or a bound method of one; args: pytrees of arrays
    (the block's activations and index arrays). Under a policy other than "save" the
    module's state goes in as an explicit input (nnx.split / merge), so the wrapper
    traces a pure function of (state, *args) and differentiates the parameters; under
    "offload" the merged copy of the module has offload_tags set to True."""
    policy = policy_of(plan, region)
    if policy == "save":
        return fn(*args)
    if isinstance(fn, nnx.Module):
        module, method = fn, type(fn).__call__
    else:
        module, method = fn.__self__, fn.__func__
    graphdef, state = nnx.split(module)

    def pure(state, *args):
        copy = nnx.merge(graphdef, state)
        if policy == "offload":
            copy.set_attributes(raise_if_not_found=False, **{OFFLOAD_ATTR: True})
        return method(copy, *args)
    return wrap(policy, pure, exact=1)(state, *args)
