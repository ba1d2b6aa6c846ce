"""Sorted segment sum reference in plain jnp: XLA's segment_sum over gathered rows."""

import jax
import jax.numpy as jnp


def sorted_segment_sum_reference(g, idx, seg, num_segments):
    """out[s] = sum of g[idx[p]] (float32) over the positions p with seg[p] == s.

    g [M, D] float (or a tuple of sources [M_j, D]: their row concatenation), idx [N]
    int32 (rows of g), seg [N] int32 non-decreasing, num_segments K (static) -> float32
    [K, D]. Positions whose seg lies outside [0, K) add nothing; rows no position names
    are 0.
    """
    if isinstance(g, (tuple, list)):
        g = g[0] if len(g) == 1 else jnp.concatenate(g)
    rows = jnp.take(g, idx, axis=0).astype(jnp.float32)
    return jax.ops.segment_sum(rows, seg, num_segments=num_segments, indices_are_sorted=True)
