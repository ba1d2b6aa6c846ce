"""Pieces the Mosaic forward and backward kernels share: the activations (and their
derivatives) in ops Mosaic GPU lowers, the work items of a CTA, the producer warpgroup,
a consumer's walk over its CTA's streamed tiles, masks and wgmma helpers."""

import functools
import math

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels.mosaic.layout import BASE_COL, WG_COLS
from kernels.mosaic.tuning import F32, NUM_CONSUMERS


# Abramowitz & Stegun 7.1.26 (|error| < 1.5e-7): Mosaic GPU has no erf lowering.
_ERF_P = 0.3275911
_ERF_A = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)


def _erf(x):
    a = jnp.abs(x)
    t = 1.0 / (1.0 + _ERF_P * a)
    poly = _ERF_A[4]
    for c in _ERF_A[3::-1]:
        poly = poly * t + c
    y = 1.0 - poly * t * jnp.exp(-(a * a))
    return jnp.where(x >= 0.0, y, -y)


def activation_times_scale(s, activation, scale):
    """act(s) * scale in s's type, written with ops Mosaic GPU lowers (tanh is one
    tanh.approx with approx_math; silu needs no exp and no divide). The Python-float
    constants keep s's type: for 16-bit s (act_packed) the multiplies and tanh run
    two lanes per instruction."""
    if activation == "silu":       # s * sigmoid(s) = h + h tanh(h), h = s / 2
        t = jnp.tanh(s * 0.5)
        hs = s * (0.5 * scale)
        return hs + hs * t
    if activation == "gelu_tanh":
        c = math.sqrt(2.0 / math.pi)
        t = jnp.tanh(s * (c + (c * 0.044715) * (s * s)))
        hs = s * (0.5 * scale)
        return hs + hs * t
    if activation == "gelu":
        hs = s * (0.5 * scale)
        return hs + hs * _erf(s * (1.0 / math.sqrt(2.0)))
    if activation == "relu":
        return jnp.maximum(s, 0.0) * scale
    if activation == "identity":
        return s * scale
    raise ValueError(f"unknown activation {activation!r}")


def activation_grad_times_scale(s, activation, scale):
    """d act(s) / ds * scale in float32, in ops Mosaic GPU lowers (the backward's dS)."""
    zero = s * 0.0
    if activation == "silu":       # sig (1 + s (1 - sig)), sig = 1/2 + tanh(s/2)/2
        sig = 0.5 + 0.5 * jnp.tanh(s * 0.5)
        return sig * (1.0 + s * (1.0 - sig)) * scale
    if activation == "gelu_tanh":
        c = math.sqrt(2.0 / math.pi)
        t = jnp.tanh(s * (c + (c * 0.044715) * (s * s)))
        du = c + (3.0 * c * 0.044715) * (s * s)
        return (0.5 * (1.0 + t) + (0.5 * s) * (1.0 - t * t) * du) * scale
    if activation == "gelu":       # Phi(s) + s phi(s)
        phi = jnp.exp(s * s * -0.5) * (1.0 / math.sqrt(2.0 * math.pi))
        return (0.5 + 0.5 * _erf(s * (1.0 / math.sqrt(2.0))) + s * phi) * scale
    if activation == "relu":
        return jnp.where(s > 0.0, zero + scale, zero)
    if activation == "identity":
        return zero + scale
    raise ValueError(f"unknown activation {activation!r}")


def work_items():
    """This CTA's work items as (count, item(i) -> (table row, head)): one, the grid's
    (tile, head); the table lists the tiles heaviest-first."""
    row, head = lax.axis_index("tile"), lax.axis_index("head")
    return 1, lambda i: (row, head)


def for_items(count, item, body):
    """carry = body(row, head, carry) over the items, from carry 0 (the global key step)."""
    if isinstance(count, int) and count == 1:
        return body(*item(0), jnp.int32(0))
    return pl.loop(0, count, init_carry=jnp.int32(0))(lambda i, g0: body(*item(i), g0))


def produce(table_ref, a_ref, b_ref, a_smem, b_smem, a_bar, b_bar, a_free, b_free, *, tile,
             stages, count, item):
    """The producer warpgroup: per work item, tiles [c_lo, c_hi) of a_ref and b_ref
    ([T, H, D], `tile` rows each) into the slot ring, slot = global step % stages."""
    def one_item(row, head, g0):
        c_lo = table_ref[row, 1]
        c_hi = table_ref[row, 2]
        base = pl.multiple_of(table_ref[row, BASE_COL], 8)   # TMA tile rows: see tile_table

        @pl.loop(c_lo, c_hi)
        def _(j):
            g = g0 + j - c_lo
            slot = lax.rem(g, jnp.int32(stages))
            rows = pl.ds(base + j * tile, tile)
            # step g - stages used this slot: wait until both consumers released it
            pl.when(g >= stages)(lambda: plgpu.barrier_wait(a_free.at[slot]))
            plgpu.copy_gmem_to_smem(a_ref.at[rows, head], a_smem.at[slot], a_bar.at[slot])
            pl.when(g >= stages)(lambda: plgpu.barrier_wait(b_free.at[slot]))
            plgpu.copy_gmem_to_smem(b_ref.at[rows, head], b_smem.at[slot], b_bar.at[slot])
        return g0 + (c_hi - c_lo)

    total = for_items(count, item, one_item)

    # Observe the last releases too: harmless on the GPU, and the interpreter wants
    # every phase of a barrier a thread waits on to be seen by that thread.
    @pl.loop(jnp.maximum(total - stages, 0), total)
    def _drain(g):
        plgpu.barrier_wait(a_free.at[lax.rem(g, jnp.int32(stages))])
        plgpu.barrier_wait(b_free.at[lax.rem(g, jnp.int32(stages))])


def item_tiles(table_ref, row, wg, cfg):
    """Consumer wg's part of CTA table row `row`: (c_lo, c_hi, (lo, flo, fhi, hn, hi),
    row0, base), row0 its first stationary row, base the first streamed row of tile 0."""
    ranges = tuple(table_ref[row, 3 + WG_COLS * wg + c] for c in range(WG_COLS))
    return (table_ref[row, 1], table_ref[row, 2], ranges,
            table_ref[row, 0] * cfg.cta_rows + wg * cfg.block_q,
            pl.multiple_of(table_ref[row, BASE_COL], 8))


def load_stationary(copies, bar, wg):
    """TMA each (gmem, smem) of `copies` on its own barrier (bar.at[i * NUM_CONSUMERS + wg]:
    a copy arrives once) after the last output store has left shared memory; returns the
    wait for all of them."""
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    for i, (src, dst) in enumerate(copies):
        plgpu.copy_gmem_to_smem(src, dst, bar.at[i * NUM_CONSUMERS + wg])

    def wait():
        for i in range(len(copies)):
            plgpu.barrier_wait(bar.at[i * NUM_CONSUMERS + wg])
    return wait


def walk_ranges(c_lo, c_hi, ranges, narrow):
    """A consumer's loops over its CTA's tiles [c_lo, c_hi) (module docstring), ranges =
    (lo, flo, fhi, hn, hi) from item_tiles: (first, last, kind) with kind "skip"
    (barriers only), "masked", "plain" or, where `narrow` (cfg.narrow in the forward;
    else hn = hi), "narrow" (masked, the tile's first half only)."""
    lo, flo, fhi, hn, hi = ranges
    last = ((fhi, hn, "masked"), (hn, hi, "narrow")) if narrow else ((fhi, hi, "masked"),)
    return ((c_lo, lo, "skip"), (lo, flo, "masked"), (flo, fhi, "plain"), *last,
            (hi, c_hi, "skip"))


def run_walk(spans, step, carry, release=None):
    """carry = step(j, kind, carry) over the spans of walk_ranges (carry None: no carry).
    With `release` (deferred wgmma waits) carry[-1] is the slot whose last wgmmas are
    still in flight (-1: none); after the last compute span they are awaited and
    release(slot) frees the slot, before the trailing skip steps wait on later slots
    (the producer refills that slot only once it is free)."""
    def loop(span, carry):
        a, b, kind = span
        body = functools.partial(lambda j, c, kind: step(j, kind, c), kind=kind)
        if carry is None:
            pl.loop(a, b)(functools.partial(body, c=None))
            return None
        return pl.loop(a, b, init_carry=carry)(body)
    for span in spans[:-1]:
        carry = loop(span, carry)
    if release is not None:
        plgpu.wgmma_wait(0)
        pend = carry[-1]
        pl.when(pend >= 0)(lambda: release(pend))
    return loop(spans[-1], carry)


def scores_nt(a_smem, b_smem, rows, cols):
    """a_smem [rows, D] @ b_smem [cols, D]^T as a float32 register tile (wgmma, waited)."""
    def f(acc_ref):
        plgpu.wgmma(acc_ref, a_smem, b_smem.transpose((1, 0)))
        return acc_ref[...]
    return pl.run_scoped(f, plgpu.ACC((rows, cols), F32))


def tile_mask(start, end, col0, rows, cols):
    """valid [rows, cols]: column col0 + c lies in its row's [start, end)."""
    col = plgpu.broadcasted_iota(jnp.int32, (rows, cols), 1, layout=plgpu.Layout.WGMMA)
    a = lax.broadcast_in_dim(start - col0, (rows, cols), [0])
    b = lax.broadcast_in_dim(end - col0, (rows, cols), [0])
    return (col >= a) & (col < b)


def mma_from(acc_ref, x16, stage, b_smem):
    """acc += x16 @ b_smem with x16 from registers, or staged in shared memory (stage)."""
    if stage is None:
        plgpu.wgmma(acc_ref, x16, b_smem)
    else:
        stage[...] = x16
        plgpu.commit_smem()
        plgpu.wgmma(acc_ref, stage, b_smem)
