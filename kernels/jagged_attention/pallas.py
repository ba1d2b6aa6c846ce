"""Jagged softmax attention on the Pallas Triton backend (kernels/jagged_flash.py)."""

import jax

from kernels.jagged_flash import FlashConfig, jagged_flash

TILES = dict(bq=64, bk=64, bq_dkv=64, bk_dkv=64, num_warps=4, num_stages=3,
             num_warps_bwd=4, num_stages_bwd=2)


def jagged_attention_pallas(q, k, v, q_offsets, kv_offsets, *, sm_scale=None, causal=False,
                            window=None, **tiles):
    """Same contract as kernels.jagged_attention.jagged_attention."""
    sm_scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    cfg = FlashConfig(mode="softmax", scale=float(sm_scale), causal=causal, window=window,
                      interpret=jax.default_backend() != "gpu", **{**TILES, **tiles})
    return jagged_flash(cfg, q, k, v, q_offsets, kv_offsets)
