"""Row-wise Adagrad of the touched rows in plain jnp: segment_sum, gather, scatter."""

import jax
import jax.numpy as jnp

F32 = jnp.float32


def row_wise_adagrad_reference(weights, accum, rows, seg, index, g, *, lr, eps):
    """Sum each unique row's gradients and apply row-wise Adagrad to those rows.

    weights [V, D] f32/bf16, accum [V] f32, rows [K] int32 (-1 = none), seg [N] int32
    (the unique index of each sorted position), index [N] int32 into g [M, D] ->
    (weights, accum), same shapes: for each u with rows[u] >= 0 and a nonempty run,
    g_u = sum of g[index[j]] over seg[j] == u, a = accum[rows[u]] + mean(g_u^2),
    w = w - lr g_u / (sqrt(a) + eps); every other row unchanged. The contract of
    kernel.row_wise_adagrad_fused (seg non-decreasing there).
    """
    k = rows.shape[0]
    gs = jax.ops.segment_sum(jnp.take(g, index, axis=0).astype(F32), seg, num_segments=k)
    count = jax.ops.segment_sum(jnp.ones(seg.shape, jnp.int32), seg, num_segments=k)
    touch = (rows >= 0) & (count > 0)
    r = jnp.where(touch, rows, 0)
    a = accum[r] + jnp.mean(gs * gs, axis=-1)
    w = (weights[r].astype(F32) - lr * gs / (jnp.sqrt(a)[:, None] + eps)).astype(weights.dtype)
    r = jnp.where(touch, rows, weights.shape[0])                  # dropped
    return weights.at[r].set(w, mode="drop"), accum.at[r].set(a, mode="drop")
