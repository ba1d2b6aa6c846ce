"""gemjax.precision.gemm (FP8 GEMM, forward, dgrad, wgrad) against float64 numpy references.

Two references per product: (1) the float64 product of the dequantized operands (the FP8
GEMM must match it up to float32 summation order), (2) the exact float64 product of the
unquantized operands, within an error bound derived from the formats: an element v of a
block with scale s rounds to within u |v| + s 2**(emin - m - 1) (u = 2**-(m + 1): 2**-4
for E4M3, 2**-3 for E5M2; the second term covers subnormals), so a product's error is at
most |A| @ eB + eA @ |B| + eA @ eB for the element bounds eA, eB.

Summation: float32, (K + 8) 2**-23 |A| @ |B|; on the GPU plus 2**-11 |A| @ |B| for the
FP8 tensor cores, which keep about 14 bits of a partial sum inside one MMA (measured on an
H200: at most 1.2e-4 |A| @ |B| at precision HIGHEST, 5e-4 under fast accumulation, for K
from 32 to 8192, not growing with K).
"""

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
import pytest

from gemjax.precision.formats import FORMATS, Layout
from gemjax.precision.gemm import Recipe, fp8_dot, fp8_dot_reference, fp8_grads_reference
from gemjax.precision.quantize import quantize

# M-shape (leading dims of x), K, N: ragged K (not a multiple of 128), M = 1, K < 128
SHAPES = [((4, 8), 200, 48), ((1,), 130, 17), ((3, 5), 64, 129)]
# (recipe, how many of SHAPES it runs on)
RECIPES = [(Recipe("rowwise"), 3), (Recipe("blocked"), 2), (Recipe("tensor"), 1),
           (Recipe("rowwise", grad_fmt="e4m3"), 1), (Recipe("rowwise", fast_accum="forward"), 3)]


_quantize = jax.jit(quantize, static_argnums=(1, 2))
MMA_ERR = 0.0 if jax.default_backend() == "cpu" else 2.0 ** -11
# the jnp reference against the FP8 GEMM: float32 summation orders, or the MMA error
REF_TOL = 2e-5 if jax.default_backend() == "cpu" else 2.0 ** -10
_reference = jax.jit(fp8_dot_reference, static_argnums=(2,))
_grads_reference = jax.jit(fp8_grads_reference, static_argnums=(3,))


def _blocks(scaling, shape, role):
    """Quantization block of an operand of `shape` in a GEMM; role "a" (left, contracting
    its last axis), "w" (right, a weight) or "act" (right, activation-like)."""
    k = shape[1] if role == "a" else shape[0]
    if scaling == "rowwise":
        return (1, k) if role == "a" else (k, 1)
    if scaling == "tensor":
        return tuple(shape)
    return {"a": (1, 128), "w": (128, 128), "act": (128, 1)}[role]


def _deq64(t, block, fmt):
    """(dequantized float64, element error bound float64) of the 2-D float32 array t."""
    t = np.asarray(t, np.float32)
    bs = _quantize(jnp.asarray(t), Layout(block=block, scale="f32"), FORMATS[fmt])
    s = np.asarray(bs.scales, np.float64)
    s = np.repeat(np.repeat(s, block[0], 0)[:t.shape[0]], block[1], 1)[:, :t.shape[1]]
    f = FORMATS[fmt]
    u = 2.0 ** -(f.mantissa_bits + 1) * (1 + 2.0 ** -20)        # + the float32 x / s rounding
    err = u * np.abs(t.astype(np.float64)) + s * 2.0 ** (f.min_normal_exp - f.mantissa_bits - 1)
    return np.asarray(bs.q, np.float64) * s, err


def _check_product(got, a, b, scaling, a_fmt, b_fmt, b_role):
    """got ~ a [M, K] @ b [K, N]: checks (1) and (2) of the module docstring."""
    k = a.shape[1]
    if scaling == "blocked" and k % 128:                 # the GEMM pads K with zeros
        a = np.pad(a, ((0, 0), (0, -k % 128)))
        b = np.pad(b, ((0, -k % 128), (0, 0)))
    da, ea = _deq64(a, _blocks(scaling, a.shape, "a"), a_fmt)
    db, eb = _deq64(b, _blocks(scaling, b.shape, b_role), b_fmt)
    got = np.asarray(got, np.float64)
    mag = np.abs(da) @ np.abs(db)
    summation = ((k + 8) * 2.0 ** -23 + MMA_ERR) * mag
    np.testing.assert_array_less(np.abs(got - da @ db), summation + 1e-30)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    bound = np.abs(a64) @ eb + ea @ np.abs(b64) + ea @ eb + summation
    err = np.abs(got - a64 @ b64)
    np.testing.assert_array_less(err, bound + 1e-30)
    return err, bound


def _data(lead, k, n, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=lead + (k,)) * np.exp(rng.normal(size=lead + (1,)))  # rows of mixed scale
    x = x.astype(np.float32)
    x.reshape(-1, k)[0, : k // 3] = 0.0                    # a partly zero row
    if x.reshape(-1, k).shape[0] > 2:
        x.reshape(-1, k)[2] = 0.0                          # an all-zero row
    w = (rng.normal(size=(k, n)) / np.sqrt(k)).astype(np.float32)
    dy = rng.normal(size=lead + (n,)).astype(np.float32)
    return x, w, dy


@pytest.mark.parametrize("recipe,shapes", RECIPES, ids=lambda r: getattr(r, "scaling", str(r)))
def test_forward_and_backward_vs_float64(recipe, shapes):
    for i, (lead, k, n) in enumerate(SHAPES[:shapes]):
        x, w, dy = _data(lead, k, n, i)
        y, vjp = jax.vjp(jax.jit(lambda x, w: fp8_dot(x, w, recipe)), x, w)
        dx, dw = vjp(jnp.asarray(dy))
        assert y.shape == lead + (n,) and dx.shape == x.shape and dw.shape == w.shape
        x2, dy2 = x.reshape(-1, k), dy.reshape(-1, n)
        f, g = recipe.fwd_fmt, recipe.grad_fmt
        err, bound = _check_product(np.asarray(y).reshape(-1, n), x2, w, recipe.scaling, f, f, "w")
        assert err.max() > 0                             # the product really is quantized
        if x2.shape[0] > 2:
            assert not np.asarray(y).reshape(-1, n)[2].any()     # all-zero row -> zeros
        _check_product(np.asarray(dx).reshape(-1, k), dy2, w.T, recipe.scaling, g, f, "w")
        _check_product(np.asarray(dw), x2.T, dy2, recipe.scaling, f, g, "act")
        # the jnp reference of the same quantized products
        rdx, rdw = _grads_reference(x, w, dy, recipe)
        for got, ref in ((y, _reference(x, w, recipe)), (dx, rdx), (dw, rdw)):
            ref = np.asarray(ref)
            np.testing.assert_allclose(got, ref, rtol=REF_TOL,
                                       atol=REF_TOL * (np.abs(ref).max() if MMA_ERR else 1.0))


def test_error_bound_is_tight_enough_to_catch_the_wrong_format():
    """E5M2 where E4M3 is promised breaks the E4M3 bound: the check can fail."""
    x, w, _ = _data((64,), 256, 64, 7)
    y = jax.jit(fp8_dot, static_argnums=2)(x, w, Recipe(fwd_fmt="e5m2"))
    with pytest.raises(AssertionError):
        _check_product(np.asarray(y), x, w, "rowwise", "e4m3", "e4m3", "w")


@pytest.mark.parametrize("wgrad", ["bf16", "f32"])
def test_wgrad_in_higher_precision(wgrad):
    x, w, dy = _data((16,), 160, 24, 3)
    r = Recipe(wgrad=wgrad)
    dw = jax.jit(jax.grad(lambda w: jnp.sum(fp8_dot(x, w, r) * dy)))(jnp.asarray(w))
    x64, dy64 = x.astype(np.float64), dy.astype(np.float64)
    if wgrad == "bf16":
        x64 = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64)
        dy64 = np.asarray(jnp.asarray(dy, jnp.bfloat16), np.float64)
    ref = x64.T @ dy64
    np.testing.assert_allclose(dw, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    fp8 = jax.jit(jax.grad(lambda w: jnp.sum(fp8_dot(x, w) * dy)))(jnp.asarray(w))
    assert np.abs(np.asarray(fp8) - ref).max() > 10 * np.abs(np.asarray(dw) - ref).max()


def test_non_finite_rule():
    """A non-finite input makes exactly the outputs its contraction touches non-finite
    (NaN through E4M3, which has no infinity); the rest match the all-finite product."""
    x, w, dy = _data((6,), 150, 10, 5)
    for recipe in (Recipe("rowwise"), Recipe("blocked")):
        xb, wb = x.copy(), w.copy()
        xb[1, 3], xb[4, 149] = np.nan, np.inf
        wb[7, 2] = -np.inf
        y = np.asarray(jax.jit(fp8_dot, static_argnums=2)(xb, wb, recipe))
        bad = np.zeros_like(y, bool)
        bad[[1, 4]], bad[:, 2] = True, True
        assert np.isnan(y[bad]).all() and np.isfinite(y[~bad]).all()
        xc, wc = x.copy(), w.copy()
        xc[[1, 4]], wc[:, 2] = 0.0, 0.0
        if recipe.scaling == "rowwise":      # rows / columns scale independently
            y_clean = jax.jit(fp8_dot, static_argnums=2)(xc, wc, recipe)
            np.testing.assert_array_equal(y[~bad], np.asarray(y_clean)[~bad])
        # the backward: an inf in dy (E5M2 keeps it) reaches its row of dx and column of dw
        dyb = dy.copy()
        dyb[3, 6] = np.inf
        dx, dw = jax.jit(jax.grad(lambda x, w: jnp.sum(fp8_dot(x, w, recipe) * dyb), (0, 1)))(
            jnp.asarray(x), jnp.asarray(w))
        dx, dw = np.asarray(dx), np.asarray(dw)
        assert not np.isfinite(dx[3]).any() and np.isfinite(np.delete(dx, 3, 0)).all()
        assert not np.isfinite(dw[:, 6]).any() and np.isfinite(np.delete(dw, 6, 1)).all()


def test_bad_input_named():
    with pytest.raises(ValueError, match="x .* @ w"):
        fp8_dot(jnp.ones((4, 8)), jnp.ones((9, 3)))
    with pytest.raises(TypeError, match="x must be a float"):
        fp8_dot(jnp.ones((4, 8), jnp.int32), jnp.ones((8, 3)))
    with pytest.raises(ValueError, match="Recipe.scaling"):
        Recipe(scaling="mx")
    with pytest.raises(ValueError, match="Recipe.wgrad"):
        Recipe(wgrad="fp16")
    with pytest.raises(ValueError, match="Recipe.fast_accum"):
        Recipe(fast_accum="all")


def test_references_keep_the_quantization():
    """Inside one jit the references quantize and dequantize; XLA:GPU folds a bare convert
    pair float -> FP8 -> float into nothing, so they must not lose the FP8 rounding: each
    product differs from the unquantized one by about the E4M3 / E5M2 step."""
    x, w, dy = _data((32,), 192, 40, 11)
    exact = x.astype(np.float64) @ w.astype(np.float64)
    scale = np.abs(exact).max()
    for r in (Recipe("rowwise"), Recipe("tensor"), Recipe("blocked")):
        y = np.asarray(_reference(x, w, r), np.float64)
        assert np.abs(y - exact).max() > 1e-3 * scale, r
        dx, _ = _grads_reference(x, w, dy, r)
        dx_exact = dy.astype(np.float64) @ w.T.astype(np.float64)
        assert np.abs(np.asarray(dx) - dx_exact).max() > 1e-3 * np.abs(dx_exact).max(), r


@pytest.mark.parametrize("scaling", ["rowwise", "tensor"])
def test_bfloat16_operands_write_a_bfloat16_product(scaling):
    """bf16 x, w: y, dx, dw come back in bfloat16, the float32 reference's within bf16
    rounding (a bfloat16 GEMM output, rescaled in float32, rounded again: 2**-8, with
    margin)."""
    x, w, dy = (jnp.asarray(a, jnp.bfloat16) for a in _data((32,), 192, 40, 11))
    r = Recipe(scaling)
    y, vjp = jax.vjp(jax.jit(lambda x, w: fp8_dot(x, w, r)), x, w)
    dx, dw = vjp(dy)
    assert y.dtype == dx.dtype == dw.dtype == jnp.bfloat16
    rdx, rdw = _grads_reference(x, w, dy, r)
    for got, ref in ((y, _reference(x, w, r)), (dx, rdx), (dw, rdw)):
        ref = np.asarray(ref, np.float64)
        np.testing.assert_allclose(np.asarray(got, np.float64), ref, rtol=2 ** -7,
                                   atol=2 ** -7 * np.abs(ref).max())


@pytest.mark.parametrize("scaling,fast", [("rowwise", "none"), ("tensor", "none"),
                                         ("rowwise", "forward"), ("tensor", "forward")])
def test_every_fp8_product_contracts_both_operands_last_axis(scaling, fast):
    """Hopper's FP8 GEMM takes K-major operands only (else XLA transposes the float8
    operand in a slow pass of its own): the forward, dgrad and wgrad dot_generals on float8
    operands each contract the last axis of both, and there are three of them, in this
    order. Each asks for precision HIGHEST (cuBLASLt's float32 accumulation), except the
    forward under fast_accum="forward" (DEFAULT: FP8 fast accumulation); each writes
    bfloat16, the dtype of its result (x, x, w)."""
    x, w, dy = (jnp.asarray(a, jnp.bfloat16) for a in _data((4, 8), 96, 40, 5))
    r = Recipe(scaling, fast_accum=fast)

    def train(x, w, dy):
        y, vjp = jax.vjp(lambda x, w: fp8_dot(x, w, r), x, w)
        return (y,) + vjp(dy)

    def dots(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                yield eqn
            for v in eqn.params.values():            # pjit / custom_vjp bodies
                for sub in (v if isinstance(v, (tuple, list)) else (v,)):
                    sub = getattr(sub, "jaxpr", sub)
                    if hasattr(sub, "eqns"):
                        yield from dots(sub)

    f8 = [e for e in dots(jax.make_jaxpr(train)(x, w, dy).jaxpr)
          if all(jnp.dtype(v.aval.dtype).itemsize == 1 for v in e.invars)]
    assert len(f8) == 3
    for i, e in enumerate(f8):
        (lc, rc), _ = e.params["dimension_numbers"]
        lhs, rhs = (v.aval.ndim for v in e.invars)
        assert (tuple(lc), tuple(rc)) == ((lhs - 1,), (rhs - 1,)), e
        want = lax.Precision.DEFAULT if (i == 0 and fast == "forward") else lax.Precision.HIGHEST
        assert e.params["precision"] == (want,) * 2, e
        assert e.params["preferred_element_type"] == jnp.bfloat16, e
