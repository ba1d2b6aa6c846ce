"""BlockAttention reference: softmax attention inside 64-token blocks, with RoPE.

Semantics (exact): token t of sample b (index p within the sample) attends, with
softmax and scale sm_scale (default 1/sqrt(D)), to the keys of the same sample
whose index p' has p' // block == p // block (non-causal). RoPE (kernels.common.rope,
rotate-half, theta rope_theta) is applied to q and k at `positions` (default: p)
before the dot product; v is not rotated. Block membership always uses p (the
index within the sample), `positions` only feeds RoPE. Padding rows give 0.

  block_attention_reference        per-block padded layout, O(T * block) memory
  block_attention_reference_dense  dense [H, T, T] mask (small tests)
"""

import jax.numpy as jnp

from kernels.common import pair_mask, rope, segment_layout
from kernels.jagged_attention.reference import masked_softmax_av


def block_slots(offsets, capacity, block):
    """Slot of each token in a [NB, block] per-block padded layout.

    NB = ceil(T / block) + B is a static bound on the number of blocks. Returns
    (slot [T] int32 with padding rows -> NB * block, NB).
    """
    b = offsets.shape[0] - 1
    nb = -(-capacity // block) + b
    seg, pos = segment_layout(offsets, capacity)
    lengths = offsets[1:] - offsets[:-1]
    nblk = (lengths + block - 1) // block
    base = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(nblk).astype(jnp.int32)])
    slot = (jnp.take(base, seg, axis=0) + pos // block) * block + pos % block
    return jnp.where(seg < b, slot, nb * block).astype(jnp.int32), nb


def _default_positions(offsets, t, positions):
    if positions is None:
        return segment_layout(offsets, t)[1]
    return positions


def block_attention_reference(q, k, v, offsets, *, block=64, positions=None,
                              rope_theta=10_000.0, sm_scale=None):
    """q/k/v [T,H,D], offsets [B+1] int32, positions [T] int or None -> [T,H,D] q.dtype."""
    t, h, d = q.shape
    sm_scale = d ** -0.5 if sm_scale is None else sm_scale
    pos = _default_positions(offsets, t, positions)
    qr, kr = rope(q, pos, rope_theta), rope(k, pos, rope_theta)
    slot, nb = block_slots(offsets, t, block)

    def to_blocks(x):
        z = jnp.zeros(((nb + 1) * block, h, d), jnp.float32).at[slot].set(x.astype(jnp.float32))
        return z[: nb * block].reshape(nb, block, h, d)

    filled = jnp.zeros(((nb + 1) * block,), bool).at[slot].set(True)[: nb * block]
    filled = filled.reshape(nb, block)
    qb, kb, vb = to_blocks(qr), to_blocks(kr), to_blocks(v)
    s = jnp.einsum("nqhd,nkhd->nhqk", qb, kb) * sm_scale
    s = jnp.where(filled[:, None, None, :], s, -jnp.inf)
    mx = jnp.max(s, axis=-1, keepdims=True)
    mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
    p = jnp.exp(s - mx)
    p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)
    ob = jnp.einsum("nhqk,nkhd->nqhd", p, vb).reshape(nb * block, h, d)
    ob = jnp.concatenate([ob, jnp.zeros((block, h, d), ob.dtype)])
    return jnp.take(ob, slot, axis=0).astype(q.dtype)


def block_attention_reference_dense(q, k, v, offsets, *, block=64, positions=None,
                                    rope_theta=10_000.0, sm_scale=None):
    """Same contract as block_attention_reference, dense [H, T, T] mask."""
    t, _, d = q.shape
    sm_scale = d ** -0.5 if sm_scale is None else sm_scale
    pos = _default_positions(offsets, t, positions)
    m = pair_mask(offsets, offsets, t, t, block=block)
    s = jnp.einsum("qhd,khd->hqk", rope(q, pos, rope_theta), rope(k, pos, rope_theta)) * sm_scale
    return masked_softmax_av(s, m, v.astype(jnp.float32)).astype(q.dtype)
