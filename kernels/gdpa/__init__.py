"""gdpa: generalized dot-product attention over jagged tokens."""

from kernels.common import check_attention_inputs, check_impl, check_mask_args, with_padded_head_dim
from kernels.dispatch import gdpa_pallas, resolve_impl
from kernels.gdpa.reference import ACTIVATIONS, gdpa_reference, gdpa_reference_dense

__all__ = ["ACTIVATIONS", "gdpa", "gdpa_reference", "gdpa_reference_dense"]


def gdpa(q, k, v, q_offsets, kv_offsets, *, activation="silu", scale=1.0, causal=False,
         window=None, impl=None):
    """out = (act(Q K^T) * scale) @ V per sample (no implicit 1/sqrt(D)).

    q [Tq,H,D], k/v [Tk,H,D] (same float dtype), q_offsets/kv_offsets [B+1] int32
    (same B). Returns [Tq,H,D] in q.dtype; rows past q_offsets[-1] are 0. Masks as
    in kernels.common. impl: None (kernels.dispatch.resolve_impl: "mosaic" on GPU if the
    Pallas kernels take D, zero-padded to a power of two if need be:
    kernels.common.padded_head_dim; else the reference), "reference", "pallas" (the
    Triton forward and backward; interpret mode off GPU), "mosaic" (forward and backward
    on the Mosaic GPU kernels, kernels/mosaic; where they do not apply,
    kernels.dispatch.mosaic_forward's list, the Triton kernels run; the Mosaic GPU
    interpreter off GPU).
    """
    check_impl("gdpa", impl, extra=("mosaic",))
    check_attention_inputs("gdpa", q, k, v, q_offsets, kv_offsets)
    check_mask_args("gdpa", causal, window)
    if activation not in ACTIVATIONS:
        raise ValueError(f"gdpa: activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    impl = resolve_impl("gdpa", q.shape[-1], impl)
    if impl == "reference":
        return gdpa_reference(q, k, v, q_offsets, kv_offsets, activation=activation,
                              scale=scale, causal=causal, window=window)
    engine = "mosaic" if impl == "mosaic" else "triton"
    return with_padded_head_dim("gdpa", q, k, v, lambda q, k, v: gdpa_pallas(
        q, k, v, q_offsets, kv_offsets, activation=activation, scale=scale, causal=causal,
        window=window, forward=engine, backward=engine))
