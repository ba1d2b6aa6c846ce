"""Sorted segment sum on the Pallas Triton engine: one pass over the sorted positions.

    out[s] = sum of g[idx[p]] (float32) over the positions p with seg[p] == s

g [M, D] (bf16, f16 or f32), idx [N] int32, seg [N] int32 non-decreasing,
K = num_segments -> out float32 [K, D]. g may be given as sources g_0, ..., g_{S-1}
([M_j, D] each, one dtype) standing for their concatenation along the rows, so a caller
with rows in several arrays need not copy them into one: a position's row is loaded from
the source whose rows hold idx (masked loads, one of which touches memory).

Grid (blocks of BN positions + row chunks of BR rows, ceil(D / BD) column tiles):

  position block b (positions [b BN, (b + 1) BN)):
    rank[j] = number of seg changes before lane j inside the block (a cumsum), so the
    block's distinct segments are ranks 0..last; the gathered rows X = g[idx[p]]
    [BN, BD] are summed per rank by a one-hot matmul, S [BN, BN] with
    S[i, j] = (rank[j] == i):  acc = S @ X, float32 accumulation. 16-bit X goes in
    as is (products by 0 / 1 are exact); float32 X is split into three bf16 parts,
    hi + mid + lo == x for normal numbers, and acc = S @ lo + S @ mid + S @ hi.
    Non-finite values are taken out of X (0 * Inf would spread NaN to every segment
    of the block); where a block has any, a second matmul counts each segment's NaN,
    +Inf and -Inf (base-256 digits of one bf16 flag per element, exact for BN <= 255)
    and sets NaN / +Inf / -Inf as a sequential float32 sum would.
    Ranks strictly between the first and the last are segments that lie wholly in
    the block: stored straight into out (rows ascending, one per rank; rows between
    two of them that no position names get the zeros the matmul gives them).
    The first and the last rank may continue into the neighbouring blocks: their
    sums go to partials [2 nb, D], rows 2b and 2b + 1 (the second 0 when the block
    holds one segment).
  row chunk z (rows [z BR, (z + 1) BR)): zeros into the rows no position names
    (`present` is 0): gaps between blocks and the rows past the last segment.

Then the partials, 2 nb rows with non-decreasing targets (the blocks' first and
last seg), are summed per target (this kernel again on the float32 partials, whose
blocks shrink them BN / 2 times per level, down to `direct_partials` rows, which
one masked XLA reduction sums) and set into out at their target rows (one scatter
of distinct rows). Every row of out is written once: by a block,
a row chunk, or the partials' scatter; no atomics, no zero-initialised buffer,
and the result is the same bits on every run.

Positions whose seg lies outside [0, K) add nothing (the reference's segment_sum
drops them). seg must be non-decreasing (unchecked: it is traced).

Interpret mode (off GPU) runs the same kernel on the CPU. Its masked stores write
the old value back at the masked lanes' indices, so masked lanes there point at an
extra dump row K and out carries padding columns up to a multiple of BD (both
sliced off); on GPU masked lanes touch no memory and out is exactly [K, D].
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels.common import pow2_at_least

Array = Any
F32 = jnp.float32
BF16 = jnp.bfloat16
# block_n: positions per block (BN, the one-hot matmul is BN x BN x BD); block_d: columns
# per program (BD); block_rows: rows per zero-fill program (BR); direct_partials: the
# largest partials count summed by one XLA reduction over a [P, P, D] masked copy (above
# it this kernel recurses).
# Timed on one H200 (benchmarks/bench_segment_sum.py --sweep: N = 2.6M, D = 512, bf16,
# Zipf 1.1 over 2M ids, blocking calls, the last <= 4096 partials then summed by XLA's
# segment_sum): BN/BD/warps 32/128/4 4.15 ms, 32/256/4 4.51, 32/128/2 4.59, 16/256/4
# 4.85, 64/128/4 6.10, 128/128/8 9.20 (XLA's segment_sum alone 14.6). The [BN, BN] rank
# and row work per program grows as BN^2, hence the small blocks. A variant without
# ranks (S[i, j] = seg[i] == seg[j], each run stored from its first lane) was slower at
# BN = 32 (4.97 ms) in a later run where XLA's time repeated (14.7 ms).
KNOBS = dict(block_n=32, block_d=128, block_rows=128, num_warps=4, num_stages=1,
             direct_partials=64)
# flag of a non-finite element, counted per segment by the flags matmul (base 256)
_NAN, _PINF, _NINF = 1.0, 256.0, 65536.0
_NONE = jnp.iinfo(jnp.int32).min


def split_bf16(x: Array) -> tuple[Array, Array, Array]:
    """float32 x -> (hi, mid, lo) bfloat16 with hi + mid + lo == x exactly for finite
    normal x: each part rounds the remainder of the ones before (8 bits each)."""
    hi = x.astype(BF16)
    r = x - hi.astype(F32)
    mid = r.astype(BF16)
    lo = (r - mid.astype(F32)).astype(BF16)
    return hi, mid, lo


def _segment_matmul(one_hot: Array, x: Array) -> Array:
    """Per-rank float32 sums S @ X: one_hot [BN, BN] bool (S), x [BN, BD] -> [BN, BD]."""
    finite = jnp.isfinite(x)
    xc = jnp.where(finite, x, jnp.zeros((), x.dtype))
    if x.dtype == F32:
        s = one_hot.astype(BF16)
        hi, mid, lo = split_bf16(xc)
        acc = jnp.dot(s, lo, preferred_element_type=F32)
        acc = acc + jnp.dot(s, mid, preferred_element_type=F32)
        acc = acc + jnp.dot(s, hi, preferred_element_type=F32)
    else:
        acc = jnp.dot(one_hot.astype(x.dtype), xc, preferred_element_type=F32)
    bad = jnp.max(jnp.where(finite, 0, 1))

    def with_non_finite(acc):
        flag = jnp.where(jnp.isnan(x), _NAN, jnp.where(x > 0, _PINF, _NINF))
        flag = jnp.where(finite, 0.0, flag).astype(BF16)
        count = jnp.dot(one_hot.astype(BF16), flag, preferred_element_type=F32).astype(jnp.int32)
        nan = (count & 255) > 0
        pinf = ((count >> 8) & 255) > 0
        ninf = (count >> 16) > 0
        return jnp.where(nan | (pinf & ninf), jnp.nan,
                         jnp.where(pinf, jnp.inf, jnp.where(ninf, -jnp.inf, acc)))

    return lax.cond(bad > 0, with_non_finite, lambda acc: acc, acc)


def _gather(g_refs, starts, src2, cols2, mask):
    """Rows src2 [BN, BD] of the sources' concatenation (source j holds rows
    [starts[j], starts[j + 1])); masked lanes 0."""
    if len(g_refs) == 1:
        return plgpu.load(g_refs[0].at[src2, cols2], mask=mask, other=0)
    x = None
    for ref, lo, hi in zip(g_refs, starts[:-1], starts[1:]):
        here = (src2 >= lo) & (src2 < hi)
        part = plgpu.load(ref.at[jnp.clip(src2 - lo, 0, hi - lo - 1), cols2],
                          mask=mask & here, other=0)
        x = part if x is None else jnp.where(here, part, x)
    return x


def _position_block(b, c0, cols, col_ok, seg_ref, idx_ref, g_refs, out_ref, part_ref, *, n, k,
                    bn, starts):
    """Position block b: its interior segments into out, its first / last into partials."""
    bd = cols.shape[0]
    p0 = b * bn
    lanes = lax.broadcasted_iota(jnp.int32, (bn,), 0)
    cur = seg_ref[pl.ds(p0 + 1, bn)]              # seg_ref is seg shifted by one (seg[0] first)
    prev = seg_ref[pl.ds(p0, bn)]
    src = idx_ref[pl.ds(p0, bn)]
    live = p0 + lanes < n
    rank = jnp.cumsum(((cur != prev) & (lanes > 0)).astype(jnp.int32))
    last = jnp.max(rank)
    shape = (bn, bd)
    src2 = jnp.broadcast_to(src[:, None], shape)
    cols2 = jnp.broadcast_to(cols[None, :], shape)
    x = _gather(g_refs, starts, src2, cols2, live[:, None] & col_ok[None, :])
    one_hot = rank[None, :] == lanes[:, None]                     # [rank i, lane j]
    acc = _segment_matmul(one_hot, x)
    rows = jnp.max(jnp.where(one_hot, cur[None, :], _NONE), axis=1)      # seg of rank i
    inner = (lanes > 0) & (lanes < last) & (rows >= 0) & (rows < k)
    rows2 = jnp.broadcast_to(jnp.where(inner, rows, k)[:, None], shape)
    plgpu.store(out_ref.at[rows2, cols2], acc, mask=inner[:, None] & col_ok[None, :])
    first = jnp.sum(jnp.where(lanes[:, None] == 0, acc, 0.0), axis=0)
    end = jnp.sum(jnp.where((lanes[:, None] == last) & (last > 0), acc, 0.0), axis=0)
    plgpu.store(part_ref.at[2 * b, pl.ds(c0, bd)], first, mask=col_ok)
    plgpu.store(part_ref.at[2 * b + 1, pl.ds(c0, bd)], end, mask=col_ok)


def _zero_rows(z, cols, col_ok, present_ref, out_ref, *, k, br):
    """Row chunk z: zeros into its rows that no position names."""
    bd = cols.shape[0]
    rows = z * br + lax.broadcasted_iota(jnp.int32, (br,), 0)
    ok = rows < k
    named = plgpu.load(present_ref.at[jnp.where(ok, rows, 0)], mask=ok, other=1)
    ok = ok & (named == 0)
    shape = (br, bd)
    rows2 = jnp.broadcast_to(jnp.where(ok, rows, k)[:, None], shape)
    cols2 = jnp.broadcast_to(cols[None, :], shape)
    plgpu.store(out_ref.at[rows2, cols2], jnp.zeros(shape, F32),
                mask=ok[:, None] & col_ok[None, :])


def _kernel(seg_ref, idx_ref, present_ref, *refs, n, k, d, bn, bd, br, nb, starts):
    g_refs, (out_ref, part_ref) = refs[:-2], refs[-2:]
    b, c = pl.program_id(0), pl.program_id(1)
    cols = c * bd + lax.broadcasted_iota(jnp.int32, (bd,), 0)
    col_ok = cols < d

    @pl.when(b < nb)
    def _():
        _position_block(b, c * bd, cols, col_ok, seg_ref, idx_ref, g_refs, out_ref, part_ref,
                        n=n, k=k, bn=bn, starts=starts)

    @pl.when(b >= nb)
    def _():
        _zero_rows(b - nb, cols, col_ok, present_ref, out_ref, k=k, br=br)


def _full(shape):
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def _one_pass(gs, idx, seg, k, knobs, interpret):
    """The kernel over the sources gs: (out [K, D] f32 with the blocks' boundary rows unset,
    partials [2 nb, D] f32 (rows 2b, 2b + 1: block b's first and last segment), seg padded
    and shifted [nb BN + 1])."""
    n, d = seg.shape[0], gs[0].shape[1]
    starts = tuple(int(x) for x in np.cumsum([0] + [g.shape[0] for g in gs]))
    bn, bd, br = knobs["block_n"], knobs["block_d"], knobs["block_rows"]
    nb = -(-n // bn)
    pad = nb * bn - n
    seg_p = jnp.concatenate([seg[:1], seg, jnp.broadcast_to(seg[-1:], (pad,))])
    idx_p = jnp.pad(idx, (0, pad))
    start = jnp.concatenate([jnp.ones((1,), bool), seg[1:] != seg[:-1]]) & (seg >= 0) & (seg < k)
    present = jnp.zeros((k,), jnp.int8).at[jnp.where(start, seg, k)].set(1, mode="drop")
    # interpret mode: a dump row for masked lanes and whole column tiles (module docstring)
    kp, dp = (k + 1, -(-d // bd) * bd) if interpret else (k, d)
    ins = (seg_p, idx_p, present, *gs)
    kernel = functools.partial(_kernel, n=n, k=k, d=d, bn=bn, bd=bd, br=br, nb=nb, starts=starts)
    out, part = pl.pallas_call(
        kernel, grid=(nb + -(-k // br), -(-d // bd)),
        in_specs=[_full(x.shape) for x in ins],
        out_specs=[_full((kp, dp)), _full((2 * nb, dp))],
        out_shape=[jax.ShapeDtypeStruct((kp, dp), F32), jax.ShapeDtypeStruct((2 * nb, dp), F32)],
        compiler_params=plgpu.CompilerParams(num_warps=knobs["num_warps"],
                                             num_stages=knobs["num_stages"]),
        interpret=interpret, name="sorted_segment_sum",
    )(*ins)
    return out[:k, :d], part[:, :d], seg_p


def segment_sum_pallas(g, idx: Array, seg: Array, num_segments: int, *,
                       interpret: bool, knobs: dict) -> Array:
    """The kernel pass, then the partials summed per target row and set into out.
    g: one [M, D] array or a tuple of sources (module docstring)."""
    gs = tuple(g) if isinstance(g, (tuple, list)) else (g,)
    n, d = seg.shape[0], gs[0].shape[1]
    k = num_segments
    if n == 0 or k == 0:
        return jnp.zeros((k, d), F32)
    out, part, seg_p = _one_pass(gs, idx, seg, k, knobs, interpret)
    bn, nb = knobs["block_n"], part.shape[0] // 2
    # targets of the partials: each block's first and last seg, non-decreasing
    tgt = jnp.stack([seg_p[1::bn][:nb], seg_p[bn::bn][:nb]], axis=1).reshape(-1)
    new = jnp.concatenate([jnp.ones((1,), bool), tgt[1:] != tgt[:-1]])
    dense = jnp.cumsum(new.astype(jnp.int32)) - 1                       # [2 nb] 0, 0, 1, ...
    ok = (tgt >= 0) & (tgt < k)
    rows = jnp.full((2 * nb,), k, jnp.int32).at[jnp.where(new, dense, 2 * nb)].set(
        jnp.where(ok, tgt, k), mode="drop")
    if 2 * nb <= knobs["direct_partials"]:
        # a fixed-order XLA reduction (XLA's segment_sum adds with atomics, in no fixed order)
        hit = dense[None, :] == jnp.arange(2 * nb, dtype=jnp.int32)[:, None]
        sums = jnp.sum(jnp.where(hit[:, :, None], part[None], 0.0), axis=1)
    else:
        sums = segment_sum_pallas(part, jnp.arange(2 * nb, dtype=jnp.int32), dense, 2 * nb,
                                  interpret=interpret, knobs=knobs)
    return out.at[rows].set(sums, mode="drop")


def check_knobs(knobs: dict) -> dict:
    """KNOBS with `knobs` applied; ValueError names a bad one."""
    unknown = set(knobs) - set(KNOBS)
    if unknown:
        raise ValueError(f"sorted_segment_sum: unknown knobs {sorted(unknown)} "
                         f"(have {sorted(KNOBS)})")
    knobs = {**KNOBS, **knobs}
    for name in ("block_n", "block_d", "block_rows"):
        if not pow2_at_least(knobs[name], 16):
            raise ValueError(f"sorted_segment_sum: {name} must be a power of two >= 16 "
                             f"(Triton tiles), got {knobs[name]}")
    if knobs["block_n"] > 128:
        raise ValueError(f"sorted_segment_sum: block_n must be <= 128 (the non-finite counts "
                         f"are base-256 digits), got {knobs['block_n']}")
    if knobs["direct_partials"] < 2:
        raise ValueError(f"sorted_segment_sum: direct_partials must be >= 2, got "
                         f"{knobs['direct_partials']}")
    return knobs
