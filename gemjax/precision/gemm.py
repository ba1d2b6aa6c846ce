"""Scaled FP8 GEMM with its backward: y = x @ w in FP8 with float32 accumulation.

    fp8_dot(x [..., K], w [K, N], recipe=Recipe()) -> y [..., N] (x's dtype)

All three products of a linear layer run on float8 operands through `lax.dot_general`
(on Hopper XLA lowers it to a cuBLASLt FP8 GEMM, or for small shapes a Triton GEMM):

    forward  y  = x  @ w      contraction K   x: E4M3, w: E4M3
    dgrad    dx = dy @ w^T    contraction N   dy: recipe.grad_fmt (E5M2), w: E4M3
    wgrad    dw = x^T @ dy    contraction M   x: E4M3, dy: grad_fmt; or, with
                                              recipe.wgrad="bf16" / "f32", an
                                              unquantized GEMM in that dtype

Accumulation: precision HIGHEST, cuBLASLt's mode that moves the tensor cores' partial
sums into float32 registers as K advances; recipe.fast_accum="forward" gives the forward
precision DEFAULT, cuBLASLt's FP8 "fast accumulation", which keeps the whole sum in the
tensor cores (faster; dgrad and wgrad stay HIGHEST, whose sums run over M or N).
Hopper's FP8 tensor cores keep about 14 bits of a partial sum inside one MMA either way,
so on the GPU the products match a float32 summation to about 2**-13 of |a| @ |b|, not
2**-23.

Each operand is quantized with scales constant along its GEMM's contraction axis, so the
scales factor out of the sum and multiply the float32 product (M = prod(x.shape[:-1])):

  recipe.scaling="rowwise" (the fast path: one GEMM, then an elementwise rescale)
    forward  x per row over K      [M, 1]     w per column over K  [1, N]
    dgrad    dy per row over N     [M, 1]     w per row over N     [K, 1]
    wgrad    x per column over M   [1, K]     dy per column over M [1, N]
    y = dot(qa, qb) * sa * sb

  recipe.scaling="tensor" (one scale per operand): y = dot(qa, qb) * (sa * sb). Each
  operand's scale is taken once: the forward saves x^T in FP8 (for the wgrad) and the
  two scales, and the backward quantizes w again with the forward's scale (the same bits:
  w is a parameter, held anyway) in the dgrad's layout, dy once per layout.

  recipe.scaling="blocked" (the Hopper block-scaled recipe: 1x128 activation tiles,
  128x128 weight blocks, 128x1 tiles for the wgrad's dy):
    y = sum over 128-blocks b of the contraction of dot(qa[:, b], qb[b, :]) * sa[:, b] * sb[b, :]
  as one batched dot over the blocks (float32 partials [Kb, M, N]) and a scaled sum.

Operand layout: Hopper's FP8 GEMM (cuBLASLt) takes both operands with the contraction
axis contiguous ("TN"); given another layout, XLA transposes the float8 operand in a
separate pass first, and that transpose is slow (measured on one H200, 1024x6656x8192:
the FP8 GEMM on a K-major weight [N, K] 0.080 ms, 1,390 TFLOP/s, against BF16's 0.146 ms;
on a [K, N] weight 0.435 ms, 257 TFLOP/s, nearly all of it the transpose). So under
"rowwise" and "tensor" every product quantizes its operands into K-major arrays, the
transpose (where the product needs one: w^T in the forward, x^T and dy^T in the wgrad)
taken on the 16 / 32-bit input inside the quantize pass, and every FP8 dot_general
contracts the last axis of both operands.

Output: a product whose result is bfloat16 or float16 (x's dtype for y and dx, w's for
dw) has its GEMM write that dtype and the scales multiply it in float32, rounding once
more (two roundings, within 2**-8 relative); any other result dtype gets a float32 GEMM
output. The rescale is an elementwise pass after the GEMM, which XLA may fuse into the
product's consumer.

The FP8 operands pass an optimization barrier into the GEMM, so they exist as FP8 arrays
whatever XLA:GPU does to the dot: its simplify-fp-conversions pass folds any chain of float
converts (float32 -> FP8 -> wider) into one convert, dropping the quantization. On an
H200, without the barrier, fp8_dot's dgrad of dy [1, 17] @ w^T [17, 130] (E5M2 x E4M3)
missed the dequantized product by up to 0.5% of |dy| @ |w|, while the same dot on FP8
inputs made by a separate program matched it to float32; with the barrier it matches.

Scales are float32 amax / max_finite (gemjax.precision.quantize, layout scale "f32"), so
no finite value saturates. Under "rowwise" and "blocked" the residuals saved for the
backward are x and w themselves (in their own dtype): the backward products quantize them
again along their own contraction axes.

Non-finite inputs: they do not enter amax, so the finite values of their row / block keep
their precision; NaN stays NaN, +-inf is NaN in E4M3 (no infinity) and +-inf in E5M2. An
output entry is non-finite (NaN for an E4M3 operand) exactly when its contraction touches a
non-finite input; every other output entry is finite and unaffected.

`fp8_dot_reference` computes the same quantized product in float32 or float64 jnp
(dequantize, then an exact-precision matmul): the FP8 GEMMs match it up to float32
summation order (on the GPU, up to the MMA's partial-sum error above).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from gemjax.precision.formats import FORMATS, Layout
from gemjax.precision.quantize import finite_abs, quantize, saturate, to_format

SCALINGS = ("rowwise", "tensor", "blocked", "delayed")
WGRADS = ("fp8", "bf16", "f32")
FAST_ACCUMS = ("none", "forward")
BLOCK = 128


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How fp8_dot quantizes (hashable: a static argument).

    scaling: "rowwise", "tensor" or "blocked" (module docstring); "delayed": per-tensor
      scales from an amax history (gemjax.precision.delayed.fp8_dot_delayed), which
      fp8_dot, given no history, runs as "tensor".
    fwd_fmt: format of x and w ("e4m3").
    grad_fmt: format of dy in dgrad and wgrad ("e5m2" or "e4m3").
    wgrad: "fp8" (quantized like the other products), "bf16" or "f32" (x^T @ dy unquantized,
      in that dtype, float32 accumulation).
    fast_accum: "none" (every product at precision HIGHEST) or "forward" (the forward at
      DEFAULT: cuBLASLt's FP8 fast accumulation; module docstring).
    """
    scaling: str = "rowwise"
    fwd_fmt: str = "e4m3"
    grad_fmt: str = "e5m2"
    wgrad: str = "fp8"
    fast_accum: str = "none"

    def __post_init__(self):
        if self.scaling not in SCALINGS:
            raise ValueError(f"Recipe.scaling must be one of {SCALINGS}, got {self.scaling!r}")
        for name in ("fwd_fmt", "grad_fmt"):
            if getattr(self, name) not in FORMATS:
                raise ValueError(f"Recipe.{name} must be one of {sorted(FORMATS)}, "
                                 f"got {getattr(self, name)!r}")
        if self.wgrad not in WGRADS:
            raise ValueError(f"Recipe.wgrad must be one of {WGRADS}, got {self.wgrad!r}")
        if self.fast_accum not in FAST_ACCUMS:
            raise ValueError(f"Recipe.fast_accum must be one of {FAST_ACCUMS}, "
                             f"got {self.fast_accum!r}")


def _quant(t: jax.Array, block: tuple[int, int], fmt: str):
    """t [R, C] -> (q [R, C] fmt, scales float32 [ceil(R/br), ceil(C/bc)]).

    Blocks spanning whole rows, columns or the tensor (the rowwise and tensor recipes)
    take a reduce + broadcast, the same arithmetic as gemjax.precision.quantize without
    its block reshapes and scale gathers; other blocks go through quantize."""
    axes = _whole_axes(t.shape, block)
    if axes is None:
        bs = quantize(t, Layout(block=block, scale="f32"), FORMATS[fmt])
        return bs.q, bs.scales
    s = _scales(t, axes, fmt)
    return _with_scale(t, s, fmt), s


def _whole_axes(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, ...] | None:
    """The axes a block spans whole, when it spans each axis whole or by 1 (else None)."""
    axes = tuple(a for a, (b, n) in enumerate(zip(block, shape)) if b == n)
    if any(b not in (1, n) for b, n in zip(block, shape)) or not axes:
        return None
    return axes


def _scales(t: jax.Array, axes: tuple[int, ...], fmt: str) -> jax.Array:
    """float32 scales of t [R, C] constant along `axes` (keepdims): amax / max_finite."""
    f = FORMATS[fmt]
    amax = jnp.max(finite_abs(t.astype(jnp.float32)), axis=axes, keepdims=True)
    return jnp.where(amax > 0, jnp.maximum(amax / f.max_finite, jnp.finfo(jnp.float32).tiny), 1.0)


def _quant_t(b: jax.Array, block: tuple[int, int], fmt: str):
    """b [K, N] -> (q of b^T [N, K] fmt, scales float32 in b's layout: [1, N] or [1, 1]
    for a block of whole columns or the whole of b).

    The scales reduce b in its own layout and only the convert pass writes the transpose:
    a reduction over the transposed array made XLA:GPU write that array in float32 first."""
    s = _scales(b, _whole_axes(b.shape, block), fmt)
    return _with_scale(b.T, s.T, fmt), s


def _with_scale(t: jax.Array, s: jax.Array, fmt: str) -> jax.Array:
    """t [R, C] quantized to fmt with float32 scales s (broadcast against t): round to
    nearest of t / s, clipped to the finite range; NaN stays NaN, +-inf as the format
    holds it (module docstring)."""
    f = FORMATS[fmt]
    t32 = t.astype(jnp.float32)
    return to_format(t32, saturate(t32, s, f), f)


def _operand_blocks(a_rows: int, k: int, b_cols: int, scaling: str, b_weight: bool):
    """Quantization blocks of a [M, K] (along K) and b [K, N] (along K)."""
    if scaling == "rowwise":
        return (1, k), (k, 1)
    if scaling in ("tensor", "delayed"):
        return (a_rows, k), (k, b_cols)
    return (1, BLOCK), ((BLOCK, BLOCK) if b_weight else (BLOCK, 1))


def _gemm_dtype(out) -> jnp.dtype:
    """The dtype an FP8 GEMM writes for a product wanted in `out`: out when 16-bit, else
    float32 (module docstring)."""
    out = jnp.dtype(out)
    return out if out.itemsize == 2 else jnp.dtype(jnp.float32)


def _fp8_gemm(qa: jax.Array, qb: jax.Array, dims, out, fast: bool) -> jax.Array:
    """lax.dot_general(qa, qb, dims) on FP8 operands, written in `out`: the operands behind
    an optimization barrier, precision DEFAULT when fast (FP8 fast accumulation), else
    HIGHEST (module docstring). Every FP8 GEMM of this module goes through here."""
    qa, qb = lax.optimization_barrier((qa, qb))
    precision = lax.Precision.DEFAULT if fast else lax.Precision.HIGHEST
    return lax.dot_general(qa, qb, dims, precision=precision, preferred_element_type=out)


def _f8_dot(qa: jax.Array, qb: jax.Array, out=jnp.float32, fast: bool = False) -> jax.Array:
    """qa [M, K] . qb [N, K] over K (both K-major): [M, N] in _gemm_dtype(out)."""
    return _fp8_gemm(qa, qb, (((1,), (1,)), ((), ())), _gemm_dtype(out), fast)


def _f8_mm(qa, sa, qb, sb, out=jnp.float32, fast: bool = False) -> jax.Array:
    """_f8_dot(qa, qb) times the scalar scales sa * sb ([1, 1] each): [M, N] in out."""
    y = _f8_dot(qa, qb, out, fast).astype(jnp.float32) * (sa[0, 0] * sb[0, 0])
    return y.astype(out)


def _scaled_mm(a: jax.Array, b: jax.Array, a_fmt: str, b_fmt: str, scaling: str,
               b_weight: bool, out=jnp.float32, fast: bool = False) -> jax.Array:
    """a [M, K] @ b [K, N] -> [M, N] in `out` with both operands quantized along K.

    b_weight: b is a weight (128x128 blocks under "blocked"), else an activation-like
    operand (128x1 tiles). Under "rowwise" and "tensor" b is
    quantized as b^T [N, K] (K-major; module docstring): a caller passing b = t^T gets t's
    own layout, with no transpose. fast: FP8 fast accumulation (precision DEFAULT)."""
    (m, k), n = a.shape, b.shape[1]
    blk_a, blk_b = _operand_blocks(m, k, n, scaling, b_weight)
    if scaling == "rowwise":
        qa, sa = _quant(a, blk_a, a_fmt)                     # sa [M, 1]
        qbt, sb = _quant_t(b, blk_b, b_fmt)                  # qbt [N, K], sb [1, N]
        return (_f8_dot(qa, qbt, out, fast).astype(jnp.float32) * sa * sb).astype(out)
    if scaling == "tensor":
        qa, sa = _quant(a, blk_a, a_fmt)                     # sa [1, 1]
        qbt, sb = _quant_t(b, blk_b, b_fmt)                  # sb [1, 1]
        return _f8_mm(qa, sa, qbt, sb, out, fast)
    pad = -k % BLOCK
    if pad:                                                  # zeros change no amax
        a = jnp.pad(a, ((0, 0), (0, pad)))
        b = jnp.pad(b, ((0, pad), (0, 0)))
    kb = (k + pad) // BLOCK
    qa, sa = _quant(a, blk_a, a_fmt)                         # sa [M, Kb]
    qb, sb = _quant(b, blk_b, b_fmt)                         # sb [Kb, ceil(N/bc)]
    if sb.shape[1] != n:
        sb = jnp.repeat(sb, BLOCK, axis=1, total_repeat_length=sb.shape[1] * BLOCK)[:, :n]
    part = _fp8_gemm(qa.reshape(m, kb, BLOCK), qb.reshape(kb, BLOCK, n),
                     (((2,), (1,)), ((1,), (0,))), jnp.float32, fast)     # [Kb, M, N]
    y = jnp.einsum("kmn,mk,kn->mn", part, sa, sb, precision=lax.Precision.HIGHEST)
    return y.astype(out)


def _flat(x: jax.Array) -> jax.Array:
    return x.reshape(-1, x.shape[-1])


def _check(x: jax.Array, w: jax.Array) -> None:
    if w.ndim != 2 or x.ndim < 1 or x.shape[-1] != w.shape[0]:
        raise ValueError(f"fp8_dot: x {x.shape} @ w {w.shape}: need x [..., K], w [K, N]")
    for name, t in (("x", x), ("w", w)):
        if not jnp.issubdtype(t.dtype, jnp.floating):
            raise TypeError(f"fp8_dot: {name} must be a float array, got dtype {t.dtype}")


def _forward(x, w, recipe: Recipe):
    y = _scaled_mm(_flat(x), w, recipe.fwd_fmt, recipe.fwd_fmt, recipe.scaling, True, x.dtype,
                   recipe.fast_accum == "forward")
    return y.reshape(x.shape[:-1] + (w.shape[1],))


def _dgrad(dy2, w, recipe: Recipe, out):
    """dy [M, N] @ w^T [N, K] -> [M, K] in out."""
    return _scaled_mm(dy2, w.T, recipe.grad_fmt, recipe.fwd_fmt, recipe.scaling, True, out)


def _wgrad(x2, dy2, recipe: Recipe, out):
    """x^T [K, M] @ dy [M, N] -> [K, N] in out."""
    if recipe.wgrad != "fp8":
        dt = jnp.bfloat16 if recipe.wgrad == "bf16" else jnp.float32
        return lax.dot_general(x2.astype(dt), dy2.astype(dt), (((0,), (0,)), ((), ())),
                               preferred_element_type=jnp.float32).astype(out)
    return _scaled_mm(x2.T, dy2, recipe.fwd_fmt, recipe.grad_fmt, recipe.scaling, False, out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _fp8_dot(x, w, recipe):
    return _forward(x, w, recipe)


def _fp8_dot_fwd(x, w, recipe):
    if recipe.scaling != "tensor":
        return _forward(x, w, recipe), (x, w)
    # one scale per operand, taken once (module docstring): the forward's K-major operands
    # are x [M, K] and w^T [N, K]; the wgrad's x^T [K, M] is quantized here with x's scale
    # and saved (FP8); the backward quantizes w [K, N] again with sw
    x2 = _flat(x)
    qx, sx = _quant(x2, x2.shape, recipe.fwd_fmt)
    qwt, sw = _quant_t(w, w.shape, recipe.fwd_fmt)
    y = _f8_mm(qx, sx, qwt, sw, x.dtype, recipe.fast_accum == "forward")
    y = y.reshape(x.shape[:-1] + (w.shape[1],))
    if recipe.wgrad == "fp8":
        keep_x, qxt = None, _with_scale(x2.T, sx, recipe.fwd_fmt)
    else:
        keep_x, qxt = x, None
    # x_like [..., 0]: x's leading shape and dtype, no data
    return y, (qxt, sx, w, sw, keep_x, jnp.zeros(x.shape[:-1] + (0,), x.dtype))


def _fp8_dot_bwd(recipe, res, dy):
    dy2 = _flat(dy)
    if recipe.scaling != "tensor":
        x, w = res
        dx = _dgrad(dy2, w, recipe, x.dtype).reshape(x.shape)
        return dx, _wgrad(_flat(x), dy2, recipe, w.dtype)
    return _tensor_grads(recipe, dy2, _scales(dy2, (0, 1), recipe.grad_fmt), res)


def _tensor_grads(recipe: Recipe, dy2, sdy, res):
    """(dx [..., K], dw [K, N]) of the per-tensor products for dy2 [M, N] with scale sdy
    [1, 1]; res: the forward's (qxt, sx, w, sw, x, x_like) (_fp8_dot_fwd)."""
    qxt, sx, w, sw, x, x_like = res
    qdy = _with_scale(dy2, sdy, recipe.grad_fmt)                        # [M, N]
    dx = _f8_mm(qdy, sdy, _with_scale(w, sw, recipe.fwd_fmt), sw, x_like.dtype)
    dx = dx.reshape(x_like.shape[:-1] + (w.shape[0],))
    if recipe.wgrad == "fp8":                                           # [K, M] . [N, M]
        dw = _f8_mm(qxt, sx, _with_scale(dy2.T, sdy, recipe.grad_fmt), sdy, w.dtype)
    else:
        dw = _wgrad(_flat(x), dy2, recipe, w.dtype)
    return dx, dw


_fp8_dot.defvjp(_fp8_dot_fwd, _fp8_dot_bwd)


def fp8_dot(x: jax.Array, w: jax.Array, recipe: Recipe = Recipe()) -> jax.Array:
    """x [..., K] @ w [K, N] -> [..., N] in x.dtype, every product in FP8 (module docstring).

    Differentiable in x and w (custom_vjp: dgrad and wgrad as the recipe says); jit-able.
    recipe.scaling "delayed" (no amax history here) runs as "tensor"."""
    x, w = jnp.asarray(x), jnp.asarray(w)
    _check(x, w)
    if recipe.scaling == "delayed":
        recipe = dataclasses.replace(recipe, scaling="tensor")
    return _fp8_dot(x, w, recipe)


def fp8_dot_reference(x, w, recipe: Recipe = Recipe(), dtype=jnp.float32):
    """The forward of fp8_dot in `dtype` jnp: dequantized operands, exact-precision matmul.

    x [..., K], w [K, N] -> [..., N] in `dtype`."""
    x, w = jnp.asarray(x), jnp.asarray(w)
    _check(x, w)
    return _reference_mm(_flat(x), w, recipe.fwd_fmt, recipe.fwd_fmt, recipe.scaling, True,
                         dtype).reshape(x.shape[:-1] + (w.shape[1],))


def fp8_grads_reference(x, w, dy, recipe: Recipe = Recipe(), dtype=jnp.float32):
    """(dx [..., K], dw [K, N]) of fp8_dot's backward for cotangent dy [..., N], in `dtype`."""
    x, w, dy = jnp.asarray(x), jnp.asarray(w), jnp.asarray(dy)
    x2, dy2 = _flat(x), _flat(dy)
    dx = _reference_mm(dy2, w.T, recipe.grad_fmt, recipe.fwd_fmt, recipe.scaling, True, dtype)
    if recipe.wgrad == "fp8":
        dw = _reference_mm(x2.T, dy2, recipe.fwd_fmt, recipe.grad_fmt, recipe.scaling, False, dtype)
    else:
        dt = jnp.bfloat16 if recipe.wgrad == "bf16" else jnp.float32
        x2, dy2 = lax.optimization_barrier((x2.astype(dt), dy2.astype(dt)))   # see deq below
        dw = jnp.matmul(x2.astype(dtype).T, dy2.astype(dtype), precision=lax.Precision.HIGHEST)
    return dx.reshape(x.shape), dw


def _reference_mm(a, b, a_fmt, b_fmt, scaling, b_weight, dtype):
    """dequantize(quantize(a)) @ dequantize(quantize(b)) in `dtype` ([M, K] @ [K, N])."""
    (m, k), n = a.shape, b.shape[1]
    blk_a, blk_b = _operand_blocks(m, k, n, scaling, b_weight)

    def deq(t, blk, fmt):
        bs = quantize(t, Layout(block=blk, scale="f32"), FORMATS[fmt])
        s = jnp.repeat(jnp.repeat(bs.scales.astype(dtype), blk[0], axis=0)[:t.shape[0]],
                       blk[1], axis=1)[:, :t.shape[1]]
        # the barrier keeps XLA:GPU from folding the convert pair float -> FP8 -> float
        # into nothing (its simplify-fp-conversions pass), which would drop the quantization
        return lax.optimization_barrier(bs.q).astype(dtype) * s

    return jnp.matmul(deq(a, blk_a, a_fmt), deq(b, blk_b, b_fmt), precision=lax.Precision.HIGHEST)

