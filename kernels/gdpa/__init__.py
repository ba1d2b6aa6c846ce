"""gdpa: generalized dot-product attention over jagged tokens."""

from kernels.common import (check_attention_inputs, check_impl, check_mask_args, default_impl,
                            with_padded_head_dim)
from kernels.gdpa.reference import ACTIVATIONS, gdpa_reference, gdpa_reference_dense

__all__ = ["ACTIVATIONS", "gdpa", "gdpa_reference", "gdpa_reference_dense"]


def gdpa(q, k, v, q_offsets, kv_offsets, *, activation="silu", scale=1.0, causal=False,
         window=None, impl=None):
    """out = (act(Q K^T) * scale) @ V per sample (no implicit 1/sqrt(D)).

    q [Tq,H,D], k/v [Tk,H,D] (same float dtype), q_offsets/kv_offsets [B+1] int32
    (same B). Returns [Tq,H,D] in q.dtype; rows past q_offsets[-1] are 0. Masks as
    in kernels.common. impl: None ("mosaic" on GPU if the Pallas kernels take D,
    zero-padded to a power of two if need be: kernels.common.padded_head_dim; else
    the reference), "reference", "pallas" (the Triton forward and backward;
    interpret mode off GPU), "mosaic" (forward and backward on the Mosaic GPU kernels,
    kernels/mosaic_flash.py; where they do not apply, mosaic_flash.flash_forward's
    list, the Triton kernels run; the Mosaic GPU interpreter off GPU).
    """
    check_impl("gdpa", impl, extra=("mosaic",))
    check_attention_inputs("gdpa", q, k, v, q_offsets, kv_offsets)
    check_mask_args("gdpa", causal, window)
    if activation not in ACTIVATIONS:
        raise ValueError(f"gdpa: activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    if impl is None:  # Pallas on GPU when its tiles fit D, else the jnp reference
        impl = default_impl("gdpa", q.shape[-1])
        if impl == "pallas":   # W1 forward 0.235 vs 0.278 ms, forward + backward 0.738 vs
            impl = "mosaic"    # 0.969 ms (docs/kernels.md); Triton where Mosaic does not apply
    if impl == "reference":
        return gdpa_reference(q, k, v, q_offsets, kv_offsets, activation=activation,
                              scale=scale, causal=causal, window=window)
    from kernels.gdpa.pallas import gdpa_pallas
    engine = "mosaic" if impl == "mosaic" else "triton"
    return with_padded_head_dim("gdpa", q, k, v, lambda q, k, v: gdpa_pallas(
        q, k, v, q_offsets, kv_offsets, activation=activation, scale=scale, causal=causal,
        window=window, forward=engine, backward=engine))
