"""jagged_attention: softmax attention over jagged tokens (flash-style on GPU)."""

from kernels.common import check_attention_inputs, check_impl, check_mask_args, with_padded_head_dim
from kernels.dispatch import jagged_attention_pallas, resolve_impl
from kernels.jagged_attention.reference import (jagged_attention_reference,
                                                jagged_attention_reference_dense)

__all__ = ["jagged_attention", "jagged_attention_reference", "jagged_attention_reference_dense"]


def jagged_attention(q, k, v, q_offsets, kv_offsets, *, sm_scale=None, causal=False,
                     window=None, impl=None):
    """softmax(Q K^T * sm_scale) V per sample; sm_scale defaults to 1/sqrt(D).

    q [Tq,H,D], k/v [Tk,H,D] (same float dtype), offsets [B+1] int32 (same B).
    Returns [Tq,H,D] in q.dtype; rows with no valid key (incl. padding) are 0.
    impl: None (kernels.dispatch.resolve_impl: "mosaic" on GPU if the Pallas kernels take
    D, zero-padded to a power of two if need be: kernels.common.padded_head_dim; else the
    reference), "reference", "pallas" (the Triton forward and backward; interpret mode
    off GPU), "mosaic" (forward and backward on the Mosaic GPU kernels, kernels/mosaic;
    where they do not apply, kernels.dispatch.mosaic_forward's list, the Triton kernels
    run; the Mosaic GPU interpreter off GPU).
    """
    check_impl("jagged_attention", impl, extra=("mosaic",))
    check_attention_inputs("jagged_attention", q, k, v, q_offsets, kv_offsets)
    check_mask_args("jagged_attention", causal, window)
    impl = resolve_impl("jagged_attention", q.shape[-1], impl)
    if impl == "reference":
        return jagged_attention_reference(q, k, v, q_offsets, kv_offsets, sm_scale=sm_scale,
                                          causal=causal, window=window)
    sm_scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale   # the real D's, if padded
    engine = "mosaic" if impl == "mosaic" else "triton"
    call = lambda q, k, v: jagged_attention_pallas(q, k, v, q_offsets, kv_offsets,  # noqa: E731
                                                   sm_scale=sm_scale, causal=causal, window=window,
                                                   forward=engine, backward=engine)
    return with_padded_head_dim("jagged_attention", q, k, v, call)
