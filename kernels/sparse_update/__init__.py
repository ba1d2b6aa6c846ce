"""row_wise_adagrad: the sparse tables' duplicate sum and row-wise Adagrad of the touched rows.

The embedding update of gemjax.sparse.routing (`update_impl`, train.sparse_update_impl)
over the lookup's sorted ids: each unique row's gradient rows summed, then row-wise
Adagrad on that row. The reference (reference.py) is XLA's segment_sum, a gather of the
touched rows and a scatter back; the Pallas Triton kernel (kernel.py) does all of it in
one pass over the sorted ids, the rows updated in place.

Measured on one H200 (benchmarks/bench_sparse.py, N = 1.3M Zipf ids): the kernel's
lookup + update step 1.20 ms against 1.93 ms for routing's XLA update; inside the h200
teacher's train step 128.2 against 128.9 ms, no gain, so the trainer's default is the
XLA update (train.sparse_update_impl="xla") and the kernel is opt-in.
"""

from __future__ import annotations

import jax

from kernels.common import check_impl
from kernels.sparse_update.kernel import KNOBS, row_wise_adagrad_fused, run_bounds
from kernels.sparse_update.reference import row_wise_adagrad_reference

__all__ = ["KNOBS", "row_wise_adagrad", "row_wise_adagrad_fused", "row_wise_adagrad_reference",
           "run_bounds"]


def row_wise_adagrad(weights, accum, rows, seg, index, g, *, lr, eps, impl="reference", **knobs):
    """Sum each unique row's gradients and apply row-wise Adagrad to those rows.

    weights [V, D] float32 / bfloat16, accum [V] float32, rows [K] int32 (table row of
    unique index u, -1 = none; distinct), seg [N] int32 (unique index of each sorted
    position, non-decreasing), index [N] int32 (row of g holding position j's gradient),
    g [M, D] -> (weights, accum), same shapes; rows no run touches are unchanged.
    impl: "reference" (None too: jnp, any backend; the kernel measured no faster inside a
    train step), "pallas" (kernel.row_wise_adagrad_fused: D a power of two >= 16; interpret
    mode off GPU; donate weights and accum to the enclosing jit for an in-place update).
    knobs: kernel.KNOBS overrides (pallas only).
    """
    check_impl("row_wise_adagrad", impl)
    if impl == "pallas":
        return row_wise_adagrad_fused(weights, accum, rows, seg, index, g, lr=lr, eps=eps,
                                      interpret=jax.default_backend() != "gpu", **knobs)
    if knobs:
        raise ValueError(f"row_wise_adagrad: knobs {sorted(knobs)} are the Pallas kernel's; "
                         "impl is 'reference'")
    return row_wise_adagrad_reference(weights, accum, rows, seg, index, g, lr=lr, eps=eps)
