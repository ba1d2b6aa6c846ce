"""Jagged attention kernels, each a package with a jnp reference and a Pallas version.

Public ops (packed jagged tokens; offsets [B+1] int32; rows past offsets[-1] are padding):
    gdpa(q, k, v, q_offsets, kv_offsets, *, activation="silu", scale=1.0, causal=False,
         window=None, impl=None)                 q [Tq,H,D], k/v [Tk,H,D] -> [Tq,H,D]
    jagged_attention(q, k, v, q_offsets, kv_offsets, *, sm_scale=None, causal=False,
                     window=None, impl=None)
    block_attention(q, k, v, offsets, *, block=64, positions=None, rope_theta=10_000.0,
                    sm_scale=None, impl=None)
impl: None picks the fastest that runs here (Pallas Triton on GPU, jnp reference
elsewhere), "reference" forces jnp, "pallas" forces the kernel (interpret mode off GPU).
"""

from kernels.block_attention import block_attention
from kernels.gdpa import gdpa
from kernels.jagged_attention import jagged_attention

__all__ = ["block_attention", "gdpa", "jagged_attention"]
