"""block_attention: softmax attention inside fixed-size blocks of each sample, fused RoPE.

Exact semantics in kernels/block_attention/reference.py.
"""

import jax.numpy as jnp

from kernels.common import check_attention_inputs, check_impl, padded_head_dim
from kernels.dispatch import block_attention_pallas, per_block_kernel_fits, resolve_impl
from kernels.block_attention.reference import (block_attention_reference,
                                               block_attention_reference_dense)

__all__ = ["block_attention", "block_attention_reference", "block_attention_reference_dense"]


def block_attention(q, k, v, offsets, *, block=64, positions=None, rope_theta=10_000.0,
                    sm_scale=None, impl=None):
    """Self-attention within `block`-token blocks of each sample, RoPE on q and k.

    q/k/v [T,H,D] (same float dtype, D even), offsets [B+1] int32, positions [T]
    int (RoPE positions; default the index within the sample). Token p of a sample
    attends (softmax, non-causal) to tokens p' of the same sample with
    p' // block == p // block. sm_scale defaults to 1/sqrt(D). Returns [T,H,D] in
    q.dtype; padding rows are 0. impl: None (Pallas on GPU if its kernels take D:
    each RoPE half zero-padded to a power of two by the per-block kernel,
    kernels.common.padded_head_dim; else the reference), "reference", "pallas".
    """
    check_impl("block_attention", impl)
    check_attention_inputs("block_attention", q, k, v, offsets, offsets)
    if q.shape != k.shape:
        raise ValueError(f"block_attention: q {q.shape} and k {k.shape} must have the same shape")
    if q.shape[-1] % 2:
        raise ValueError(f"block_attention: head dim D must be even for RoPE, got {q.shape[-1]}")
    if not isinstance(block, int) or block < 1:
        raise ValueError(f"block_attention: block must be an int >= 1, got {block!r}")
    if positions is not None:
        if positions.shape != q.shape[:1] or not jnp.issubdtype(positions.dtype, jnp.integer):
            raise ValueError(f"block_attention: positions must be int [T={q.shape[0]}], got "
                             f"{positions.dtype}{list(positions.shape)}")
    if impl is None:  # Pallas on GPU when its kernels take D (padded if need be), else jnp
        impl = resolve_impl("block_attention", q.shape[-1], impl)
        if impl == "pallas" and padded_head_dim("block_attention", q.shape[-1]) != q.shape[-1]:
            if not per_block_kernel_fits(block, q.dtype):   # only that kernel pads
                impl = "reference"
    if impl == "reference":
        return block_attention_reference(q, k, v, offsets, block=block, positions=positions,
                                         rope_theta=rope_theta, sm_scale=sm_scale)
    return block_attention_pallas(q, k, v, offsets, block=block, positions=positions,
                                  rope_theta=rope_theta, sm_scale=sm_scale)
