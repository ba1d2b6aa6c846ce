"""Activation-checkpointing regions: named parts of a model's forward, each run under
one policy that decides what its backward keeps from the forward.

    plan = parse_plan("seq:recompute/attention:save/interaction:offload")
    with active(plan):                       # while the forward is traced
        y = run("attention", block_fn, x, jagged)

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

`tag(x, name)` marks a tensor for the offload policy; outside an offloaded block it
returns x itself (no checkpoint_name in the program), so tags cost nothing elsewhere.
The plan is read while the forward is traced (a context);
every wrapper traces its block at once, under the contexts active at the call.
"""

from __future__ import annotations

import contextlib
import threading
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

_local = threading.local()


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


def format_plan(plan: Mapping[str, str] | tuple[tuple[str, str], ...]) -> str:
    """The flag text of a plan (inverse of parse_plan, "/"-separated): "none" when every
    region saves."""
    items = dict(plan)
    text = "/".join(f"{r}:{items[r]}" for r in REGIONS if items.get(r, "save") != "save")
    return text or "none"


@contextlib.contextmanager
def active(plan: tuple[tuple[str, str], ...] | Mapping[str, str]):
    """Blocks run by `run` inside this context follow `plan` (parse_plan's form or a dict)."""
    prev = getattr(_local, "plan", None)
    _local.plan = dict(plan)
    try:
        yield
    finally:
        _local.plan = prev


def policy_of(region: str) -> str:
    """The active plan's policy for `region` ("save" without a plan)."""
    plan = getattr(_local, "plan", None)
    return (plan or {}).get(region, "save")


@contextlib.contextmanager
def _tagging():
    prev = getattr(_local, "tagging", False)
    _local.tagging = True
    try:
        yield
    finally:
        _local.tagging = prev


def tag(x: jax.Array, name: str) -> jax.Array:
    """x, marked as checkpoint name `name` (one of TAGS) inside an offloaded block."""
    return checkpoint_name(x, name) if getattr(_local, "tagging", False) else x


def _offloaded(fn: Callable) -> Callable:
    policy = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=list(TAGS),
        offload_src="device", offload_dst="pinned_host")

    def tagged(*args):
        with _tagging():
            return fn(*args)
    return jax.checkpoint(tagged, policy=policy)


def wrap(policy: str, fn: Callable, exact: int = 0) -> Callable:
    """fn under `policy` (module docstring); "save" returns fn itself. exact: leading
    arguments of fn (parameters) that "quantize" keeps as they are."""
    if policy == "save":
        return fn
    if policy == "recompute":
        return jax.checkpoint(fn, policy=jax.checkpoint_policies.nothing_saveable)
    if policy == "offload":
        return _offloaded(fn)
    if policy == "quantize":
        return quantized_residuals(fn, exact=exact)
    raise ValueError(f"{FLAG}: unknown policy {policy!r}; one of {', '.join(POLICIES)}")


def run(region: str, fn: Callable, *args):
    """fn(*args) under the active plan's policy for `region`.

    fn: an nnx Module (its __call__) or a bound method of one; args: pytrees of arrays
    (the block's activations and index arrays). Under a policy other than "save" the
    module's state goes in as an explicit input (nnx.split / merge), so the wrapper
    traces a pure function of (state, *args) and differentiates the parameters."""
    policy = policy_of(region)
    if policy == "save":
        return fn(*args)
    if isinstance(fn, nnx.Module):
        module, method = fn, type(fn).__call__
    else:
        module, method = fn.__self__, fn.__func__
    graphdef, state = nnx.split(module)

    def pure(state, *args):
        return method(nnx.merge(graphdef, state), *args)
    return wrap(policy, pure, exact=1)(state, *args)
