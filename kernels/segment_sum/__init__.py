"""sorted_segment_sum: per-segment float32 sums of gathered rows, positions sorted by segment.

The duplicate sum of the sparse gradient path (gemjax.sparse.routing.sum_duplicates,
sort residual): g holds per-id gradient rows, idx the sorted order, seg each sorted
position's unique index. XLA lowers the reference to an atomic scatter-add whose
adds collide on hot (Zipf head) rows; the Pallas Triton kernel (kernel.py) sums
blocks of sorted positions with a one-hot matmul and writes every output row once.
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp

from kernels.common import check_impl
from kernels.segment_sum.kernel import KNOBS, check_knobs, segment_sum_pallas
from kernels.segment_sum.reference import sorted_segment_sum_reference

__all__ = ["KNOBS", "sorted_segment_sum", "sorted_segment_sum_reference"]


def sorted_segment_sum(g, idx, seg, num_segments, *, impl=None, **knobs):
    """out[s] = sum of g[idx[p]] (float32) over the positions p with seg[p] == s.

    g [M, D] float (the kernel: bfloat16 / float16 / float32), or a tuple of sources [M_j, D]
    of one dtype standing for their row concatenation (the kernel reads each position's row
    from its source, so the caller need not copy them into one array), idx [N] int32 (rows
    of g, in [0, M)), seg [N] int32 non-decreasing, num_segments K (a static int) ->
    float32 [K, D].
    Positions whose seg lies outside [0, K) add nothing; rows no position names are 0.
    NaN / Inf reach only their own segment's row, as in a sequential sum.
    impl: None ("pallas" on GPU, else "reference"), "reference" (XLA's segment_sum),
    "pallas" (the Triton kernel; interpret mode off GPU). knobs: kernel.KNOBS
    overrides (block_n, block_d, block_rows, num_warps, num_stages, direct_partials).
    Sums may differ from the reference's in float32 rounding (summation order);
    the kernel's are the same bits on every run. No VJP on the kernel path.
    """
    check_impl("sorted_segment_sum", impl)
    g = _sources(g)
    _check_inputs(g, idx, seg, num_segments)
    knobs = check_knobs(knobs)
    if impl is None:
        impl = "pallas" if jax.default_backend() == "gpu" else "reference"
    if impl == "reference":
        return sorted_segment_sum_reference(g, idx, seg, num_segments)
    if g[0].dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)):
        raise ValueError(f"sorted_segment_sum(impl='pallas'): g must be bfloat16, float16 or "
                         f"float32, got {g[0].dtype}")
    interpret = jax.default_backend() != "gpu"
    return _kernel(g, idx.astype(jnp.int32), seg.astype(jnp.int32), operator.index(num_segments),
                   (interpret, tuple(sorted(knobs.items()))))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _kernel(g, idx, seg, num_segments, static):
    interpret, knobs = static
    return segment_sum_pallas(g, idx, seg, num_segments, interpret=interpret, knobs=dict(knobs))


def _kernel_fwd(g, idx, seg, num_segments, static):
    return _kernel(g, idx, seg, num_segments, static), None


def _kernel_bwd(num_segments, static, res, ct):
    raise NotImplementedError(
        "sorted_segment_sum(impl='pallas') has no VJP (it runs inside the embedding "
        "backward, never under autodiff); differentiate impl='reference' instead")


_kernel.defvjp(_kernel_fwd, _kernel_bwd)


def _sources(g) -> tuple:
    """g as a tuple of its non-empty sources (one if all are empty)."""
    gs = tuple(g) if isinstance(g, (tuple, list)) else (g,)
    if not gs:
        raise ValueError("sorted_segment_sum: g must be an array or a non-empty tuple of arrays")
    for j, x in enumerate(gs):
        if getattr(x, "ndim", None) != 2:
            name = "g" if len(gs) == 1 else f"g[{j}]"
            raise ValueError(f"sorted_segment_sum: {name} must be [M, D], got shape "
                             f"{getattr(x, 'shape', None)}")
    if len({x.shape[1] for x in gs}) > 1 or len({jnp.dtype(x.dtype) for x in gs}) > 1:
        raise ValueError(f"sorted_segment_sum: the sources of g must share D and dtype, got "
                         f"{[(x.shape, str(x.dtype)) for x in gs]}")
    return tuple(x for x in gs if x.shape[0] > 0) or gs[:1]


def _check_inputs(gs, idx, seg, num_segments):
    """ValueError naming the bad input."""
    for name, x in (("idx", idx), ("seg", seg)):
        if getattr(x, "ndim", None) != 1:
            raise ValueError(f"sorted_segment_sum: {name} must be [N], got shape "
                             f"{getattr(x, 'shape', None)}")
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"sorted_segment_sum: {name} must be integer (int32), got {x.dtype}")
    if idx.shape != seg.shape:
        raise ValueError(f"sorted_segment_sum: idx {idx.shape} and seg {seg.shape} must both "
                         "be [N]")
    try:
        ok = not isinstance(num_segments, bool) and operator.index(num_segments) >= 0
    except TypeError:
        ok = False
    if not ok:
        raise ValueError(f"sorted_segment_sum: num_segments must be a static int >= 0, got "
                         f"{num_segments!r}")
    if sum(x.shape[0] for x in gs) == 0 and idx.shape[0] > 0:
        raise ValueError("sorted_segment_sum: g has no rows for idx to name")
