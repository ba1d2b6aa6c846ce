"""kernels.layer_norm: the Pallas kernels (interpret mode on CPU) against the jnp reference,
flax's nnx.LayerNorm and a float64 numpy formula, forward and the three gradients; rows
that break naive formulas; the sm_90 Triton lowering; the model wiring (model.norm_impl);
the benchmark's smoke run. The gpu-marked test runs the compiled kernels at gem1b's shape.
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from flax import nnx

from kernels.layer_norm import KNOBS, default_impl, layer_norm, layer_norm_reference
from test_kernels_triton_lowering import cuda_lowering  # noqa: F401  (a fixture)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BR = KNOBS["block_rows"]
EPS = 1e-6


def numpy_layer_norm(x, scale, bias, dy, eps=EPS):
    """float64 (y, dx, dscale, dbias) of y = (x - mean) / sqrt(var + eps) * scale + bias."""
    x, s, b, dy = (np.asarray(a, np.float64) for a in (x, scale, bias, dy))
    mean = x.mean(-1, keepdims=True)
    xc = x - mean
    rstd = 1.0 / np.sqrt((xc * xc).mean(-1, keepdims=True) + eps)
    xhat = xc * rstd
    g = dy * s
    dx = rstd * (g - g.mean(-1, keepdims=True) - xhat * (g * xhat).mean(-1, keepdims=True))
    return xhat * s + b, dx, (dy * xhat).sum(0), dy.sum(0)


def flax_layer_norm(x, scale, bias):
    """nnx.LayerNorm(D, dtype=x.dtype, param_dtype=float32) holding scale and bias."""
    ln = nnx.LayerNorm(x.shape[1], dtype=x.dtype, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    ln.scale, ln.bias = nnx.Param(scale), nnx.Param(bias)
    return ln(x)


def op(impl, **knobs):
    """The op as the model calls it: scale and bias cast to x's dtype first (as flax does)."""
    return lambda x, s, b: layer_norm(x, s.astype(x.dtype), b.astype(x.dtype), impl=impl, **knobs)


def with_grads(fn, x, s, b, dy):
    """[y, dx, dscale, dbias] as float32 numpy, one jitted program."""
    def f(x, s, b, dy):
        y, vjp = jax.vjp(fn, x, s, b)
        return [a.astype(jnp.float32) for a in (y,) + vjp(dy)]
    return [np.asarray(a) for a in jax.jit(f)(x, s, b, dy)]


def inputs(t, d, dtype, seed=0):
    k = jax.random.split(jax.random.key(seed), 4)
    x = (2.0 * jax.random.normal(k[0], (t, d)) + 0.5).astype(dtype)
    s = 1.0 + 0.3 * jax.random.normal(k[1], (d,))
    b = 0.2 * jax.random.normal(k[2], (d,))
    return x, s, b, jax.random.normal(k[3], (t, d)).astype(dtype)


def close(a, ref, rel, what, atol=0.0):
    """|a - ref| <= rel * (|ref| + max |ref|) + atol, elementwise (NaN where ref is NaN)."""
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    tol = rel * (np.abs(ref) + np.nanmax(np.abs(ref))) + atol
    bad = ~(np.abs(a - ref) <= tol) & ~(np.isnan(a) & np.isnan(ref))
    assert not bad.any(), (f"{what}: {bad.sum()} of {bad.size} off, worst "
                           f"{np.nanmax(np.abs(a - ref) - tol):.3g} over tolerance")


NAMES = ("y", "dx", "dscale", "dbias")
# every T of {1, 7, BR, BR + 1, 300} and D of {8, 96, 512}, both dtypes (BR: the forward's
# block_rows, 8; the backward's 2-row tiles: BR + 1 leaves one row in the last); T=300 runs
# 5 backward programs of 32 tiles of 2 rows, the last one part masked
CASES = [("float32", 1, 8), ("bfloat16", 7, 96), ("float32", BR, 512), ("bfloat16", BR + 1, 8),
         ("float32", 300, 96), ("bfloat16", 300, 512)]


def test_kernel_matches_references():
    """Every case of CASES: the kernel, the jnp reference and flax in one jitted program,
    each against float64 and the kernel against the other two."""
    ins = jax.jit(lambda: [inputs(t, d, jnp.dtype(dtype)) for dtype, t, d in CASES])()

    def all_cases(ins):
        out = []
        for x, s, b, dy in ins:
            for fn in (op("pallas"), op("reference"), flax_layer_norm):
                y, vjp = jax.vjp(fn, x, s, b)
                out.append([a.astype(jnp.float32) for a in (y,) + vjp(dy)])
        return out
    got = jax.jit(all_cases)(ins)
    for i, ((dtype, t, d), (x, s, b, dy)) in enumerate(zip(CASES, ins)):
        dtype = jnp.dtype(dtype)
        kernel, ref, flax = ([np.asarray(a) for a in got[3 * i + j]] for j in range(3))
        # float64 of the numbers the op sees: x and dy as given, scale / bias rounded to dtype
        exact = numpy_layer_norm(x.astype(jnp.float32), s.astype(dtype).astype(jnp.float32),
                                 b.astype(dtype).astype(jnp.float32), dy.astype(jnp.float32))
        # outputs rounded to dtype: a few of its ulps; float32 sums: ~1e-5 of the largest
        rel = 2.0 ** -6 if dtype == jnp.bfloat16 else 2e-5
        case = f"{dtype} T={t} D={d}"
        for name, k, r, f, e in zip(NAMES, kernel, ref, flax, exact):
            close(k, e, rel, f"{case} {name} kernel vs float64")
            close(r, e, rel, f"{case} {name} reference vs float64")
            close(k, f, rel, f"{case} {name} kernel vs flax")
            close(k, r, rel, f"{case} {name} kernel vs reference")
        assert kernel[0].shape == (t, d)
        assert jax.eval_shape(lambda x: layer_norm(x, s, b, impl="pallas"), x).dtype == dtype


def test_rows_of_zeros_large_offsets_and_non_finite():
    """All-zero rows give y = bias; rows far from 0 keep their variance (float64 agrees, the
    E[x^2] - E[x]^2 form of flax's default loses it); NaN / Inf stay in their own row."""
    t, d = 12, 96
    x, s, b, dy = inputs(t, d, jnp.float32, seed=1)
    x = x.at[1].set(0.0)
    x = x.at[2].set(1e4 + jax.random.normal(jax.random.key(5), (d,)))
    x = x.at[3].set(-3e4 + 0.5 * jax.random.normal(jax.random.key(6), (d,)))
    bad = x.at[5, 7].set(jnp.nan).at[8, 0].set(jnp.inf)
    kernel = with_grads(op("pallas"), bad, s, b, dy)
    ref = with_grads(op("reference"), bad, s, b, dy)
    ok = np.ones(t, bool)
    ok[[5, 8]] = False
    exact = numpy_layer_norm(x[ok], s, b, dy[ok])
    np.testing.assert_array_equal(kernel[0][1], np.asarray(b))
    far = np.isin(np.flatnonzero(ok), [2, 3])     # of the finite rows: the offset ones
    for name, k, e in zip(NAMES[:2], kernel[:2], exact[:2]):
        close(k[ok][~far], e[~far], 2e-5, f"{name} finite rows vs float64")
        # x at 3e4 carries float32 steps of 2e-3 (its std 0.5): the mean is that coarse
        close(k[ok][far], e[far], 3e-3, f"{name} offset rows vs float64")
        assert np.isnan(k[~ok]).all(), f"{name}: the NaN / Inf rows are not NaN"
    close(kernel[3], np.asarray(dy).sum(0), 2e-5, "dbias")
    for k, r in zip(kernel, ref):     # dscale sums over the rows: NaN as in the reference
        np.testing.assert_array_equal(np.isnan(k), np.isnan(r))
    # the float64 check is sharp: flax's one-pass variance misses it on the offset rows
    flax = np.asarray(flax_layer_norm(x[2:4], s, b))
    assert np.abs(flax - exact[0][2:4]).max() > 1.0


def test_knobs_and_bias_none():
    """Other knobs and no bias give the same numbers (dbias absent); one jitted program."""
    x, s, b, dy = inputs(50, 96, jnp.float32, seed=2)

    @jax.jit
    def run(x, s, b, dy):
        outs = []
        for fn in (op("pallas"), op("pallas", block_rows=4, bwd_rows=2, bwd_tiles=3,
                                     num_warps=8, bwd_warps=2, bwd_stages=2)):
            y, vjp = jax.vjp(fn, x, s, b)
            outs.append((y,) + vjp(dy))
        y, vjp = jax.vjp(lambda x, s: layer_norm(x, s, None, impl="pallas"), x, s)
        return outs, (y,) + vjp(dy), layer_norm_reference(x, s, None)
    (base, other), (y, dx, ds), y0 = run(x, s, b, dy)
    for name, u, v in zip(NAMES, base, other):
        close(u, v, 2e-6, f"{name} knobs")
    close(y, y0, 2e-6, "y without bias")
    close(dx, base[1], 2e-6, "dx without bias")
    close(ds, base[2], 2e-6, "dscale without bias")


def test_bad_inputs_and_knobs_are_named():
    x, s, b, _ = inputs(4, 8, jnp.float32)
    cases = [
        (lambda: layer_norm(x[0], s, b), "x must be"),
        (lambda: layer_norm(x.astype(jnp.int32), s, b), "x must be floating"),
        (lambda: layer_norm(x, s[:4], b), "scale must be"),
        (lambda: layer_norm(x, s, b[:4]), "bias must be"),
        (lambda: layer_norm(x, s, b, eps=0.0), "eps"),
        (lambda: layer_norm(x, s, b, impl="mosaic"), "impl"),
        (lambda: layer_norm(x, s, b, block_rows=3), "block_rows"),
        (lambda: layer_norm(x, s, b, bwd_tiles=0), "bwd_tiles"),
        (lambda: layer_norm(x, s, b, bwd_rows=6), "bwd_rows"),
        (lambda: layer_norm(x, s, b, bwd_stages=0), "bwd_stages"),
        (lambda: layer_norm(x, s, b, bwd_warps=5), "bwd_warps"),
        (lambda: layer_norm(x, s, b, num_warps=3), "num_warps"),
        (lambda: layer_norm(x, s, b, block_cols=64), "unknown knobs"),
        (lambda: layer_norm(jnp.zeros((2, 2048)), jnp.ones(2048), None, impl="pallas"),
         "MAX_DIM"),
        (lambda: layer_norm(jax.ShapeDtypeStruct((2 ** 22, 512), jnp.bfloat16),
                            jnp.ones(512), None, impl="pallas"), "2\\^31"),
    ]
    for call, words in cases:
        with pytest.raises(ValueError, match=words):
            call()
    assert default_impl(512, jnp.bfloat16, backend="gpu") == "pallas"
    assert default_impl(512, jnp.bfloat16, backend="cpu") == "reference"
    assert default_impl(2048, jnp.bfloat16, backend="gpu") == "reference"
    assert default_impl(512, jnp.bfloat16, backend="gpu", rows=2 ** 22) == "reference"
    from gemjax.config import get_config
    with pytest.raises(ValueError, match="model.norm_impl"):
        get_config("tiny", "model.norm_impl=triton")


# --- the sm_90 Triton lowering (cuda_lowering: tests/test_kernels_triton_lowering.py) ---


@pytest.mark.parametrize("dtype,t,d,bias,knobs", [
    ("bfloat16", 4096, 512, True, {}),
    ("float32", 1000, 96, False, dict(block_rows=4, bwd_rows=16, bwd_tiles=3, num_warps=8,
                                      bwd_warps=2, bwd_stages=3)),
])
def test_kernels_lower_to_verified_triton(cuda_lowering, dtype, t, d, bias, knobs):
    x = jax.ShapeDtypeStruct((t, d), jnp.dtype(dtype))
    p = jax.ShapeDtypeStruct((d,), jnp.dtype(dtype))

    def train(x, s, b):
        fn = lambda x, s, b: layer_norm(x, s, b if bias else None, **knobs)  # impl None: pallas
        y, vjp = jax.vjp(fn, x, s, b)
        return y, vjp(y)
    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    exp = export.export(jax.jit(train), platforms=["cuda"], disabled_checks=checks)(x, p, p)
    assert cuda_lowering[0] == 2
    assert exp.mlir_module().count("__gpu$xla.gpu.triton") == 2


# --- the model wiring ---

def test_pallas_module_is_nnx_layer_norm():
    """PallasLayerNorm has nnx.LayerNorm's parameters (names, shapes, values, metadata) and
    its outputs and gradients over [..., D] in bfloat16."""
    from gemjax.layers.axes import PallasLayerNorm, layer_norm as make_norm
    xla = make_norm(96, dtype=jnp.bfloat16, rngs=nnx.Rngs(3))
    pallas = make_norm(96, dtype=jnp.bfloat16, impl="pallas", rngs=nnx.Rngs(3))
    assert isinstance(xla, nnx.LayerNorm) and isinstance(pallas, PallasLayerNorm)
    sx, sp = nnx.state(xla, nnx.Param), nnx.state(pallas, nnx.Param)
    assert jax.tree.structure(sx) == jax.tree.structure(sp)
    for a, c in zip(jax.tree.leaves(sx, is_leaf=lambda v: isinstance(v, nnx.Variable)),
                    jax.tree.leaves(sp, is_leaf=lambda v: isinstance(v, nnx.Variable))):
        assert a.get_metadata()["out_sharding"] == c.get_metadata()["out_sharding"] == ("norm",)
        np.testing.assert_array_equal(a[...], c[...])
    params = {"scale": 1.0 + 0.3 * jax.random.normal(jax.random.key(1), (96,)),
              "bias": 0.2 * jax.random.normal(jax.random.key(2), (96,))}
    x = jax.random.normal(jax.random.key(4), (2, 5, 96)).astype(jnp.bfloat16)
    dy = jax.random.normal(jax.random.key(5), (2, 5, 96)).astype(jnp.bfloat16)
    outs = []
    for mod in (xla, pallas):
        gd, _ = nnx.split(mod)
        f = lambda p, x: nnx.merge(gd, nnx.State({k: nnx.Param(v) for k, v in p.items()}))(x)
        y, vjp = jax.vjp(f, params, x)
        dp, dx = vjp(dy)
        outs.append([y, dx, dp["scale"], dp["bias"]])
    for name, u, v in zip(NAMES, *outs):
        close(np.asarray(u, np.float32), np.asarray(v, np.float32), 2.0 ** -6, name)
    with pytest.raises(ValueError, match="impl"):
        make_norm(8, impl="triton", rngs=nnx.Rngs(0))


def test_auto_norm_is_pallas_on_gpu_only(monkeypatch):
    """impl="auto": the kernels on a GPU backend when the width fits, nnx.LayerNorm
    elsewhere; the gem1b preset asks for it; the residual-add forms are gone."""
    from gemjax.config import get_config
    from gemjax.layers import axes as axes_mod
    from gemjax.layers.axes import PallasLayerNorm, layer_norm as make_norm
    assert isinstance(make_norm(96, impl="auto", rngs=nnx.Rngs(0)), nnx.LayerNorm)
    for gone in ("pallas+add", "auto+add"):
        with pytest.raises(ValueError, match="impl"):
            make_norm(96, impl=gone, rngs=nnx.Rngs(0))
        with pytest.raises(ValueError, match="model.norm_impl"):
            get_config("tiny", f"model.norm_impl={gone}")
    monkeypatch.setattr(axes_mod.jax, "default_backend", lambda: "gpu")
    assert isinstance(make_norm(96, impl="auto", rngs=nnx.Rngs(0)), PallasLayerNorm)
    assert isinstance(make_norm(2048, impl="auto", rngs=nnx.Rngs(0)), nnx.LayerNorm)
    assert get_config("gem1b").model.norm_impl == "auto"
    assert get_config("tiny", "model.norm_impl=auto").model.norm_impl == "auto"


def test_teacher_with_pallas_norms_matches_xla():
    """model.norm_impl=pallas: the tiny teacher's sequence-encoder norms run the kernels
    (one forward kernel per norm in the traced step), with the same parameters and the same
    logits and gradients as "xla". The teacher reads one sequence (each sequence's pyramid
    is the same encoder); both impls' steps are traced and compiled as one program, each
    step's jaxpr its own inner jit's, so one trace serves the counts and the run."""
    from gemjax.layers.axes import PallasLayerNorm
    from gemjax.models.interformer import GEMTeacher
    from tiny_teacher import one_program, teacher_config, teacher_inputs   # tests/tiny_teacher.py
    steps, params = {}, {}
    for impl in ("xla", "pallas"):
        cfg = teacher_config(f"model.norm_impl={impl}", batch_size=8, sequences=1)
        model = GEMTeacher(cfg, rngs=nnx.Rngs(0))
        norms = [m for _, m in nnx.iter_graph(model) if isinstance(m, PallasLayerNorm)]
        # per sequence one block (2 norms) + the encoder's out_norm
        assert len(norms) == (0 if impl == "xla" else 3 * len(cfg.features.sequences))
        gd, params[impl], rest = nnx.split(model, nnx.Param, ...)

        def loss(params, acts, gd=gd, rest=rest):
            logits = nnx.merge(gd, params, rest)(acts, batch)
            return jnp.sum(jnp.sin(logits.astype(jnp.float32))), logits
        steps[impl] = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    batch, acts = teacher_inputs(cfg)
    p0, p1 = params["xla"], params["pallas"]
    assert jax.tree.structure(p0) == jax.tree.structure(p1)
    for u, v in zip(jax.tree.leaves(p0), jax.tree.leaves(p1)):
        np.testing.assert_array_equal(u, v)
    # the same parameters: both steps take p0
    traced, inner = one_program([steps["xla"], steps["pallas"]], p0, acts)
    for impl, jaxpr in zip(("xla", "pallas"), inner):
        plain = str(jaxpr).count("name=layer_norm_fwd")
        assert plain == (3 * len(cfg.features.sequences) if impl == "pallas" else 0), (impl, plain)
    ((_, l0), g0), ((_, l1), g1) = traced.lower().compile()(p0, acts)
    close(l1, l0, 1e-4, "pallas logits")
    leaves0, leaves1 = jax.tree.leaves(g0), jax.tree.leaves(g1)
    assert len(leaves0) == len(leaves1)
    top = max(float(jnp.abs(u).max()) for u in leaves0)
    assert top > 0
    for u, v in zip(leaves0, leaves1):  # float32 rounding, relative to the largest gradient
        close(v, u, 1e-3, "pallas gradient", atol=1e-5 * top)


def test_bench_smoke(tmp_path):
    """benchmarks/bench_layer_norm.py --smoke runs (interpret mode): a row per impl (and
    sweep setting) and pass, the bytes of its docstring, the kernel's outputs close to
    XLA's."""
    out = tmp_path / "bench.json"
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-m", "benchmarks.bench_layer_norm", "--smoke",
                        "--sweep=block_rows=4:bwd_tiles=3:bwd_warps=2", f"--out={out}"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.load(open(out))
    rows = {(x["impl"], x["kind"]): x for x in res["rows"]}
    assert set(rows) == {(i, k) for i in ("xla", "pallas", "pallas_sweep")
                         for k in ("fwd", "fwd_bwd")}
    assert rows["pallas_sweep", "fwd"]["knobs"] == "block_rows=4:bwd_tiles=3:bwd_warps=2"
    t, d = res["rows_t"], res["d"]
    plain = {"fwd": 2 * t * d * 2 + 8 * t, "fwd_bwd": 5 * t * d * 2 + 16 * t}
    for (impl, kind), x in rows.items():
        nbytes = plain[kind]
        assert x["GBps"] == pytest.approx(nbytes / (x["ms"] * 1e-3) / 1e9, rel=1e-9)
        if impl != "xla":
            assert x["max_abs_err"] <= 0.05      # bf16 outputs of size ~4: a few ulps
    assert "fwd_bwd" in r.stdout and "frac_hbm" in r.stdout


# --- on the device ---

@pytest.mark.gpu
def test_gpu_kernels_match_reference_at_gem1b_shape():
    """Compiled kernels at [1318144, 512] bf16, forward + backward, against the reference
    (compared on the device: |kernel - reference| <= 2^-6 (|reference| + max |reference|))."""
    assert jax.default_backend() == "gpu"
    t, d = 1_318_144, 512
    x, s, b, dy = inputs(t, d, jnp.bfloat16)
    x = x.at[:1000].set(0.0)                                  # padding rows of the encoder
    assert "pallas_call" in str(jax.make_jaxpr(op(None))(x, s, b))

    @jax.jit
    def off(x, s, b, dy):
        outs = []
        for impl in (None, "reference"):                      # impl None: pallas on GPU
            y, vjp = jax.vjp(op(impl), x, s, b)
            outs.append([a.astype(jnp.float32) for a in (y,) + vjp(dy)])
        counts = []
        for k, r in zip(*outs):
            tol = 2.0 ** -6 * (jnp.abs(r) + jnp.max(jnp.abs(r)))
            counts.append(jnp.sum(~(jnp.abs(k - r) <= tol)))
        return counts
    for name, n in zip(NAMES, off(x, s, b, dy)):
        assert int(n) == 0, f"{name}: {int(n)} elements off"
