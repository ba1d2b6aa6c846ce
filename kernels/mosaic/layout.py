"""The Mosaic kernels' layout, built in XLA from the offsets: per stationary row its
valid interval of streamed rows, and the tile table (one row per CTA in launch order)."""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu_triton

from kernels.common import interior_ranges, segment_layout, tile_ranges
from kernels.mosaic.tuning import BIG, NUM_CONSUMERS

# tile, c_lo, c_hi, then (lo, flo, fhi, hn, hi) per consumer, then the streamed tiles'
# first row (tile_table)
WG_COLS = 5
TABLE_COLS = 4 + WG_COLS * NUM_CONSUMERS
BASE_COL = TABLE_COLS - 1


def row_key_intervals(q_offsets, kv_offsets, tq):
    """Per query row the valid key interval [start, end) (its sample's keys); padding
    rows and rows of samples without keys get an empty interval (BIG, 0)."""
    b = q_offsets.shape[0] - 1
    seg, _ = segment_layout(q_offsets, tq)
    s = jnp.clip(seg, 0, b - 1)
    start = jnp.take(kv_offsets, s)
    end = jnp.take(kv_offsets, s + 1)
    ok = (seg < b) & (start < end)
    return jnp.where(ok, start, BIG).astype(jnp.int32), jnp.where(ok, end, 0).astype(jnp.int32)


def tile_table(cfg, start, end, n_cols=None):
    """[n_cta, TABLE_COLS] int32, one row per CTA in launch order.

    Columns: query CTA tile index, [c_lo, c_hi) key tiles the producer streams, then
    per consumer w (rows tile*cta_rows + w*block_q ...) its key tiles [lo, hi),
    interior [flo, fhi) and narrow tiles [hn, hi), with c_lo <= lo <= flo <= fhi <=
    hn <= hi <= c_hi (an empty consumer range is collapsed onto c_lo). hn = hi - 1
    where cfg.narrow and the consumer's rows have no key past the first half of
    their last tile (else hn = hi). Then `base`: key tile j covers keys
    [base + j block_kv, base + (j + 1) block_kv). base is 0 unless cfg.anchor; then it
    is the CTA's first valid key rounded down to 8, lowered where needed so that its
    last tile ends by n_cols (the streamed array's rows, a multiple of block_kv:
    no tile reads past it).
    """
    bq, bk = cfg.block_q, cfg.block_kv
    n = start.shape[0] // cfg.cta_rows
    base = jnp.zeros((n,), jnp.int32)
    if cfg.anchor:
        if n_cols is None or n_cols % bk:
            raise ValueError(f"tile_table: anchor needs n_cols, a multiple of {bk}, got {n_cols}")
        s_min = start.reshape(n, cfg.cta_rows).min(axis=1)
        e_max = end.reshape(n, cfg.cta_rows).max(axis=1)
        first = s_min // 8 * 8
        steps = (e_max - first + bk - 1) // bk
        base = jnp.where(e_max > s_min, jnp.clip(jnp.minimum(first, n_cols - steps * bk), 0),
                         0).astype(jnp.int32)
        shift = jnp.repeat(base, cfg.cta_rows, total_repeat_length=start.shape[0])
        start, end = start - shift, end - shift
    lo, hi = tile_ranges(start, end, bq, bk)                    # [n_wg]
    flo, fhi = interior_ranges(start, end, bq, bk, lo, hi)
    if not cfg.interior:
        flo = fhi = hi
    hn = hi
    if cfg.narrow:
        e_max = end.reshape(-1, bq).max(axis=1)
        hn = jnp.where((hi > lo) & (e_max - (hi - 1) * bk <= bk // 2), hi - 1, hi)
        flo, fhi = jnp.minimum(flo, hn), jnp.minimum(fhi, hn)
    lo, hi, flo, fhi, hn = (x.reshape(n, NUM_CONSUMERS) for x in (lo, hi, flo, fhi, hn))
    empty = hi <= lo
    c_lo = jnp.min(jnp.where(empty, BIG, lo), axis=1)
    c_hi = jnp.max(jnp.where(empty, 0, hi), axis=1)
    cta_empty = c_hi <= c_lo
    c_lo = jnp.where(cta_empty, 0, c_lo)
    c_hi = jnp.where(cta_empty, 0, c_hi)
    collapse = lambda x: jnp.where(empty, c_lo[:, None], x)
    lo, flo, fhi, hn, hi = (collapse(x) for x in (lo, flo, fhi, hn, hi))
    per_wg = jnp.stack([lo, flo, fhi, hn, hi], axis=2).reshape(n, WG_COLS * NUM_CONSUMERS)
    tile = jnp.arange(n, dtype=jnp.int32)
    table = jnp.concatenate([tile[:, None], c_lo[:, None], c_hi[:, None], per_wg,
                             base[:, None]], axis=1)
    if cfg.heavy_first:
        table = table[jnp.argsort(c_lo - c_hi, stable=True)]
    return table.astype(jnp.int32)


def build_layout(cfg, q_offsets, kv_offsets, tq, interpret=False, tk=None):
    """(table, start, end) for run_kernel, from the offsets; tq / tk: padded capacities
    (tk: needed with cfg.anchor).
    XLA ops, or one Pallas kernel with cfg.pallas_layout (interpret: as run_kernel's)."""
    q_offsets, kv_offsets = q_offsets.astype(jnp.int32), kv_offsets.astype(jnp.int32)
    if cfg.pallas_layout:
        return pallas_layout(cfg, q_offsets, kv_offsets, tq, interpret=bool(interpret))
    start, end = row_key_intervals(q_offsets, kv_offsets, tq)
    return tile_table(cfg, start, end, tk), start, end


def _layout_kernel(qo_ref, ko_ref, table_ref, start_ref, end_ref, *, cfg, b):
    """CTA tile p: its rows' key intervals (row_key_intervals) and its table row
    (tile_table's columns, padded to 16; launch order = tile order)."""
    bq, bk = cfg.block_q, cfg.block_kv
    p = pl.program_id(0)
    cols = []
    for w in range(NUM_CONSUMERS):
        row = p * cfg.cta_rows + w * bq + lax.broadcasted_iota(jnp.int32, (bq,), 0)
        lo, hi = jnp.zeros((bq,), jnp.int32), jnp.full((bq,), b, jnp.int32)
        for _ in range(max(1, b).bit_length()):   # seg: the last i with q_offsets[i] <= row
            mid = (lo + hi + 1) // 2
            ok = plgpu_triton.load(qo_ref.at[mid]) <= row
            lo, hi = jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)
        seg = jnp.minimum(lo, b - 1)
        ks, ke = plgpu_triton.load(ko_ref.at[seg]), plgpu_triton.load(ko_ref.at[seg + 1])
        ok = (lo < b) & (ks < ke)
        start, end = jnp.where(ok, ks, BIG), jnp.where(ok, ke, 0)
        start_ref[pl.ds(p * cfg.cta_rows + w * bq, bq)] = start
        end_ref[pl.ds(p * cfg.cta_rows + w * bq, bq)] = end
        # tile_ranges / interior_ranges of this consumer's rows (scalars)
        s_min, e_max, s_max, e_min = jnp.min(start), jnp.max(end), jnp.max(start), jnp.min(end)
        empty = e_max <= s_min
        t_lo = jnp.where(empty, 0, s_min // bk)
        t_hi = jnp.where(empty, 0, (e_max + bk - 1) // bk)
        f_lo = jnp.clip((s_max + bk - 1) // bk, t_lo, t_hi)
        f_hi = jnp.clip(e_min // bk, f_lo, t_hi)
        f_empty = f_hi <= f_lo
        f_lo, f_hi = jnp.where(f_empty, t_hi, f_lo), jnp.where(f_empty, t_hi, f_hi)
        if not cfg.interior:
            f_lo = f_hi = t_hi
        cols.append((empty, t_lo, f_lo, f_hi, t_hi, t_hi))   # hn = hi: no narrow step
    c_lo = functools.reduce(jnp.minimum, [jnp.where(e, BIG, a) for e, a, *_ in cols])
    c_hi = functools.reduce(jnp.maximum, [jnp.where(e, 0, c[-1]) for e, *c in cols])
    cta_empty = c_hi <= c_lo
    c_lo, c_hi = jnp.where(cta_empty, 0, c_lo), jnp.where(cta_empty, 0, c_hi)
    vals = [p, c_lo, c_hi]
    for empty, *ranges in cols:          # an empty consumer's range collapses onto c_lo
        vals += [jnp.where(empty, c_lo, x) for x in ranges]
    lane = lax.broadcasted_iota(jnp.int32, (16,), 0)
    out = jnp.zeros((16,), jnp.int32)
    for c, x in enumerate(vals):
        out = jnp.where(lane == c, x, out)
    table_ref[p, :] = out


def pallas_layout(cfg, q_offsets, kv_offsets, tq, interpret=False):
    """build_layout's (table [n_cta, 16], start, end [tq]) in one Pallas Triton launch
    (a binary search of each row's sample in q_offsets); table rows in tile order,
    or heaviest-first (an XLA argsort) with cfg.heavy_first."""
    b = q_offsets.shape[0] - 1
    n = tq // cfg.cta_rows
    full = lambda x: pl.BlockSpec(x.shape, lambda i: (0,) * x.ndim)  # noqa: E731
    table, start, end = pl.pallas_call(
        functools.partial(_layout_kernel, cfg=cfg, b=b), grid=(n,),
        in_specs=[full(q_offsets), full(kv_offsets)],
        out_specs=[pl.BlockSpec((n, 16), lambda i: (0, 0)), pl.BlockSpec((tq,), lambda i: (0,)),
                   pl.BlockSpec((tq,), lambda i: (0,))],
        out_shape=[jax.ShapeDtypeStruct((n, 16), jnp.int32),
                   jax.ShapeDtypeStruct((tq,), jnp.int32), jax.ShapeDtypeStruct((tq,), jnp.int32)],
        compiler_params=plgpu_triton.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret, name="mosaic_flash_layout",
    )(q_offsets, kv_offsets)
    if cfg.heavy_first:
        table = table[jnp.argsort(table[:, 1] - table[:, 2], stable=True)]
    return table, start, end
