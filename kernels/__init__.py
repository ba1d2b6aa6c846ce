"""Jagged attention kernels, each a package with a jnp reference and a Pallas version.

Public ops (packed jagged tokens; offsets [B+1] int32; rows past offsets[-1] are padding):
    gdpa(q, k, v, q_offsets, kv_offsets, *, activation="silu", scale=1.0, causal=False,
         window=None, impl=None)                 q [Tq,H,D], k/v [Tk,H,D] -> [Tq,H,D]
    jagged_attention(q, k, v, q_offsets, kv_offsets, *, sm_scale=None, causal=False,
                     window=None, impl=None)
    block_attention(q, k, v, offsets, *, block=64, positions=None, rope_theta=10_000.0,
                    sm_scale=None, impl=None)
impl=None picks per call, from static facts (backend, head dim, dtype, masks, capacities):
on GPU, gdpa and jagged_attention run "mosaic" (the Mosaic GPU kernels on Hopper, forward
and backward; the Pallas Triton kernels wherever those do not apply: masks, float32, head
dims other than 64 / 128, short samples, other GPUs) and block_attention its Pallas
Triton kernels; off GPU every op runs its jnp reference. "reference" forces jnp,
"pallas" the Triton kernels, "mosaic" (gdpa, jagged_attention) the Mosaic GPU kernels;
off GPU the kernels run in their interpreters. Head dims the kernels do not take as is
are zero-padded (kernels.common.padded_head_dim), or run the reference where padding
cannot help. Design, tuning and measured speed: docs/kernels.md.
"""

from kernels.block_attention import block_attention
from kernels.gdpa import gdpa
from kernels.jagged_attention import jagged_attention

__all__ = ["block_attention", "gdpa", "jagged_attention"]
