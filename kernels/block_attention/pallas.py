"""BlockAttention on the Pallas Triton backend: block mask + RoPE fused into the tiles."""

import jax

from kernels.jagged_flash import FlashConfig, jagged_flash

TILES = dict(bq=64, bk=64, bq_dkv=64, bk_dkv=64, num_warps=4, num_stages=2,
             num_warps_bwd=4, num_stages_bwd=2)


def block_attention_pallas(q, k, v, offsets, *, block=64, positions=None, rope_theta=10_000.0,
                           sm_scale=None, **tiles):
    """Same contract as kernels.block_attention.block_attention."""
    sm_scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    cfg = FlashConfig(mode="softmax", scale=float(sm_scale), block=block, rope=True,
                      interpret=jax.default_backend() != "gpu", **{**TILES, **tiles})
    return jagged_flash(cfg, q, k, v, offsets, offsets, rope_positions=positions,
                        rope_theta=float(rope_theta))
