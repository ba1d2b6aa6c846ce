"""Jagged attention kernels, each a package with a jnp reference and fast versions.

Public ops (packed jagged tokens; offsets [B+1] int32; rows past offsets[-1] are padding):
    gdpa(q, k, v, q_offsets, kv_offsets, *, activation="silu", scale=1.0, causal=False,
         window=None, impl=None)                 q [Tq,H,D], k/v [Tk,H,D] -> [Tq,H,D]
    jagged_attention(q, k, v, q_offsets, kv_offsets, *, sm_scale=None, causal=False,
                     window=None, impl=None)
"""

from kernels.gdpa import gdpa
from kernels.jagged_attention import jagged_attention

__all__ = ["gdpa", "jagged_attention"]
