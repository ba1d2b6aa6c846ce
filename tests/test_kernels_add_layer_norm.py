"""kernels.layer_norm.add_layer_norm: the residual add and the LayerNorm after it in one
kernel each way (interpret mode on CPU), against a float64 numpy formula and the jnp
reference, with and without a row mask and a bias; masked and non-finite rows; bad
inputs; the sm_90 Triton lowering. The gpu-marked test runs the compiled kernels at
gem1b's shape.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from kernels.layer_norm import add_layer_norm, add_layer_norm_reference
from test_kernels_layer_norm import close, numpy_layer_norm
from test_kernels_triton_lowering import cuda_lowering  # noqa: F401  (a fixture)

NAMES = ("s", "y", "dx", "dr", "dscale", "dbias")


def inputs(t, d, dtype, seed=0, masked=True):
    k = jax.random.split(jax.random.key(seed), 7)
    x = (2.0 * jax.random.normal(k[0], (t, d)) + 0.5).astype(dtype)
    r = jax.random.normal(k[1], (t, d)).astype(dtype)
    s = 1.0 + 0.3 * jax.random.normal(k[2], (d,))
    b = 0.2 * jax.random.normal(k[3], (d,))
    ds = jax.random.normal(k[4], (t, d)).astype(dtype)
    dy = jax.random.normal(k[5], (t, d)).astype(dtype)
    # about a quarter of the rows padding (0), the first row always kept
    mask = (jax.random.uniform(k[6], (t,)) > 0.25).at[0].set(True) if masked else None
    return x, r, s, b, ds, dy, mask


def run(impl, x, r, s, b, ds, dy, mask, bias=True, residual=True, **knobs):
    """[s, y, dx, dr, dscale, dbias] as float32 numpy (dbias None without a bias, dr None
    without the residual: r=None, the mask alone); scale and bias cast to x's dtype
    first, as the model does."""
    def f(x, r, s, b, ds, dy):
        bb = b.astype(x.dtype) if bias else None
        rr = r if residual else None
        fn = lambda x, r, s, b: add_layer_norm(x, r, s, b, row_mask=mask, impl=impl, **knobs)
        out, vjp = jax.vjp(fn, x, rr, s.astype(x.dtype), bb)
        grads = vjp((ds, dy))
        return [None if a is None else a.astype(jnp.float32) for a in tuple(out) + grads]
    return [None if a is None else np.asarray(a) for a in jax.jit(f)(x, r, s, b, ds, dy)]


def exact(x, r, s, b, ds, dy, mask, bias=True, residual=True):
    """float64 of the same: s = x + r rounded to x's dtype (masked rows 0), y = LN(s) (0 on
    the masked rows, whose dy counts as 0), dx = dr = ds + dLN (0 on the masked rows)."""
    dtype = x.dtype
    keep = np.ones(x.shape[0], bool) if mask is None else np.asarray(mask)
    sum_ = (x.astype(jnp.float32) + r.astype(jnp.float32)).astype(dtype) if residual else x
    s64 = np.where(keep[:, None], np.asarray(sum_, np.float64), 0.0)
    sc = np.asarray(s.astype(dtype), np.float64)
    bi = np.asarray(b.astype(dtype), np.float64) if bias else np.zeros_like(sc)
    dy64 = np.where(keep[:, None], np.asarray(dy, np.float64), 0.0)
    y, dln, dscale, dbias = numpy_layer_norm(s64, sc, bi, dy64)
    y = np.where(keep[:, None], y, 0.0)
    dx = np.where(keep[:, None], np.asarray(ds, np.float64) + dln, 0.0)
    return [s64, y, dx, dx if residual else None, dscale, dbias if bias else None]


# T of {1, 7, 8, 9, 300} (the forward's 8-row tiles, the backward's 2-row tiles, 300: 5
# backward programs, the last part masked), D of {8, 96, 512}, both dtypes
# (masked, residual False: the mask alone, r None)
CASES = [("float32", 1, 8, True, True, True), ("bfloat16", 7, 96, True, False, True),
         ("float32", 8, 512, False, True, True), ("bfloat16", 9, 8, True, True, False),
         ("float32", 300, 96, True, False, True), ("bfloat16", 300, 512, True, True, True),
         ("float32", 300, 96, True, True, False), ("bfloat16", 9, 8, False, True, False)]


@pytest.mark.parametrize("dtype,t,d,masked,bias,residual", CASES)
def test_add_layer_norm_matches_float64(dtype, t, d, masked, bias, residual):
    dtype = jnp.dtype(dtype)
    args = inputs(t, d, dtype, masked=masked)
    kernel = run("pallas", *args, bias=bias, residual=residual)
    ref = run("reference", *args, bias=bias, residual=residual)
    e = exact(*args, bias=bias, residual=residual)
    rel = 2.0 ** -6 if dtype == jnp.bfloat16 else 2e-5
    for name, k, rf, ex in zip(NAMES, kernel, ref, e):
        if ex is None:
            assert k is None and rf is None, name
            continue
        close(k, ex, rel, f"{name} kernel vs float64")
        close(rf, ex, rel, f"{name} reference vs float64")
    np.testing.assert_array_equal(kernel[0], ref[0])         # s: the same rounding
    if masked:
        pad = ~np.asarray(args[-1])
        for name, k in zip(NAMES[:4], kernel[:4]):
            assert k is None or not k[pad].any(), f"{name}: padding rows not 0"


def test_all_rows_masked_and_other_knobs():
    """Every row masked: s, y, dx, dr, dscale, dbias all 0. Other knobs: the same numbers."""
    x, r, s, b, ds, dy, _ = inputs(5, 96, jnp.float32, seed=3)
    none = jnp.zeros((5,), bool)
    for a in run("pallas", x, r, s, b, ds, dy, none):
        assert not a.any()
    args = inputs(50, 96, jnp.float32, seed=4)
    base = run("pallas", *args)
    other = run("pallas", *args, block_rows=4, bwd_rows=8, bwd_tiles=3, num_warps=8,
                bwd_warps=4)
    for name, u, v in zip(NAMES, base, other):
        close(v, u, 2e-6, f"{name} knobs")


def test_non_finite_rows():
    """A NaN / Inf in a masked row is dropped with the row (nothing non-finite anywhere);
    in a kept row it makes its own sum in s and that row's y, dx, dr NaN and no other
    row's, as in the reference."""
    x, r, s, b, ds, dy, mask = inputs(12, 96, jnp.float32, seed=1)
    mask = mask.at[3].set(False).at[6].set(True)
    x = x.at[3, 5].set(jnp.nan).at[3, 9].set(jnp.inf)
    clean = run("pallas", x, r, s, b, ds, dy, mask)
    for name, a in zip(NAMES, clean):
        assert np.isfinite(a).all(), f"{name}: a masked row's NaN leaked"
    bad = x.at[6, 0].set(jnp.nan)
    kernel = run("pallas", bad, r, s, b, ds, dy, mask)
    ref = run("reference", bad, r, s, b, ds, dy, mask)
    for name, k, rf in zip(NAMES, kernel, ref):
        np.testing.assert_array_equal(np.isnan(k), np.isnan(rf), err_msg=name)
    assert np.isnan(kernel[0]).sum() == 1 and np.isnan(kernel[0][6, 0])    # s: the one sum
    for a in kernel[1:4]:
        assert np.isnan(a[6]).all() and np.isfinite(np.delete(a, 6, axis=0)).all()


def test_bad_inputs_are_named():
    x, r, s, b, _, _, _ = inputs(4, 8, jnp.float32)
    cases = [
        (lambda: add_layer_norm(x, r[:, :4], s, b), "r must be"),
        (lambda: add_layer_norm(x, r.astype(jnp.int32), s, b), "r must be"),
        (lambda: add_layer_norm(x, r, s, b, row_mask=jnp.ones((3,), bool)), "row_mask"),
        (lambda: add_layer_norm(x, r, s[:4], b), "scale must be"),
        (lambda: add_layer_norm(x, r, s, b, impl="mosaic"), "impl"),
        (lambda: add_layer_norm(x, r, s, b, bwd_rows=3), "bwd_rows"),
    ]
    for call, words in cases:
        with pytest.raises(ValueError, match=words):
            call()
    s0, y0 = add_layer_norm_reference(x, r, s, b)
    s1, y1 = add_layer_norm(x, r, s, b)                   # impl None: the reference on CPU
    np.testing.assert_array_equal(s0, s1)
    np.testing.assert_array_equal(y0, y1)


@pytest.mark.parametrize("masked,residual", [(True, True), (False, True), (True, False)])
def test_add_kernels_lower_to_verified_triton(cuda_lowering, masked, residual):
    x = jax.ShapeDtypeStruct((4096, 512), jnp.bfloat16)
    p = jax.ShapeDtypeStruct((512,), jnp.bfloat16)
    m = jax.ShapeDtypeStruct((4096,), jnp.bool_)

    def train(x, r, s, b, m):
        fn = lambda x, r, s, b: add_layer_norm(x, r if residual else None, s, b,
                                               row_mask=m if masked else None)
        out, vjp = jax.vjp(fn, x, r, s, b)
        return out, vjp(out)
    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    exp = export.export(jax.jit(train), platforms=["cuda"], disabled_checks=checks)(x, x, p, p, m)
    assert cuda_lowering[0] == 2
    assert exp.mlir_module().count("__gpu$xla.gpu.triton") == 2


@pytest.mark.gpu
def test_gpu_add_kernels_match_reference_at_gem1b_shape():
    """Compiled kernels at [1318144, 512] bf16 with a row mask, forward + backward, against
    the reference on the device: |kernel - reference| <= 2^-6 (|reference| + max |reference|)."""
    assert jax.default_backend() == "gpu"
    x, r, s, b, ds, dy, mask = inputs(1_318_144, 512, jnp.bfloat16)

    @jax.jit
    def off(x, r, s, b, ds, dy, mask):
        outs = []
        for impl in (None, "reference"):                      # impl None: pallas on GPU
            fn = lambda x, r, s, b: add_layer_norm(x, r, s, b, row_mask=mask, impl=impl)
            out, vjp = jax.vjp(fn, x, r, s.astype(x.dtype), b.astype(x.dtype))
            outs.append([a.astype(jnp.float32) for a in tuple(out) + vjp((ds, dy))])
        counts = []
        for k, rf in zip(*outs):
            tol = 2.0 ** -6 * (jnp.abs(rf) + jnp.max(jnp.abs(rf)))
            counts.append(jnp.sum(~(jnp.abs(k - rf) <= tol)))
        return counts
    for name, n in zip(NAMES, off(x, r, s, b, ds, dy, mask)):
        assert int(n) == 0, f"{name}: {int(n)} elements off"


@pytest.mark.parametrize("final_norm,attention", [(True, "softmax"), (False, "block")])
def test_encoder_with_fused_adds_matches_the_unfused_one(final_norm, attention):
    """SequenceEncoder, 3 blocks, norm_impl pallas+add against pallas (same parameters):
    the same outputs and parameter gradients up to float32 rounding, padding rows 0 (with
    garbage in the input's padding rows), and the fused program's norm kernels as the
    class docstring says: every norm an add-norm (block 0's masks the input)."""
    from flax import nnx

    from gemjax.data.jagged import pack
    from gemjax.layers.sequence import SequenceEncoder
    d, lengths = 16, [5, 0, 9, 1, 4, 7]
    rng = np.random.default_rng(0)
    j = pack([rng.normal(size=(n, d)).astype(np.float32) for n in lengths], capacity=40)
    x = np.asarray(j.values).copy()
    n = int(j.offsets[-1])
    x[n:] = 7.0
    x = jnp.asarray(x)
    w = jnp.asarray(rng.normal(size=(40, d)), jnp.float32)
    outs = {}
    for impl in ("pallas", "pallas+add"):
        model = SequenceEncoder(d, num_layers=3, num_heads=2, attention=attention, block=4,
                                final_norm=final_norm, norm_impl=impl, rngs=nnx.Rngs(0))
        loss = lambda m: (lambda y: (jnp.sum(y * w), y))(m(x, j))
        text = str(jax.make_jaxpr(lambda m: loss(m)[1])(model))
        fused, plain = text.count("name=add_layer_norm_fwd"), text.count("name=layer_norm_fwd")
        want = (6 + final_norm, 0) if impl == "pallas+add" else (0, 6 + final_norm)
        assert (fused, plain) == want, (impl, fused, plain)
        (_, y), g = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(model)
        outs[impl] = (np.asarray(y), [np.asarray(a) for a in jax.tree.leaves(nnx.state(g, nnx.Param))])
    (y0, g0), (y1, g1) = outs["pallas"], outs["pallas+add"]
    assert not y1[n:].any() and np.isfinite(y1).all()
    close(y1, y0, 1e-5, "output")
    top = max(float(np.abs(a).max()) for a in g0)
    for a, b in zip(g0, g1):
        close(b, a, 1e-4, "gradient", atol=1e-6 * top)
