"""GDPA on the Pallas Triton backend (kernels/jagged_flash.py, mode "gdpa")."""

import jax
import jax.numpy as jnp

from kernels.jagged_flash import FlashConfig, jagged_flash

# Tiles measured on the H200 (docs/kernels.md); interpret mode uses the same.
TILES = dict(bq=64, bk=64, bq_dkv=64, bk_dkv=64, num_warps=4, num_stages=3,
             num_warps_bwd=4, num_stages_bwd=2)


def gdpa_pallas(q, k, v, q_offsets, kv_offsets, *, activation="silu", scale=1.0, causal=False,
                window=None, **tiles):
    """Same contract as kernels.gdpa.gdpa; `tiles` overrides TILES (benchmarks)."""
    # 16-bit inputs: silu / gelu_tanh through tanh.approx (~5e-4 relative, far below
    # bf16's 2e-2 budget); float32 keeps the exact formulas.
    fast = jnp.dtype(q.dtype).itemsize == 2
    cfg = FlashConfig(mode="gdpa", activation=activation, scale=float(scale), causal=causal,
                      window=window, interpret=jax.default_backend() != "gpu",
                      **{**TILES, "fast_act": fast, **tiles})
    return jagged_flash(cfg, q, k, v, q_offsets, kv_offsets)
