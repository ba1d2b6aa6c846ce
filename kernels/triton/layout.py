"""The Triton engine's layout, built in XLA from the offsets: per row the other side's
interval it pairs with, per tile the range of the other side's tiles it visits (and the
interior part of it), the launch order, RoPE tables, and the fused backwards' row owners."""

import jax.numpy as jnp

from kernels.common import interior_ranges, key_layout, rope_tables, segment_layout, tile_ranges
from kernels.triton.tuning import is_short


_BIG = 1 << 30


def _token_ranges(seg, pos, b, other_off, cfg, side):
    """Per token [start, end) of the other side's rows it can pair with (empty: BIG, 0)."""
    valid = (seg >= 0) & (seg < b)
    s = jnp.clip(seg, 0, b - 1)
    base = jnp.take(other_off, s)
    n = jnp.take(other_off, s + 1) - base
    lo = jnp.zeros_like(pos)
    hi = n
    w = cfg.window
    if side == "q":
        if cfg.causal:
            hi = jnp.minimum(hi, pos + 1)
        if w is not None:
            lo = jnp.maximum(lo, pos - w + 1)
            if not cfg.causal:
                hi = jnp.minimum(hi, pos + w)
    else:
        if cfg.causal:
            lo = jnp.maximum(lo, pos)
        if w is not None:
            hi = jnp.minimum(hi, pos + w)
            if not cfg.causal:
                lo = jnp.maximum(lo, pos - w + 1)
    if cfg.block is not None:
        bl = (pos // cfg.block) * cfg.block
        lo = jnp.maximum(lo, bl)
        hi = jnp.minimum(hi, bl + cfg.block)
    ok = valid & (lo < hi)
    return jnp.where(ok, base + lo, _BIG), jnp.where(ok, base + hi, 0)


def build_layout(cfg, q_offsets, kv_offsets, tq, tk, d, rope_positions=None, rope_theta=None):
    """Everything the kernels read besides q/k/v: the offsets, segment ids, positions,
    per query row its key interval [q_start, q_end) and per key row its query interval
    [k_start, k_end) (empty: BIG, 0), tile ranges, RoPE."""
    b = q_offsets.shape[0] - 1
    q_offsets = q_offsets.astype(jnp.int32)
    kv_offsets = kv_offsets.astype(jnp.int32)
    qs, qp = segment_layout(q_offsets, tq)
    ks, kp = key_layout(kv_offsets, tk)
    qa, qb = _token_ranges(qs, qp, b, kv_offsets, cfg, "q")
    q_lo, q_hi = tile_ranges(qa, qb, cfg.bq, cfg.bk)       # per q tile: key tiles
    ka, kb = _token_ranges(ks, kp, b, q_offsets, cfg, "k")
    k_lo, k_hi = tile_ranges(ka, kb, cfg.bk_dkv, cfg.bq_dkv)  # per key tile: q tiles
    q_flo, q_fhi = interior_ranges(qa, qb, cfg.bq, cfg.bk, q_lo, q_hi)
    k_flo, k_fhi = interior_ranges(ka, kb, cfg.bk_dkv, cfg.bq_dkv, k_lo, k_hi)
    cos = sin = None
    if cfg.rope:
        pos = qp if rope_positions is None else rope_positions
        cos, sin = rope_tables(pos, d, rope_theta)
    return dict(q_offsets=q_offsets, kv_offsets=kv_offsets,
                qs=qs, qp=qp, ks=ks, kp=kp, q_start=qa, q_end=qb, k_start=ka, k_end=kb,
                q_lo=q_lo, q_hi=q_hi, k_lo=k_lo, k_hi=k_hi,
                q_flo=q_flo, q_fhi=q_fhi, k_flo=k_flo, k_fhi=k_fhi,
                q_perm=_heaviest_first(q_lo, q_hi, cfg, short=is_short(tk, b)),
                k_perm=_heaviest_first(k_lo, k_hi, cfg, short=is_short(tq, b)),
                cos=cos, sin=sin)


def _heaviest_first(lo, hi, cfg, short=False):
    """Tile launch order: most inner-loop work first (shorter tail of long samples).
    In order where the inner loop runs over a short side (at most SHORT_SIDE tokens per
    sample: one or two tiles for every tile, nothing to balance), saving the sort."""
    if short:
        return jnp.arange(lo.shape[0], dtype=jnp.int32)
    return jnp.argsort(lo - hi, stable=True).astype(jnp.int32)


def row_owners(start, end, t_own, tile):
    """fused_bwd "*_rows": per row (own [T] int32) the tile of size t_own of the other side
    holding its whole [start, end) interval, -1 if it spans several or is empty; per tile
    of `tile` rows (need [T / tile] int32) whether one of its rows spans several."""
    single = (start < end) & (start // t_own == (end - 1) // t_own)
    own = jnp.where(single, start // t_own, -1).astype(jnp.int32)
    need = jnp.any(((own < 0) & (start < end)).reshape(-1, tile), axis=1).astype(jnp.int32)
    return own, need


def pad_rows(x, n):
    """x [T, ...] zero-padded to [n, ...] rows (x itself when T == n)."""
    return x if x.shape[0] == n else jnp.pad(x, [(0, n - x.shape[0])] + [(0, 0)] * (x.ndim - 1))
