"""jagged_attention: softmax attention over jagged tokens."""

from kernels.jagged_attention.reference import jagged_attention_reference


def jagged_attention(q, k, v, q_offsets, kv_offsets, *, sm_scale=None, causal=False,
                     window=None, impl=None):
    """q [Tq,H,D], k/v [Tk,H,D] -> [Tq,H,D]."""
    if impl not in (None, "reference"):
        raise ValueError(f"jagged_attention: unknown impl {impl!r}")
    return jagged_attention_reference(q, k, v, q_offsets, kv_offsets, sm_scale=sm_scale,
                                      causal=causal, window=window)
