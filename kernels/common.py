"""Shared helpers for the jagged kernels' references."""

import jax.numpy as jnp


def segment_layout(offsets, capacity):
    """(segment_ids [T], positions [T]) from offsets [B+1]; padding rows get segment B."""
    t = jnp.arange(capacity, dtype=jnp.int32)
    seg = jnp.searchsorted(offsets[1:], t, side="right").astype(jnp.int32)
    b = offsets.shape[0] - 1
    seg = jnp.where(t < offsets[-1], seg, b)
    pos = t - jnp.take(offsets, jnp.minimum(seg, b - 1) if b > 0 else seg * 0, axis=0)
    pos = jnp.where(seg < b, pos, 0)
    return seg, pos


def pair_mask(q_offsets, kv_offsets, tq, tk, causal=False, window=None):
    """[Tq, Tk] bool: query i may attend key j.

    Same sample; causal: pos_k <= pos_q; window w: pos_q - pos_k < w (causal) or
    |pos_q - pos_k| < w (non-causal).
    """
    b = q_offsets.shape[0] - 1
    qs, qp = segment_layout(q_offsets, tq)
    ks, kp = segment_layout(kv_offsets, tk)
    m = (qs[:, None] == ks[None, :]) & (qs[:, None] < b)
    d = qp[:, None] - kp[None, :]
    if causal:
        m &= d >= 0
    if window is not None:
        m &= (d < window) if causal else (jnp.abs(d) < window)
    return m
