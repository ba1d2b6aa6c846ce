"""BlockAttention forward on Pallas Mosaic GPU (Hopper): TMA loads at each block's
unaligned start, RoPE in registers, two wgmmas per block.

The per-block Triton kernel (kernels/block_attention/pallas.py) streams q, k, v with
plain masked loads; this one moves them with TMA and prefetches the next block while
the current one computes, for W4, a workload bound by memory traffic. Same block
table (pallas.block_table), same RoPE angles (kernels.common.rope_angle), same
contract: out [Tp, H, D] with every row below each program's write length written
once (tail programs store zeros), nothing memset. The backward stays the Triton
per-block kernel (it recomputes P from q and k, so it needs nothing from here).

Per CTA: one warpgroup, `group` consecutive blocks of one head. Per block:
  * TMA of the block's [block, D] rows of q, k, v into plain (unswizzled) shared
    memory. Their start is any row, and Mosaic's tiled / swizzled layouts need
    starts that are multiples of 8, hence plain buffers; rows past the tensor's end
    come back as zeros (TMA bounds) and rows past the block are masked as keys.
  * q and k rotated (RoPE, rotate-half) in registers into swizzled [block, D/2] halves,
    v copied into a swizzled [block, D] tile: the wgmma operands. Then the plain
    buffers are free and the next block's TMA starts.
  * S = q1 k1^T + q2 k2^T (two wgmmas into one accumulator), keys past the block's
    length masked, softmax in base 2 in registers, O = P V (P from registers) / l.
  * O staged in plain shared memory and stored with one TMA for a full block, or row
    by row (a TMA per row below the write length) for a block shorter than `block`,
    whose window runs into the next block's rows.

Head dims: D = 128 or 64 (halves of 64 / 32 elements: 128- / 64-byte swizzle).
Blocks: 64. Inputs bf16 / f16. `interpret=True` runs Mosaic's CPU interpreter (P
staged in shared memory there: its wgmma reads shared memory only).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels.common import floor_by_truncation, rope_angle
from kernels.mosaic_flash import mma_from

F32 = jnp.float32
LOG2E = 1.4426950408889634
NEG = -1e30


def supports(block, d, dtype):
    """Whether this kernel takes the shape (else the Triton per-block kernel runs)."""
    return block == 64 and d in (64, 128) and jnp.dtype(dtype) in (
        jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _swizzled(shape, dtype):
    """Shared memory in the wgmma layout: 8-row tiles of a 128-byte (or narrower) row."""
    row_bytes = shape[-1] * jnp.dtype(dtype).itemsize
    swizzle = min(128, row_bytes)
    return plgpu.SMEM(shape, dtype, transforms=(
        plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
        plgpu.SwizzleTransform(swizzle)))


def _kernel(start_ref, len_ref, wlen_ref, pos_ref, f1_ref, f2_ref, f3_ref, q_ref, k_ref, v_ref,
            o_ref, raw, qh, kh, vs, p_smem, o_smem, bar, *, block, scale, cs, group):
    d = q_ref.shape[-1]
    half = d // 2
    dt = q_ref.dtype
    head = lax.axis_index("head")
    first = lax.axis_index("prog") * group
    wgmma_l = plgpu.Layout.WGMMA
    rows_l, cols_l = wgmma_l.reduce(1), wgmma_l.reduce(0)

    def fetch(n):
        rows = pl.ds(start_ref[n], block)
        for i, ref in enumerate((q_ref, k_ref, v_ref)):
            plgpu.copy_gmem_to_smem(ref.at[rows, head], raw.at[i], bar.at[i])

    load = lambda ref: plgpu.load(ref, layout=wgmma_l, optimized=False).astype(F32)  # noqa: E731
    freqs = [plgpu.load(f.at[:], layout=cols_l, optimized=False) for f in (f1_ref, f2_ref, f3_ref)]
    fetch(first)

    @pl.loop(0, group)
    def _block(g):
        n = first + g
        s0, ln, wl = start_ref[n], len_ref[n], wlen_ref[n]
        for i in range(3):
            plgpu.barrier_wait(bar.at[i])
        # RoPE: the angle of (position, frequency), as the Triton kernel forms it
        pos = plgpu.load(pos_ref.at[pl.ds(s0, block)], layout=rows_l, optimized=False)
        p = lax.broadcast_in_dim(pos.astype(F32), (block, half), [0])
        f1, f2, f3 = (lax.broadcast_in_dim(f, (block, half), [1]) for f in freqs)
        a = rope_angle(p, f1, f2, f3, cs, floor=floor_by_truncation)
        cos, sin = jnp.cos(a), jnp.sin(a)
        for i, dst in ((0, qh), (1, kh)):
            x1, x2 = load(raw.at[i, :, pl.ds(0, half)]), load(raw.at[i, :, pl.ds(half, half)])
            dst.at[0][...] = (x1 * cos - x2 * sin).astype(dt)
            dst.at[1][...] = (x2 * cos + x1 * sin).astype(dt)
        vs[...] = load(raw.at[2]).astype(dt)
        plgpu.commit_smem()
        pl.when(g + 1 < group)(lambda: fetch(n + 1))     # the plain buffers are free

        def qk(acc):
            plgpu.wgmma(acc, qh.at[0], kh.at[0].transpose((1, 0)))
            plgpu.wgmma(acc, qh.at[1], kh.at[1].transpose((1, 0)))
            return acc[...]
        s = pl.run_scoped(qk, plgpu.ACC((block, block), F32)) * (scale * LOG2E)
        col = plgpu.broadcasted_iota(jnp.int32, (block, block), 1, layout=wgmma_l)
        valid = col < ln
        s = jnp.where(valid, s, NEG)
        m = jnp.max(s, axis=1)
        pr = jnp.where(valid, jnp.exp2(s - lax.broadcast_in_dim(m, (block, block), [0])), 0.0)
        l = jnp.sum(pr, axis=1)
        p16 = pr.astype(dt)

        def pv(acc):
            mma_from(acc, p16, p_smem, vs)    # P from registers (staged in interpret mode)
            return acc[...]
        o = pl.run_scoped(pv, plgpu.ACC((block, d), F32))
        o = o / lax.broadcast_in_dim(jnp.where(l > 0.0, l, 1.0), (block, d), [0])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the last block's stores read o_smem
        o_smem[...] = o.astype(dt)
        plgpu.commit_smem()

        @pl.when(wl == block)
        def _full():
            plgpu.copy_smem_to_gmem(o_smem, o_ref.at[pl.ds(s0, block), head])

        @pl.when(wl < block)
        def _rows():   # the window runs into the next block: its own rows only
            @pl.loop(0, wl)
            def _(r):
                plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(r, 1)], o_ref.at[pl.ds(s0 + r, 1), head])

    plgpu.wait_smem_to_gmem(0)


def block_mosaic_forward(q, k, v, tab, pos, freqs, *, block, scale, cs, group=2,
                         interpret=False):
    """out [Tp, H, D] of BlockAttention: q / k / v [Tp, H, D] (bf16 / f16, D 64 or 128),
    tab = pallas.block_table's (start, len, write_len) [NB] with NB a multiple of
    `group`, pos [Tp + block] int32 RoPE positions (padded: a block's window reads
    `block` of them), freqs (f1, f2, f3) [D / 2] and cs from
    kernels.common.rope_freq_parts. Interpret mode: q / k / v padded by `block` rows
    (the interpreter clamps a window past the end instead of zero-filling)."""
    tp, h, d = q.shape
    if not supports(block, d, q.dtype):
        raise NotImplementedError(f"block_attention mosaic: block {block}, D={d}, {q.dtype}")
    nb = tab[0].shape[0]
    if nb % group:
        raise ValueError(f"block_attention mosaic: {nb} table rows, not a multiple of group={group}")
    half = d // 2
    params = plgpu.CompilerParams(approx_math=True)
    interp = (plgpu.InterpretGPUParams() if interpret is True else interpret) or None
    return plgpu.kernel(
        functools.partial(_kernel, block=block, scale=float(scale), cs=cs, group=group),
        out_type=jax.ShapeDtypeStruct(q.shape, q.dtype), grid=(nb // group, h),
        grid_names=("prog", "head"), num_threads=1, thread_name="wg",
        scratch_types=[plgpu.SMEM((3, block, d), q.dtype), _swizzled((2, block, half), q.dtype),
                       _swizzled((2, block, half), q.dtype), _swizzled((block, d), q.dtype),
                       _swizzled((block, block), q.dtype) if interpret else None,
                       plgpu.SMEM((block, d), q.dtype), plgpu.Barrier(num_barriers=3)],
        compiler_params=params, interpret=interp,
    )(*tab, pos, *(jnp.asarray(f, F32) for f in freqs), q, k, v)
