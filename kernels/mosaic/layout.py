"""The Mosaic kernels' layout, built in XLA from the offsets: per stationary row its
valid interval of streamed rows, and the tile table (one row per CTA in launch order)."""

import jax.numpy as jnp

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


def tile_table(cfg, start, end, n_cols):
    """[n_cta, TABLE_COLS] int32, one row per CTA in launch order.

    Columns: query CTA tile index, [c_lo, c_hi) key tiles the producer streams, then
    per consumer w (rows tile*cta_rows + w*block_q ...) its key tiles [lo, hi),
    interior [flo, fhi) and narrow tiles [hn, hi), with c_lo <= lo <= flo <= fhi <=
    hn <= hi <= c_hi (an empty consumer range is collapsed onto c_lo). hn = hi - 1
    where cfg.narrow and the consumer's rows have no key past the first half of
    their last tile (else hn = hi). Then `base`: key tile j covers keys
    [base + j block_kv, base + (j + 1) block_kv): base is the CTA's first valid key
    rounded down to 8 (the TMA tile rows), lowered where needed so that its last tile
    ends by n_cols (the streamed array's rows, a multiple of block_kv: no tile reads
    past it); 0 for a CTA without keys.
    """
    bq, bk = cfg.block_q, cfg.block_kv
    n = start.shape[0] // cfg.cta_rows
    if n_cols % bk:
        raise ValueError(f"tile_table: n_cols must be a multiple of {bk}, got {n_cols}")
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


def build_layout(cfg, q_offsets, kv_offsets, tq, tk):
    """(table, start, end) for run_kernel, from the offsets [B+1]; tq / tk: padded
    capacities (multiples of cfg.cta_rows / cfg.block_kv)."""
    q_offsets, kv_offsets = q_offsets.astype(jnp.int32), kv_offsets.astype(jnp.int32)
    start, end = row_key_intervals(q_offsets, kv_offsets, tq)
    return tile_table(cfg, start, end, tk), start, end
