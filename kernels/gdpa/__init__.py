"""gdpa: generalized dot-product attention over jagged tokens."""

from kernels.gdpa.reference import ACTIVATIONS, gdpa_reference


def gdpa(q, k, v, q_offsets, kv_offsets, *, activation="silu", scale=1.0, causal=False,
         window=None, impl=None):
    """out = (act(Q K^T) * scale) @ V per sample; q [Tq,H,D], k/v [Tk,H,D] -> [Tq,H,D]."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"gdpa: activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    if impl not in (None, "reference"):
        raise ValueError(f"gdpa: unknown impl {impl!r}")
    return gdpa_reference(q, k, v, q_offsets, kv_offsets, activation=activation, scale=scale,
                          causal=causal, window=window)
