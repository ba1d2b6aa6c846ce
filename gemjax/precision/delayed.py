"""FP8 GEMM with delayed per-tensor scaling: scales from an amax history of earlier steps.

    y = fp8_dot_delayed(x [..., K], w [K, N], hist [3, H], recipe, axes=(), margin=0)
    d hist = the next step's history (the gradient of `hist` is its update)

The three products of fp8_dot's "tensor" recipe (gemjax.precision.gemm: forward x @ w,
dgrad dy @ w^T, wgrad x^T @ dy, one float32 scale per operand), but each operand's scale
is known before the operand is read:

    s = max(hist[row]) * 2**margin / max_finite       row 0: x, 1: w, 2: dy
    q = convert(clip(t / s, -max_finite, max_finite))

so the convert needs no reduction over t before it and XLA may fuse it into t's
producer. Each product still records this step's amax of its operand (max |t| over the
finite entries, a reduction reading the same input as the convert, fusible with it); the
new history is the old one shifted by one (the oldest entry dropped) with the three
amaxes at index 0:

    new[r] = concat([amax_r], hist[r, :-1])

This is the recipe of TransformerEngine's delayed scaling and of flax.linen.fp8_ops
(history most-recent-first, scale from the history's max, margin a power of two).

The new history leaves the custom_vjp as the cotangent of `hist` (the way flax.linen.fp8_ops
passes its "_overwrite_with_gradient" variables): a caller differentiates the loss with
respect to the history too and stores that "gradient" as the next history, never passing it
to an optimizer. Under a shard_map, `axes` names the mesh axes the batch is split over: the
amaxes are the max over them (lax.pmax), so every device returns the same history. A
history used by more than one call in one step gets the sum of their updates: give every
call its own history.

Empty history (all zeros, the initial state): the scale is 1.0 (TransformerEngine's
starting scale): values up to max_finite convert unclipped; smaller ones lose bits to the
format's subnormal range. The first step fills index 0 and the next uses it.

Saturation: a value above s * max_finite (an amax that jumped above the whole history)
clips to +-max_finite, and this step's amax (recorded unclipped) sets the next scale;
`saturated_count` counts the entries of a tensor a scale clips.

Non-finite inputs do not enter the amax (gemjax.precision.quantize.finite_abs); NaN stays
NaN, +-inf is NaN in E4M3 and +-inf in E5M2, as in fp8_dot.

`fp8_dot_delayed_reference` computes the same quantized products in float32 / float64 jnp.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from gemjax.precision.formats import FORMATS
from gemjax.precision.gemm import Recipe, _f8_mm, _flat, _tensor_grads, _with_scale
from gemjax.precision.quantize import finite_abs

ROWS = ("x", "w", "dy")


def init_history(length: int) -> jax.Array:
    """The empty history: zeros float32 [3, length] (rows x, w, dy)."""
    if length < 1:
        raise ValueError(f"amax history length must be >= 1, got {length}")
    return jnp.zeros((len(ROWS), length), jnp.float32)


def history_scale(row: jax.Array, fmt: str, margin: int = 0) -> jax.Array:
    """Scale float32 [1, 1] from one history row [H]: max(row) * 2**margin / max_finite,
    1.0 when the row holds no positive amax."""
    amax = jnp.max(row.astype(jnp.float32))
    s = amax * (2.0 ** margin) / FORMATS[fmt].max_finite
    s = jnp.where((amax > 0) & jnp.isfinite(amax), jnp.maximum(s, jnp.finfo(jnp.float32).tiny), 1.0)
    return s.reshape(1, 1)


def current_amax(t: jax.Array) -> jax.Array:
    """max |t| over t's finite entries: float32 []."""
    return jnp.max(finite_abs(t.astype(jnp.float32)))


def next_history(hist: jax.Array, amaxes: jax.Array) -> jax.Array:
    """hist [3, H] shifted by one, amaxes [3] at index 0 (module docstring)."""
    return jnp.concatenate([amaxes[:, None].astype(hist.dtype), hist[:, :-1]], axis=1)


def saturated_count(t: jax.Array, scale: jax.Array, fmt: str) -> jax.Array:
    """int32 []: finite entries of t whose |t| / scale exceeds fmt's max_finite (clipped)."""
    mag = finite_abs(t.astype(jnp.float32))
    return jnp.sum(mag / scale.reshape(()) > FORMATS[fmt].max_finite, dtype=jnp.int32)


def _check(x, w, hist):
    if w.ndim != 2 or x.ndim < 1 or x.shape[-1] != w.shape[0]:
        raise ValueError(f"fp8_dot_delayed: x {x.shape} @ w {w.shape}: need x [..., K], w [K, N]")
    if hist.ndim != 2 or hist.shape[0] != len(ROWS):
        raise ValueError(f"fp8_dot_delayed: hist {hist.shape}: need [3, H] (rows {ROWS})")


def _scales(hist, recipe: Recipe, margin: int):
    return (history_scale(hist[0], recipe.fwd_fmt, margin),
            history_scale(hist[1], recipe.fwd_fmt, margin),
            history_scale(hist[2], recipe.grad_fmt, margin))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _delayed(x, w, hist, recipe, axes, margin):
    return _delayed_fwd(x, w, hist, recipe, axes, margin)[0]


def _delayed_fwd(x, w, hist, recipe, axes, margin):
    sx, sw, sdy = _scales(hist, recipe, margin)
    x2 = _flat(x)
    y = _f8_mm(_with_scale(x2, sx, recipe.fwd_fmt), sx, _with_scale(w.T, sw, recipe.fwd_fmt), sw,
               x.dtype, recipe.fast_accum == "forward")
    y = y.reshape(x.shape[:-1] + (w.shape[1],))
    if recipe.wgrad == "fp8":
        keep_x, qxt = None, _with_scale(x2.T, sx, recipe.fwd_fmt)
    else:
        keep_x, qxt = x, None
    amax = jnp.stack([current_amax(x2), current_amax(w)])
    # x_like [..., 0]: x's leading shape and dtype, no data
    return y, (qxt, sx, w, sw, sdy, keep_x, jnp.zeros(x.shape[:-1] + (0,), x.dtype), amax, hist)


def _delayed_bwd(recipe, axes, margin, res, dy):
    qxt, sx, w, sw, sdy, keep_x, x_like, amax, hist = res
    dy2 = _flat(dy)
    dx, dw = _tensor_grads(recipe, dy2, sdy, (qxt, sx, w, sw, keep_x, x_like))
    amaxes = jnp.concatenate([amax, current_amax(dy2)[None]])
    if axes:
        amaxes = lax.pmax(amaxes, axes)
    return dx, dw, next_history(hist, amaxes)


_delayed.defvjp(_delayed_fwd, _delayed_bwd)


def fp8_dot_delayed(x: jax.Array, w: jax.Array, hist: jax.Array, recipe: Recipe = Recipe(),
                    axes: tuple[str, ...] = (), margin: int = 0) -> jax.Array:
    """x [..., K] @ w [K, N] -> [..., N] in x.dtype with delayed per-tensor scales from
    hist [3, H] (module docstring); the cotangent of hist is the next history.

    recipe: formats, wgrad and fast_accum as in fp8_dot (its scaling is not read); axes:
    mesh axes to max the amaxes over (inside a shard_map); margin: the scales' extra
    power of two of headroom."""
    x, w, hist = jnp.asarray(x), jnp.asarray(w), jnp.asarray(hist)
    _check(x, w, hist)
    return _delayed(x, w, hist, recipe, tuple(axes), int(margin))


def fp8_dot_delayed_reference(x, w, dy, hist, recipe: Recipe = Recipe(), margin: int = 0,
                              dtype=jnp.float64):
    """(y [..., N], dx [..., K], dw [K, N], next hist [3, H]) of fp8_dot_delayed in `dtype`
    jnp: each operand divided by its history scale, clipped, rounded to its format,
    multiplied back, then an exact-precision matmul (wgrad "fp8" only)."""
    x, w, dy, hist = (jnp.asarray(t) for t in (x, w, dy, hist))
    x2, dy2 = _flat(x).astype(dtype), _flat(dy).astype(dtype)
    w = w.astype(dtype)
    h32 = hist.astype(jnp.float32)

    def scale(row, fmt):          # the recipe's scale is a float32 number
        amax = jnp.max(row)
        s = amax * jnp.float32(2.0 ** margin) / jnp.float32(FORMATS[fmt].max_finite)
        return jnp.where(amax > 0, s, jnp.float32(1.0)).astype(dtype)

    def deq(t, fmt, row):
        s = scale(h32[row], fmt)
        f = FORMATS[fmt]
        q = jnp.clip(t / s, -f.max_finite, f.max_finite).astype(jnp.float32).astype(f.dtype)
        return lax.optimization_barrier(q).astype(dtype) * s

    hp = lax.Precision.HIGHEST
    xq, wq = deq(x2, recipe.fwd_fmt, 0), deq(w, recipe.fwd_fmt, 1)
    dyq = deq(dy2, recipe.grad_fmt, 2)
    y = jnp.matmul(xq, wq, precision=hp)
    dx = jnp.matmul(dyq, wq.T, precision=hp)
    dw = jnp.matmul(xq.T, dyq, precision=hp)
    amaxes = jnp.stack([jnp.max(jnp.abs(x2)), jnp.max(jnp.abs(w)), jnp.max(jnp.abs(dy2))])
    new = jnp.concatenate([amaxes[:, None], hist.astype(dtype)[:, :-1]], axis=1)
    return (y.reshape(x.shape[:-1] + (w.shape[1],)), dx.reshape(x.shape), dw, new)
