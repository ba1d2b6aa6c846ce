"""LayerNorm on the Pallas Triton engine: one pass over the rows each way.

    y = (x - mean) * (rstd * scale) + bias,  rstd = rsqrt(var + eps)   (float32, per row)

x [T, D] (bf16, f16 or f32), scale / bias [D] (any float dtype, read as float32),
D <= MAX_DIM. The columns of a tile are D padded to a power of two, DP >= 16; the
lanes past D are masked (loads give 0, stores touch nothing, the stats leave them out).

Forward (`layer_norm_fwd`), grid cdiv(T, BR), program i = rows [i BR, (i + 1) BR):
  loads the [BR, DP] tile of x once; mean = sum(x) / D, var = sum((x - mean)^2) / D
  (float32, from the tile held in registers: two passes over registers, one over
  memory); writes y [BR, D] in out_dtype and the rows' mean and rstd, float32 [T],
  which the backward reads instead of recomputing.

Backward (`layer_norm_bwd`), grid cdiv(T, BB G), program p = G tiles of BB rows
(BB = bwd_rows, G = bwd_tiles, at most cdiv(T, BB)), looped:
  xhat = (x - mean) rstd, g = dy scale,
  dx = rstd (g - mean(g) - xhat mean(g xhat))   (row means over the D columns)
  written in x.dtype; the program's column sums of dy xhat and dy (float32, carried
  through its loop) go to row p of the partials dscale / dbias [P, D], which XLA
  sums after. No atomics: the same bits on every run.

Rows past T (the last tile) load zeros and store nothing. Interpret mode (off GPU)
runs the same kernels on the CPU; there masked loads read clipped in-bounds indices
and masked stores write the old value back at their indices, so the outputs carry a
dump row T (masked rows point at it) and DP columns, sliced off after. On GPU the
indices are the plain row / column iotas (contiguous: vectorised loads) and the
outputs are exactly [T, D].
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

Array = Any
F32 = jnp.float32
# The widest row one tile holds (the [BR, DP] float32 tile lives in registers).
MAX_DIM = 1024
# block_rows: rows per forward tile (BR, a power of two); bwd_rows: rows per backward tile
# (BB, a power of two); bwd_tiles: tiles per backward program (G; the partials have
# cdiv(T, BB G) rows); num_warps / bwd_warps: per forward / backward program; bwd_stages:
# the backward loop's software pipelining depth (1: none).
# Timed on one H200 (benchmarks/bench_layer_norm.py, [1318144, 512] bf16, ms forward /
# forward+backward, XLA's nnx.LayerNorm 1.32-1.42 / 3.00-3.19 in the same runs). One tile
# size both ways, BR/G/warps: 8/16/4 0.963 / 2.681, 4/16/4 1.206 / 2.464, 16/8/4 1.083 /
# 2.585, 8/32/8 1.083 / 2.576, 32/4/8 1.293 / 3.077. Backward alone varied (forward 8 rows,
# 4 warps): BB/G/warps 4/16/4 2.600, 2/32/2 2.408, 2/32/4 2.849, 8/16/8 2.699, 4/16/8
# 3.052; bwd_stages 2 / 3 at 4/16/4: 2.604 / 2.555 (the run-to-run noise is ~4%).
KNOBS = dict(block_rows=8, bwd_rows=2, bwd_tiles=32, num_warps=4, bwd_warps=2, bwd_stages=1)
NUM_WARPS = (1, 2, 4, 8, 16, 32)


def padded_dim(d: int) -> int:
    """DP: d rounded up to a power of two (at least 16)."""
    return max(16, 1 << max(d - 1, 0).bit_length())


def _tile(r0, br, t, d, dp, interpret):
    """Rows [r0, r0 + br) x columns [0, DP): (row_ok [BR], col_ok [DP], load rows [BR], load
    columns [DP], store rows [BR])."""
    rows = r0 + lax.broadcasted_iota(jnp.int32, (br,), 0)
    cols = lax.broadcasted_iota(jnp.int32, (dp,), 0)
    row_ok, col_ok = rows < t, cols < d
    if interpret:   # in-bounds loads; masked stores to the dump row (module docstring)
        return (row_ok, col_ok, jnp.minimum(rows, t - 1), jnp.minimum(cols, d - 1),
                jnp.where(row_ok, rows, t))
    return row_ok, col_ok, rows, cols, rows


def _grid2(rows, cols):
    """[BR] rows and [DP] columns -> their [BR, DP] index arrays."""
    shape = (rows.shape[0], cols.shape[0])
    return jnp.broadcast_to(rows[:, None], shape), jnp.broadcast_to(cols[None, :], shape)


def _fwd_kernel(*refs, t, d, dp, br, eps, has_bias, interpret):
    refs = list(refs)
    x_ref, w_ref = refs.pop(0), refs.pop(0)
    b_ref = refs.pop(0) if has_bias else None
    y_ref, mean_ref, rstd_ref = refs
    row_ok, col_ok, lrows, lcols, srows = _tile(pl.program_id(0) * br, br, t, d, dp, interpret)
    mask = row_ok[:, None] & col_ok[None, :]
    cols = lax.broadcasted_iota(jnp.int32, (dp,), 0)
    x = plgpu.load(x_ref.at[_grid2(lrows, lcols)], mask=mask, other=0).astype(F32)
    mean = jnp.sum(x, axis=1) / d
    xc = jnp.where(col_ok[None, :], x - mean[:, None], 0.0)
    var = jnp.sum(xc * xc, axis=1) / d
    rstd = lax.rsqrt(var + eps)
    scale = plgpu.load(w_ref.at[lcols], mask=col_ok, other=0).astype(F32)
    y = xc * (rstd[:, None] * scale[None, :])
    if has_bias:
        y = y + plgpu.load(b_ref.at[lcols], mask=col_ok, other=0).astype(F32)[None, :]
    plgpu.store(y_ref.at[_grid2(srows, cols)], y.astype(y_ref.dtype), mask=mask)
    plgpu.store(mean_ref.at[srows], mean, mask=row_ok)
    plgpu.store(rstd_ref.at[srows], rstd, mask=row_ok)


def _bwd_kernel(x_ref, dy_ref, mean_ref, rstd_ref, w_ref, dx_ref, ds_ref, db_ref, *, t, d, dp,
                br, tiles, interpret):
    p = pl.program_id(0)
    cols = lax.broadcasted_iota(jnp.int32, (dp,), 0)
    col_ok = cols < d
    lcols = jnp.minimum(cols, d - 1) if interpret else cols
    scale = plgpu.load(w_ref.at[lcols], mask=col_ok, other=0).astype(F32)

    def body(j, carry):
        ds, db = carry
        row_ok, _, lrows, _, srows = _tile((p * tiles + j) * br, br, t, d, dp, interpret)
        mask = row_ok[:, None] & col_ok[None, :]
        x = plgpu.load(x_ref.at[_grid2(lrows, lcols)], mask=mask, other=0).astype(F32)
        dy = plgpu.load(dy_ref.at[_grid2(lrows, lcols)], mask=mask, other=0).astype(F32)
        mean = plgpu.load(mean_ref.at[lrows], mask=row_ok, other=0)
        rstd = plgpu.load(rstd_ref.at[lrows], mask=row_ok, other=0)
        xhat = jnp.where(col_ok[None, :], (x - mean[:, None]) * rstd[:, None], 0.0)
        g = dy * scale[None, :]
        c1 = jnp.sum(g * xhat, axis=1) / d
        c2 = jnp.sum(g, axis=1) / d
        dx = (g - c2[:, None] - xhat * c1[:, None]) * rstd[:, None]
        plgpu.store(dx_ref.at[_grid2(srows, cols)], dx.astype(dx_ref.dtype), mask=mask)
        return ds + jnp.sum(dy * xhat, axis=0), db + jnp.sum(dy, axis=0)

    zero = jnp.zeros((dp,), F32)
    ds, db = lax.fori_loop(0, tiles, body, (zero, zero))
    plgpu.store(ds_ref.at[p, cols], ds, mask=col_ok)
    plgpu.store(db_ref.at[p, cols], db, mask=col_ok)


def _full(shape):
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def _params(num_warps, num_stages=1):
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def layer_norm_fwd(x: Array, scale: Array, bias: Array | None, *, eps: float, out_dtype,
                   interpret: bool, knobs: dict) -> tuple[Array, Array, Array]:
    """(y [T, D] out_dtype, mean [T] f32, rstd [T] f32); T >= 1, D <= MAX_DIM."""
    t, d = x.shape
    dp, br = padded_dim(d), knobs["block_rows"]
    tp, dq = (t + 1, dp) if interpret else (t, d)
    ins = (x, scale) + (() if bias is None else (bias,))
    outs = [jax.ShapeDtypeStruct((tp, dq), out_dtype),
            jax.ShapeDtypeStruct((tp,), F32), jax.ShapeDtypeStruct((tp,), F32)]
    kernel = functools.partial(_fwd_kernel, t=t, d=d, dp=dp, br=br, eps=float(eps),
                               has_bias=bias is not None, interpret=interpret)
    res = pl.pallas_call(
        kernel, grid=(pl.cdiv(t, br),),
        in_specs=[_full(a.shape) for a in ins],
        out_specs=[_full(o.shape) for o in outs], out_shape=outs,
        compiler_params=_params(knobs["num_warps"]), interpret=interpret,
        name="layer_norm_fwd",
    )(*ins)
    y, mean, rstd = res
    return y[:t, :d], mean[:t], rstd[:t]


def layer_norm_bwd(x: Array, dy: Array, mean: Array, rstd: Array, scale: Array, *,
                   interpret: bool, knobs: dict) -> tuple[Array, Array, Array]:
    """(dx [T, D] x.dtype, dscale [D] f32, dbias [D] f32) from the forward's mean / rstd."""
    t, d = x.shape
    dp, br, tiles = padded_dim(d), knobs["bwd_rows"], knobs["bwd_tiles"]
    tiles = max(1, min(tiles, pl.cdiv(t, br)))      # no all-masked loop trips on small T
    nprog = pl.cdiv(t, br * tiles)
    tp, dq = (t + 1, dp) if interpret else (t, d)
    ins = (x, dy, mean, rstd, scale)
    kernel = functools.partial(_bwd_kernel, t=t, d=d, dp=dp, br=br, tiles=tiles,
                               interpret=interpret)
    dx, ds, db = pl.pallas_call(
        kernel, grid=(nprog,),
        in_specs=[_full(a.shape) for a in ins],
        out_specs=[_full((tp, dq)), _full((nprog, dq)), _full((nprog, dq))],
        out_shape=[jax.ShapeDtypeStruct((tp, dq), x.dtype),
                   jax.ShapeDtypeStruct((nprog, dq), F32), jax.ShapeDtypeStruct((nprog, dq), F32)],
        compiler_params=_params(knobs["bwd_warps"], knobs["bwd_stages"]), interpret=interpret,
        name="layer_norm_bwd",
    )(*ins)
    return dx[:t, :d], jnp.sum(ds[:, :d], axis=0), jnp.sum(db[:, :d], axis=0)


def check_knobs(knobs: dict) -> dict:
    """KNOBS with `knobs` applied; ValueError names a bad one."""
    unknown = set(knobs) - set(KNOBS)
    if unknown:
        raise ValueError(f"layer_norm: unknown knobs {sorted(unknown)} (have {sorted(KNOBS)})")
    knobs = {**KNOBS, **knobs}
    for name, v in knobs.items():
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"layer_norm: knob {name} must be an int, got {v!r}")
    for name in ("block_rows", "bwd_rows"):
        br = knobs[name]
        if not (1 <= br <= 256 and br & (br - 1) == 0):
            raise ValueError(f"layer_norm: {name} must be a power of two in [1, 256] (Triton "
                             f"tiles), got {br}")
    for name in ("bwd_tiles", "bwd_stages"):
        if knobs[name] < 1:
            raise ValueError(f"layer_norm: {name} must be >= 1, got {knobs[name]}")
    for name in ("num_warps", "bwd_warps"):
        if knobs[name] not in NUM_WARPS:
            raise ValueError(f"layer_norm: {name} must be one of {NUM_WARPS}, got "
                             f"{knobs[name]}")
    return knobs
