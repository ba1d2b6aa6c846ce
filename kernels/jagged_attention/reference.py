"""Jagged softmax attention reference, plain jnp."""

import jax.numpy as jnp

from kernels.common import pair_mask


def jagged_attention_reference(q, k, v, q_offsets, kv_offsets, *, sm_scale=None,
                               causal=False, window=None):
    """softmax(Q K^T * sm_scale) V per sample; rows with no valid key give 0."""
    sm_scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    m = pair_mask(q_offsets, kv_offsets, q.shape[0], k.shape[0], causal, window)[None]
    s = jnp.einsum("qhd,khd->hqk", q.astype(jnp.float32), k.astype(jnp.float32)) * sm_scale
    s = jnp.where(m, s, -jnp.inf)
    mx = jnp.max(s, axis=-1, keepdims=True)
    mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
    p = jnp.where(m, jnp.exp(s - mx), 0.0)
    p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)
    return jnp.einsum("hqk,khd->qhd", p, v.astype(jnp.float32)).astype(q.dtype)
