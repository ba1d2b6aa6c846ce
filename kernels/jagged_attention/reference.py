"""Jagged softmax attention reference, plain jnp, computed in float32.

  jagged_attention_reference        query-chunked, O(C * Tk) memory (default CPU path)
  jagged_attention_reference_dense  one dense [H, Tq, Tk] score matrix (small tests)
Rows with no valid key (padding rows, empty key samples, windows that exclude
everything) give 0.
"""

import jax.numpy as jnp

from kernels.common import chunked_reference, pair_mask


def masked_softmax_av(s, m, v):
    """s [H,Q,K] f32 scores, m [Q,K] bool, v [K,H,D] f32 -> [Q,H,D]; empty rows -> 0."""
    s = jnp.where(m[None], s, -jnp.inf)
    mx = jnp.max(s, axis=-1, keepdims=True)
    mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
    p = jnp.where(m[None], jnp.exp(s - mx), 0.0)
    p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)
    return jnp.einsum("hqk,khd->qhd", p, v)


def jagged_attention_reference(q, k, v, q_offsets, kv_offsets, *, sm_scale=None,
                               causal=False, window=None, chunk=None):
    """softmax(Q K^T * sm_scale) V per sample; q [Tq,H,D], k/v [Tk,H,D] -> [Tq,H,D] q.dtype.

    sm_scale defaults to 1/sqrt(D).
    """
    sm_scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    return chunked_reference(q, k, v, q_offsets, kv_offsets,
                             lambda s, m, vf: masked_softmax_av(s * sm_scale, m, vf),
                             causal=causal, window=window, chunk=chunk).astype(q.dtype)


def jagged_attention_reference_dense(q, k, v, q_offsets, kv_offsets, *, sm_scale=None,
                                     causal=False, window=None):
    """Same contract as jagged_attention_reference, one dense [H, Tq, Tk] matrix."""
    sm_scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    m = pair_mask(q_offsets, kv_offsets, q.shape[0], k.shape[0], causal, window)
    s = jnp.einsum("qhd,khd->hqk", q.astype(jnp.float32), k.astype(jnp.float32)) * sm_scale
    return masked_softmax_av(s, m, v.astype(jnp.float32)).astype(q.dtype)
