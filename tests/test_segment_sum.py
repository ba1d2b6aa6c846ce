"""kernels.segment_sum: the Pallas kernel (interpret mode here) against XLA's segment_sum
(the reference) and float64 numpy, on the layouts that stress its block boundaries."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from kernels.segment_sum import sorted_segment_sum, sorted_segment_sum_reference
from test_kernels_triton_lowering import cuda_lowering  # noqa: F401  (a fixture)

# small tiles: many blocks, zero-fill chunks and column tiles at small sizes
SMALL = dict(block_n=16, block_d=16, block_rows=16)


def _seg(rng, n, kind):
    """seg [N] int32 non-decreasing for a layout kind."""
    if kind == "unique":
        return np.arange(n)
    if kind == "one":
        return np.zeros(n, np.int64)
    if kind == "spanning":        # runs of 1 to 70 positions: many span 2-5 blocks of 16
        lens = rng.integers(1, 70, size=n)
        return np.repeat(np.arange(n), lens)[:n]
    if kind == "gaps":            # jumps past a block, negatives and ids >= K (dropped)
        return np.sort(rng.integers(-5, 400, size=n))
    raise ValueError(kind)


def _case(seed, n, d, k, kind, dtype, m=None, integer=True):
    rng = np.random.default_rng(seed)
    m = m or n + 1
    g = (rng.integers(-6, 7, size=(m, d)) if integer else
         rng.standard_normal((m, d)) * np.exp2(rng.integers(-20, 20, size=(m, 1))))
    g = jnp.asarray(g.astype(np.float32), dtype)
    idx = jnp.asarray(rng.integers(0, m, size=n), jnp.int32)
    return g, idx, jnp.asarray(_seg(rng, n, kind), jnp.int32)


def _kernel_and_reference(g, idx, seg, k, **knobs):
    """(kernel's, reference's) sums, both in one jitted program (one compile, where eager
    calls compile each op of the kernel's glue on its own)."""
    return jax.jit(lambda g, idx, seg: (
        sorted_segment_sum(g, idx, seg, k, impl="pallas", **knobs),
        sorted_segment_sum_reference(g, idx, seg, k)))(g, idx, seg)


def _float64_sums(g, idx, seg, k):
    out = np.zeros((k, g.shape[1]))
    x = np.asarray(g.astype(jnp.float32), np.float64)[np.asarray(idx)]
    s = np.asarray(seg)
    ok = (s >= 0) & (s < k)
    np.add.at(out, s[ok], x[ok])
    return out


@pytest.mark.parametrize("kind,n,d,k,dtype,knobs", [
    ("unique", 50, 20, 60, jnp.bfloat16, SMALL),       # D not a tile multiple; trailing rows 0
    ("one", 100, 16, 3, jnp.float32, SMALL),           # one segment over 7 blocks
    ("spanning", 301, 33, 320, jnp.bfloat16, {**SMALL, "direct_partials": 4}),  # recursion
    ("gaps", 200, 16, 300, jnp.float16, SMALL),        # absent rows inside / between blocks
    ("one", 1, 16, 1, jnp.bfloat16, {}),               # N = 1, default tiles
])
def test_integer_sums_equal_reference(kind, n, d, k, dtype, knobs):
    # integer values: every summation order gives the same float32 bits
    g, idx, seg = _case(0, n, d, k, kind, dtype)
    out, ref = _kernel_and_reference(g, idx, seg, k, **knobs)
    assert out.shape == (k, d) and out.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
    np.testing.assert_array_equal(np.asarray(out), _float64_sums(g, idx, seg, k))


def test_float32_sums_are_close_to_float64():
    # values over 40 binades: the three bf16 parts must carry every float32 bit
    g, idx, seg = _case(1, 400, 16, 420, "spanning", jnp.float32, integer=False)
    out = np.asarray(jax.jit(lambda g, idx, seg: sorted_segment_sum(
        g, idx, seg, 420, impl="pallas", **SMALL))(g, idx, seg), np.float64)
    exact = _float64_sums(g, idx, seg, 420)
    scale = _float64_sums(jnp.abs(g), idx, seg, 420)
    assert np.all(np.abs(out - exact) <= 4e-7 * scale)


def test_non_finite_stays_in_its_segment():
    g, idx, seg = _case(2, 64, 16, 70, "spanning", jnp.bfloat16)
    idx = jnp.arange(64, dtype=jnp.int32)
    g = g.at[3, 0].set(jnp.nan).at[20, 1].set(jnp.inf).at[40, 2].set(jnp.inf)
    g = g.at[41, 2].set(-jnp.inf).at[50, 3].set(-jnp.inf)
    out, ref = _kernel_and_reference(g, idx, seg, 70, **SMALL)
    assert int(np.sum(~np.isfinite(np.asarray(ref)))) >= 3
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))   # NaN where ref has NaN


def test_no_vjp_and_bad_inputs():
    g, idx, seg = _case(3, 8, 16, 8, "unique", jnp.float32)
    f = lambda g: sorted_segment_sum(g, idx, seg, 8, impl="pallas").sum()   # noqa: E731
    with pytest.raises(NotImplementedError, match="no VJP"):   # raised while tracing the VJP
        jax.jit(jax.grad(f))(g)
    with pytest.raises(ValueError, match="g must be"):
        sorted_segment_sum(g[0], idx, seg, 8)
    with pytest.raises(ValueError, match="idx must be integer"):
        sorted_segment_sum(g, idx.astype(jnp.float32), seg, 8)
    with pytest.raises(ValueError, match="idx .* and seg"):
        sorted_segment_sum(g, idx[:4], seg, 8)
    with pytest.raises(ValueError, match="block_d must be a power of two"):
        sorted_segment_sum(g, idx, seg, 8, impl="pallas", block_d=24)
    with pytest.raises(ValueError, match="impl must be"):
        sorted_segment_sum(g, idx, seg, 8, impl="triton")
    with pytest.raises(ValueError, match="g must be bfloat16, float16 or float32"):
        sorted_segment_sum(g.astype(jnp.int32), idx, seg, 8, impl="pallas")
    with pytest.raises(ValueError, match="num_segments must be a static int"):
        sorted_segment_sum(g, idx, seg, 8.0)


def _split(g, cuts):
    """g's rows as sources cut at `cuts` (an empty source where two cuts meet)."""
    edges = [0, *cuts, g.shape[0]]
    return tuple(g[a:b] for a, b in zip(edges[:-1], edges[1:]))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_sources_sum_as_their_concatenation(dtype):
    """g given as sources (cuts inside blocks, an empty source, a one-row source last) sums
    bit-equal to the same rows in one array, non-finite values included."""
    g, idx, seg = _case(4, 301, 33, 320, "spanning", dtype, integer=dtype == jnp.bfloat16)
    g = g.at[150, 0].set(jnp.nan).at[299, 5].set(jnp.inf)
    gs = _split(g, [37, 150, 150, 301])
    assert [x.shape[0] for x in gs] == [37, 113, 0, 151, 1]
    knobs = {**SMALL, "direct_partials": 4}
    out, one, ref, ref_one = jax.jit(lambda gs, g, idx, seg: (
        sorted_segment_sum(gs, idx, seg, 320, impl="pallas", **knobs),
        sorted_segment_sum(g, idx, seg, 320, impl="pallas", **knobs),
        sorted_segment_sum_reference(gs, idx, seg, 320),
        sorted_segment_sum_reference(g, idx, seg, 320)))(gs, g, idx, seg)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(one))
    np.testing.assert_array_equal(np.asarray(ref), np.asarray(ref_one))
    if dtype == jnp.bfloat16:   # integer values: every order gives the reference's bits
        np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))


def test_sources_must_agree():
    g, idx, seg = _case(5, 8, 16, 8, "unique", jnp.float32)
    with pytest.raises(ValueError, match="share D and dtype"):
        sorted_segment_sum((g[:4], g[4:].astype(jnp.bfloat16)), idx, seg, 8)
    with pytest.raises(ValueError, match=r"g\[1\] must be \[M, D\]"):
        sorted_segment_sum((g[:4], g[4, :]), idx, seg, 8)
    with pytest.raises(ValueError, match="non-empty tuple"):
        sorted_segment_sum((), idx, seg, 8)


def test_cuda_lowering_verifies(cuda_lowering):
    """The compiled kernel (not interpret) lowers to Triton IR that verifies, for sm_90,
    float32 and bfloat16 g, with the partials' passes: 600k positions in blocks of 32
    leave 37500, 2344, 148 partials, then 10 for the XLA reduction (four launches)."""
    count = cuda_lowering
    n, k = 600_000, 600_000
    for dtype in (jnp.bfloat16, jnp.float32):
        fn = lambda g, i, s: sorted_segment_sum(g, i, s, k)                    # noqa: E731
        sds = jax.ShapeDtypeStruct
        exp = export.export(jax.jit(fn), platforms=["cuda"],
                            disabled_checks=[export.DisabledSafetyCheck.custom_call(
                                "__gpu$xla.gpu.triton")])(
            sds((n + 1, 512), dtype), sds((n,), jnp.int32), sds((n,), jnp.int32))
        assert exp.mlir_module().count("__gpu$xla.gpu.triton") == 4
    # three bf16 sources (two sequences' rows and a zero row), as the embedding update passes
    fn = lambda a, b, z, i, s: sorted_segment_sum((a, b, z), i, s, k)            # noqa: E731
    exp = export.export(jax.jit(fn), platforms=["cuda"],
                        disabled_checks=[export.DisabledSafetyCheck.custom_call(
                            "__gpu$xla.gpu.triton")])(
        sds((n // 2, 512), jnp.bfloat16), sds((n // 2, 512), jnp.bfloat16),
        sds((1, 512), jnp.bfloat16), sds((n,), jnp.int32), sds((n,), jnp.int32))
    assert exp.mlir_module().count("__gpu$xla.gpu.triton") == 4
    assert count[0] == 12


# ----------------------------------------------------------------------------- GPU (compiled)

def _zipf_case(seed, n, d, dtype, a=1.1, vocab=200_000, integer=False):
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, vocab + 1) ** a
    ids = jnp.asarray(rng.choice(vocab, size=n, p=p / p.sum()), jnp.int32)
    from gemjax.sparse.routing import sorted_unique
    _, perm, seg = sorted_unique(ids)
    g = rng.integers(-6, 7, size=(n + 1, d)) if integer else rng.standard_normal((n + 1, d))
    return jnp.asarray(g.astype(np.float32), dtype), perm, seg


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_gpu_zipf_matches_reference(dtype):
    n, d = 300_000, 256
    g, perm, seg = _zipf_case(10, n, d, dtype, integer=True)
    out = jax.jit(lambda g, i, s: sorted_segment_sum(g, i, s, n, impl="pallas"))(g, perm, seg)
    np.testing.assert_array_equal(np.asarray(out), _float64_sums(g, perm, seg, n))
    g, perm, seg = _zipf_case(11, n, d, dtype)
    out = sorted_segment_sum(g, perm, seg, n, impl="pallas")
    again = sorted_segment_sum(g, perm, seg, n, impl="pallas")
    np.testing.assert_array_equal(np.asarray(out), np.asarray(again))     # deterministic
    exact = _float64_sums(g, perm, seg, n)
    scale = _float64_sums(jnp.abs(g), perm, seg, n)
    assert np.all(np.abs(np.asarray(out, np.float64) - exact) <= 1e-6 * scale + 1e-30)


@pytest.mark.gpu
def test_gpu_sources_match_one_array():
    n, d = 300_000, 256
    g, perm, seg = _zipf_case(12, n, d, jnp.bfloat16, integer=True)
    fn = jax.jit(lambda g, i, s: sorted_segment_sum(g, i, s, n, impl="pallas"))
    out = fn(_split(g, [n // 2 + 7, n]), perm, seg)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(fn(g, perm, seg)))
    np.testing.assert_array_equal(np.asarray(out), _float64_sums(g, perm, seg, n))


@pytest.mark.gpu
@pytest.mark.parametrize("knobs", [dict(block_n=32, block_d=64, num_warps=2),
                                   dict(block_n=128, block_d=128, num_warps=8)])
def test_gpu_layouts_and_knobs(knobs):
    for kind, n, d, k in (("gaps", 5000, 40, 450), ("spanning", 20_001, 100, 20_100),
                          ("unique", 3000, 16, 3100)):
        g, idx, seg = _case(12, n, d, k, kind, jnp.bfloat16)
        g = g.at[idx[7], 3].set(jnp.nan).at[idx[100], 5].set(jnp.inf)
        out = sorted_segment_sum(g, idx, seg, k, impl="pallas", **knobs)
        ref = sorted_segment_sum_reference(g, idx, seg, k)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))


# ----------------------------------------------------------------------------- wiring

def test_sum_duplicates_pallas_equals_xla():
    """routing.sum_duplicates on a sort residual with a pooled-bag source (src_index):
    segment_sum="pallas" gives XLA's sums; "auto" is XLA here (CPU); bad values name
    the setting."""
    from gemjax.sparse import routing
    rng = np.random.default_rng(5)
    ids = jnp.asarray(rng.integers(0, 40, size=150), jnp.int32)
    uniq, res = routing.dedup_ids(ids, "sort")
    src = jnp.asarray(rng.integers(-4, 5, size=(31, 24)), jnp.bfloat16)
    src_index = jnp.asarray(rng.integers(0, 31, size=150), jnp.int32)
    xla, out = jax.jit(lambda src: tuple(routing.sum_duplicates(src, res, 150, src_index,
                                                                segment_sum=impl)
                                         for impl in ("xla", "pallas")))(src)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(xla))
    auto = jax.make_jaxpr(lambda s: routing.sum_duplicates(s, res, 150, src_index))(src)
    assert "pallas_call" not in str(auto)
    with pytest.raises(ValueError, match="segment_sum must be one of"):
        routing.sum_duplicates(src, res, 150, src_index, segment_sum="triton")


@pytest.mark.parametrize("devices", [1, 4])
def test_collection_segment_sum_pallas_equals_xla(devices):
    """EmbeddingCollection(segment_sum="pallas") updates the tables as "xla" does: a local
    table (1 device: unique-count buckets) and a row-wise one (4 devices: routed grads,
    the owner's dedupe); train.sparse_segment_sum reaches the collection."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from gemjax.config import get_config
    from gemjax.sparse import EmbeddingCollection, RowWiseAdagrad, TableSpec
    mesh = Mesh(np.array(jax.devices()[:devices]), ("x",))
    specs = [TableSpec("a", 97, 16, features=("fa",), optimizer=RowWiseAdagrad(lr=0.1, eps=1e-3))]
    sh = NamedSharding(mesh, P("x"))
    rng = np.random.default_rng(3)
    w = rng.integers(-64, 65, (97, 16)) / 256.0
    ids = rng.integers(0, 97, 64).astype(np.int32)
    ids[:20] = 7                                                         # a hot row
    g = {"fa": jax.device_put((rng.integers(-8, 9, (64, 16)) / 64.0).astype(np.float32), sh)}
    out = {}
    for impl in ("xla", "pallas"):
        coll = EmbeddingCollection(specs, "row_wise", mesh, segment_sum=impl)
        state = coll.from_logical({"a": {"weights": w, "accum": np.zeros(97)}})
        _, res = jax.jit(coll.lookup)(state, {"fa": jax.device_put(ids, sh)})
        traced = jax.jit(coll.apply_gradients).trace(state, res, g)   # one trace: jaxpr and program
        assert ("sorted_segment_sum" in str(traced.jaxpr)) == (impl == "pallas")   # the kernel runs
        out[impl] = coll.to_logical(traced.lower().compile()(state, res, g))["a"]
    for k in out["xla"]:
        np.testing.assert_array_equal(out["pallas"][k], out["xla"][k], err_msg=k)
    assert not np.allclose(out["xla"]["weights"], w)                    # the step did update
    with pytest.raises(ValueError, match="segment_sum"):
        EmbeddingCollection(specs, "row_wise", mesh, segment_sum="cuda")
    if devices == 1:
        from gemjax.train.step import Trainer
        cfg = get_config("tiny", "train.sparse_segment_sum=pallas")
        assert Trainer.create(cfg).coll.segment_sum == "pallas"
        with pytest.raises(ValueError, match="sparse.segment_sum"):
            get_config("tiny", "train.sparse_segment_sum=triton")


def test_bench_smoke(tmp_path):
    """benchmarks/bench_segment_sum.py --smoke runs (interpret mode): rows for both impls,
    the kernel's sums within float32 rounding of XLA's, bandwidth by its byte count."""
    import json
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "benchmarks.bench_segment_sum", "--smoke",
                        "--cases=zipf", f"--out={out}"], capture_output=True, text=True,
                       timeout=300, cwd=root, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.load(open(out))["rows"]
    assert [x["impl"] for x in rows] == ["xla", "pallas"]
    n, d = rows[0]["n"], rows[0]["d"]
    for x in rows:
        assert x["GBps"] == pytest.approx((n * d * 2 + 8 * n + 4 * n * d) / x["ms"] / 1e6)
    assert rows[1]["max_abs_err"] < 1e-4
    assert "frac_hbm" in r.stdout.splitlines()[-3]
