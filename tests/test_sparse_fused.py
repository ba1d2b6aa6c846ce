"""Fused duplicate sum + row-wise Adagrad (kernels/sparse_update) vs float64 numpy.

Gradients are multiples of 1/256 in [-1, 1], so every duplicate sum is exact in
fp32 whatever the summation order; what is left is the rounding of mean(g^2),
sqrt and the divide, well inside 1e-6 relative. On CPU the kernels run in Pallas
interpret mode; the gpu-marked tests run them compiled. The sm_90 lowering test
exports the compiled kernels for CUDA on this CPU machine and runs the Triton
verifier on every module (as tests/test_kernels_triton_lowering.py).
"""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from gemjax.sparse import RowWiseAdagrad, routing
from kernels.sparse_update import (row_wise_adagrad, row_wise_adagrad_fused,
                                   row_wise_adagrad_reference, run_bounds)
from test_no_host_loops import while_functions

LR, EPS = 0.05, 1e-8


def _case(seed, vocab, dim, n, *, hot=0, n_src=None, invalid=0, zipf=None):
    """Sorted-id inputs built by the real lookup sort (routing.sorted_unique).

    ids [n] uniform (or Zipf) over [0, vocab) with ids 0 and vocab-1 present, a hot
    row repeated `hot` times, the last `invalid` ids masked (INVALID keys); grads
    come from a source [n_src, D] through src_index (pooled-bag style).
    """
    rng = np.random.default_rng(seed)
    if zipf:
        ids = (np.minimum(rng.zipf(zipf, n), 2**31) - 1) * 2654435761 % vocab
    else:
        ids = rng.integers(0, vocab, n)
    ids = ids.astype(np.int32)
    ids[:2] = (0, vocab - 1)
    if hot:
        ids[rng.choice(n, hot, replace=False)] = vocab // 3
    key = ids.copy()
    if invalid:
        key[-invalid:] = routing.INVALID
    n_src = n_src or n
    src_index = rng.integers(0, n_src, n).astype(np.int32)
    g = (rng.integers(-256, 257, (n_src, dim)) / 256).astype(np.float32)
    w = rng.standard_normal((vocab, dim)).astype(np.float32)
    a = rng.random(vocab).astype(np.float32)
    uniq, perm, seg = (np.asarray(x) for x in jax.jit(routing.sorted_unique)(jnp.asarray(key)))
    return dict(ids=ids, key=key, src_index=src_index, g=g, w=w, a=a, uniq=uniq, perm=perm, seg=seg)


def _numpy_reference(c):
    """float64: per-row sums by np.add.at over the valid ids, then the optimizer formula."""
    w, a = c["w"].astype(np.float64), c["a"].astype(np.float64)
    ok = c["key"] != routing.INVALID
    gs = np.zeros_like(w)
    np.add.at(gs, c["ids"][ok], c["g"][c["src_index"][ok]].astype(np.float64))
    touched = np.unique(c["ids"][ok])
    a_new, w_new = a.copy(), w.copy()
    a_new[touched] += np.mean(gs[touched] ** 2, axis=1)
    w_new[touched] -= LR * gs[touched] / (np.sqrt(a_new[touched])[:, None] + EPS)
    return w_new, a_new, touched


def _fused_args(c, k):
    """(rows [k], seg, index) for the kernel: rows -1 past the unique count."""
    rows = np.where(c["uniq"] != routing.INVALID, c["uniq"], -1)[:k].astype(np.int32)
    rows = np.pad(rows, (0, k - rows.size), constant_values=-1)
    return rows, c["seg"], c["src_index"][c["perm"]]


def _assert_matches(c, w, a):
    w_ref, a_ref, touched = _numpy_reference(c)
    w, a = np.asarray(w), np.asarray(a)
    np.testing.assert_allclose(a[touched], a_ref[touched], rtol=1e-6)
    np.testing.assert_allclose(w[touched], w_ref[touched], rtol=1e-6, atol=1e-6)
    rest = np.ones(c["w"].shape[0], bool)
    rest[touched] = False
    assert rest.any()
    assert np.array_equal(w[rest], c["w"][rest]), "untouched table rows changed"
    assert np.array_equal(a[rest], c["a"][rest]), "untouched accumulators changed"


def _run(c, k, interpret, **knobs):
    rows, seg, index = _fused_args(c, k)
    f = jax.jit(lambda w, a, *x: row_wise_adagrad_fused(w, a, *x, lr=LR, eps=EPS,
                                                        interpret=interpret, **knobs),
                donate_argnums=(0, 1))
    return f(jnp.asarray(c["w"]), jnp.asarray(c["a"]), jnp.asarray(rows), jnp.asarray(seg),
             jnp.asarray(index), jnp.asarray(c["g"]))


# ----------------------------------------------------------------------------- CPU (interpret)

def _hot_case():
    # one row 5,000 times: > split, so it goes through the partials pass (5 items)
    return _case(1, vocab=400, dim=64, n=5600, hot=5000, n_src=128)


def _tiers_case():
    # run lengths 1..~600 (Zipf ids) plus a 2,000-id hot row
    return _case(4, vocab=5000, dim=32, n=6000, hot=2000, n_src=300, invalid=7, zipf=1.3)


def _k_n_case():
    return _case(5, vocab=3000, dim=16, n=4000, n_src=200, invalid=3, zipf=1.2)


def _unique(c):
    return int(np.sum(c["uniq"] != routing.INVALID))


TIER_KNOBS = {"one_row_per_program": dict(short=0), "three_tiers": dict(short=4, split=32),
              "short_is_split": dict(short=32, split=32, rows_per_program=32),
              "looped_3_programs": dict(short=4, split=32, short_programs=3),
              "looped_more_programs_than_groups": dict(short=16, short_programs=1000)}


def _interpret_runs():
    """{name: (case, K, knobs)}: every interpret-mode kernel run of the tests below."""
    runs = {}
    for dim in (16, 64, 128):
        # duplicates (n > vocab / 2), ids 0 and V-1, invalid tail, unused programs past U
        c = _case(0, vocab=300, dim=dim, n=400, n_src=64, invalid=5)
        runs[f"dim{dim}"] = (c, _unique(c) + 40, {})
    c = _hot_case()
    runs["hot"] = (c, _unique(c) + 3, dict(split=1024))
    c = _tiers_case()
    for name, knobs in TIER_KNOBS.items():
        runs[name] = (c, _unique(c) + 5, knobs)
    c = _k_n_case()
    for p in (1, 7):
        runs[f"k_n_{p}"] = (c, c["ids"].size, dict(short_programs=p))
    return runs


@pytest.fixture(scope="module")
def interpreted():
    """{name: (case, (weights, accum))}: the runs of _interpret_runs, all in one jitted
    program (each kernel variant traced once; one XLA compile for all of them, not one
    per test: compiling dominates, the interpreter's run is cheap)."""
    runs = _interpret_runs()
    names = list(runs)
    tables = [(jnp.asarray(runs[n][0]["w"]), jnp.asarray(runs[n][0]["a"])) for n in names]
    args = [(*(jnp.asarray(x) for x in _fused_args(runs[n][0], runs[n][1])),
             jnp.asarray(runs[n][0]["g"])) for n in names]

    def all_runs(tables, args):
        return [row_wise_adagrad_fused(*t, *a, lr=LR, eps=EPS, interpret=True, **runs[n][2])
                for n, t, a in zip(names, tables, args)]
    outs = jax.jit(all_runs, donate_argnums=0)(tables, args)   # the tables, as _run
    return {n: (runs[n][0], o) for n, o in zip(names, outs)}


@pytest.mark.parametrize("dim", [16, 64, 128])
def test_fused_matches_float64(dim, interpreted):
    # duplicates (n > vocab / 2), ids 0 and V-1, invalid tail, unused programs past U
    c, out = interpreted[f"dim{dim}"]
    _assert_matches(c, *out)


def test_hot_row_split_into_items(interpreted):
    # one row 5,000 times: > split, so it goes through the partials pass (5 items)
    c, out = interpreted["hot"]
    assert np.sum(c["ids"] == 400 // 3) >= 5000
    _assert_matches(c, *out)


@pytest.mark.parametrize("name", list(TIER_KNOBS))
def test_short_medium_and_hot_runs(name, interpreted):
    """Run lengths 1..~600 (Zipf ids) plus a 2,000-id hot row: with short=4, split=32
    every tier runs (R rows per program, one row per program, items + partials)."""
    c, out = interpreted[name]
    seg = c["seg"][c["key"][c["perm"]] != routing.INVALID]
    lengths = np.bincount(seg)
    assert lengths.max() > 32 and np.any((lengths > 4) & (lengths <= 32)) and np.any(lengths == 1)
    _assert_matches(c, *out)


def test_looped_short_rows_at_k_n(interpreted):
    """short_programs with the static bound K = N (every id slot, most of them -1 past
    the unique count): the looped programs stop at the last slot in use."""
    for p in (1, 7):
        c, out = interpreted[f"k_n_{p}"]
        _assert_matches(c, *out)


def test_bad_tier_knobs_are_named():
    c = _case(0, vocab=50, dim=16, n=40)
    with pytest.raises(ValueError, match="short_programs"):
        _run(c, 40, interpret=True, short_programs=-1)
    with pytest.raises(ValueError, match="short must be"):
        _run(c, 40, interpret=True, short=2000)
    with pytest.raises(ValueError, match="rows_per_program"):
        _run(c, 40, interpret=True, rows_per_program=12)


def test_empty_segments_and_unordered_rows():
    # rows with no ids keep their values; rows need not be ascending
    rng = np.random.default_rng(3)
    vocab, dim = 64, 16
    seg = np.sort(rng.choice([0, 1, 3, 4, 6], 90)).astype(np.int32)     # 2, 5, 7 empty
    rows = np.array([9, 0, 5, 63, 20, 31, 2, 40], np.int32)
    index = rng.integers(0, 30, 90).astype(np.int32)
    g = (rng.integers(-256, 257, (30, dim)) / 256).astype(np.float32)
    w = rng.standard_normal((vocab, dim)).astype(np.float32)
    a = rng.random(vocab).astype(np.float32)
    args = [jnp.asarray(x) for x in (w, a, rows, seg, index, g)]
    out, ref = jax.jit(lambda *x: (   # one program: the kernel and the reference
        row_wise_adagrad_fused(*x, lr=LR, eps=EPS, interpret=True, block_ids=16, split=16),
        row_wise_adagrad_reference(*x, lr=LR, eps=EPS)))(*args)
    ids = rows[seg]
    c = dict(ids=ids, key=ids, src_index=index, g=g, w=w, a=a)
    _assert_matches(c, *out)
    assert not np.isin(rows[[2, 5, 7]], ids).any()
    np.testing.assert_allclose(np.asarray(out[0]), np.asarray(ref[0]), rtol=1e-6, atol=1e-6)
    _assert_matches(c, *ref)


def test_row_wise_adagrad_picks_the_impl():
    """kernels.sparse_update.row_wise_adagrad: "pallas" runs the kernel (interpret mode
    here), None and "reference" the jnp reference; both match float64 numpy; a bad impl
    or kernel knobs on the reference are named."""
    c = _case(6, vocab=200, dim=16, n=300, n_src=40, invalid=3)
    u = int(np.sum(c["uniq"] != routing.INVALID))
    args = [jnp.asarray(x) for x in (c["w"], c["a"], *_fused_args(c, u + 4), c["g"])]
    impls = (None, "reference", "pallas")      # one compiled program for all, not op by op
    outs = jax.jit(lambda *a: [row_wise_adagrad(*a, lr=LR, eps=EPS, impl=impl)
                               for impl in impls])(*args)
    for impl, out in zip(impls, outs):
        _assert_matches(c, *out)
    with pytest.raises(ValueError, match="impl"):
        row_wise_adagrad(*args, lr=LR, eps=EPS, impl="mosaic")
    with pytest.raises(ValueError, match="split"):
        row_wise_adagrad(*args, lr=LR, eps=EPS, split=64)


def test_run_bounds_with_gaps_and_tail():
    rng = np.random.default_rng(4)
    for n, k in [(1, 1), (50, 8), (200, 40)]:
        seg = np.sort(rng.integers(0, k + 3, n)).astype(np.int32)    # gaps, values >= k
        starts, ends = (np.asarray(x) for x in jax.jit(run_bounds, static_argnums=1)(seg, k))
        for u in range(k):
            at = np.nonzero(seg == u)[0]
            want = (at[0], at[-1] + 1) if at.size else (0, 0)
            assert (starts[u], ends[u]) == want, (n, k, u)


def test_routing_pallas_equals_xla_path():
    # the collection's local path (bucketed, pooled src_index) and the owner's
    # update_rows (unsorted rows with duplicates and -1 slots), both impls
    opt = RowWiseAdagrad(lr=LR, eps=EPS)
    c = _case(2, vocab=500, dim=16, n=600, n_src=50, invalid=7)
    state = {"weights": jnp.asarray(c["w"]), "accum": jnp.asarray(c["a"])}
    res = {"uniq": jnp.asarray(c["uniq"]), "perm": jnp.asarray(c["perm"]),
           "seg": jnp.asarray(c["seg"])}
    g, src = jnp.asarray(c["g"]), jnp.asarray(c["src_index"])
    rows = jnp.asarray(np.where(c["key"] != routing.INVALID, c["ids"], -1))
    grads = jnp.asarray(c["g"][c["src_index"]])

    def all_paths(s):   # both paths, both impls: one compiled program
        return ([routing.update_unique_bucketed(s, g, res, opt, (0.5,), src_index=src,
                                                update_impl=impl) for impl in routing.UPDATE_IMPLS],
                [routing.update_rows(s, rows, grads, opt, update_impl=impl)
                 for impl in routing.UPDATE_IMPLS])
    bucketed, by_rows = jax.jit(all_paths)(state)
    assert len(bucketed) == len(by_rows) == len(routing.UPDATE_IMPLS) >= 2
    for out in bucketed + by_rows:
        _assert_matches(c, out["weights"], out["accum"])


def test_bad_inputs_name_the_input():
    w, a = jnp.zeros((8, 24)), jnp.zeros((8,))
    i = jnp.zeros((4,), jnp.int32)
    with pytest.raises(ValueError, match="D=24"):
        row_wise_adagrad_fused(w, a, i, i, i, jnp.zeros((4, 24)), lr=LR, eps=EPS)
    with pytest.raises(ValueError, match="accum"):
        row_wise_adagrad_fused(jnp.zeros((8, 16)), a.astype(jnp.bfloat16), i, i, i,
                               jnp.zeros((4, 16)), lr=LR, eps=EPS)
    with pytest.raises(ValueError, match="block_ids"):
        row_wise_adagrad_fused(jnp.zeros((8, 16)), a, i, i, i, jnp.zeros((4, 16)), lr=LR,
                               eps=EPS, block_ids=8)
    state = {"weights": jnp.zeros((8, 16)), "accum": a}
    with pytest.raises(ValueError, match="RowWiseAdagrad"):
        from gemjax.sparse.optimizers import SGD
        routing.update_rows({"weights": state["weights"]}, i, jnp.zeros((4, 16)), SGD(),
                            update_impl="pallas")
    with pytest.raises(ValueError, match="update_impl"):
        routing.update_rows(state, i, jnp.zeros((4, 16)), RowWiseAdagrad(), update_impl="cuda")


# ----------------------------------------------------------------------------- sm_90 lowering

try:
    import jax._src.pallas.triton.pallas_call_registration as _reg
except ImportError:  # pragma: no cover
    _reg = None


@pytest.mark.parametrize("dim,short,programs", [(16, 16, 0), (128, 16, 0), (128, 0, 0),
                                                (128, 16, 2112)])
def test_lowers_to_verified_triton_sm90(monkeypatch, dim, short, programs):
    if _reg is None or not hasattr(_reg, "lowering"):
        pytest.skip("JAX internals for the Triton lowering moved")
    lower = _reg.lowering.lower_jaxpr_to_triton_module
    names = []

    def verified(*args, **kwargs):
        out = lower(*args, **kwargs)
        assert out.module.operation.verify(), "Triton module does not verify"
        names.append(str(out.module.operation).count("tt.load"))
        return out

    monkeypatch.setattr(_reg.lowering, "lower_jaxpr_to_triton_module", verified)
    monkeypatch.setattr(_reg.gpu_info_lib, "get_gpu_info",
                        lambda: types.SimpleNamespace(compute_capability=90))
    # a 1e8-row table: > 4 GiB, so the row offsets must be 64-bit
    v, d, n = 100_000_000, dim, 5000
    sds = jax.ShapeDtypeStruct
    fn = lambda w, a, r, s, i, g: row_wise_adagrad_fused(w, a, r, s, i, g, lr=LR, eps=EPS,
                                                          interpret=False, short=short,
                                                          short_programs=programs)
    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    exp = export.export(jax.jit(fn, donate_argnums=(0, 1)), platforms=["cuda"],
                        disabled_checks=checks)(
        sds((v, d), jnp.float32), sds((v,), jnp.float32), sds((n,), jnp.int32),
        sds((n,), jnp.int32), sds((n,), jnp.int32), sds((n // 20, d), jnp.float32))
    # short rows R per program (short > 0), rows one per program, item sums, hot rows
    launches = 4 if short else 3
    assert len(names) == launches
    assert all(k > 0 for k in names)
    assert exp.mlir_module().count("__gpu$xla.gpu.triton") == launches
    # the glue around the kernels has no XLA while loop (a binary search's default
    # lowering, which XLA:GPU steps from the host)
    assert while_functions(exp.mlir_module()) == []


# ----------------------------------------------------------------------------- GPU (compiled)

@pytest.mark.gpu
@pytest.mark.parametrize("dim", [16, 64, 128])
def test_gpu_fused_matches_float64(dim):
    c = _case(10, vocab=200_000, dim=dim, n=120_000, hot=20_000, n_src=6000, invalid=100)
    u = int(np.sum(c["uniq"] != routing.INVALID))
    _assert_matches(c, *_run(c, u + 100, interpret=False))


@pytest.mark.gpu
@pytest.mark.parametrize("knobs", [dict(), dict(short_programs=2112),
                                   dict(block_ids=16, split=64, num_warps=1),
                                   dict(block_ids=64, split=4096, num_warps=8)])
def test_gpu_zipf_head_rows(knobs):
    # Zipf 1.05 as in the bench: the head row takes ~8% of the ids (hot-row path)
    c = _case(11, vocab=300_000, dim=128, n=400_000, n_src=20_000, zipf=1.05)
    _assert_matches(c, *_run(c, c["ids"].size, interpret=False, **knobs))


@pytest.mark.parametrize("devices,fused", [(1, "pallas"), (4, "pallas_looped")])
def test_collection_update_impl_pallas_equals_xla(devices, fused):
    """EmbeddingCollection(update_impl="pallas") gives the same tables as "xla" after 2 steps
    (a row-wise Adagrad table through the kernel, an SGD table falling back to xla); on
    one device with the default knobs, sharded over 4 with fused_knobs (short_programs)
    passed to the kernel (the kernel's knobs themselves: the interpret tests above)."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from gemjax.sparse import SGD, EmbeddingCollection, TableSpec
    mesh = Mesh(np.array(jax.devices()[:devices]), ("x",))
    specs = [TableSpec("a", 97, 16, features=("fa",), optimizer=RowWiseAdagrad(lr=LR, eps=EPS)),
             TableSpec("b", 50, 16, features=("fb",), optimizer=SGD(lr=0.5))]
    sh = NamedSharding(mesh, P("x"))
    rng = np.random.default_rng(3)
    w = {n: (rng.integers(-64, 65, (v, 16)) / 256.0) for n, v in (("a", 97), ("b", 50))}
    out = {}
    for impl in ("xla", fused):
        kw = dict(fused_knobs=dict(short_programs=2)) if impl == "pallas_looped" else {}
        coll = EmbeddingCollection(specs, "row_wise", mesh, update_impl=impl.split("_")[0], **kw)
        assert coll._update_impl(specs[1]) == "xla"
        state = coll.from_logical({"a": {"weights": w["a"], "accum": np.zeros(97)},
                                   "b": {"weights": w["b"]}})
        r = np.random.default_rng(5)
        lookup, apply = jax.jit(coll.lookup), jax.jit(coll.apply_gradients)   # traced once, both steps
        for _ in range(2):
            ids = {"fa": r.integers(0, 97, 64).astype(np.int32), "fb": r.integers(0, 50, 64).astype(np.int32)}
            ids["fa"][:20] = 7                                   # a hot row
            acts, res = lookup(state, {f: jax.device_put(i, sh) for f, i in ids.items()})
            g = {f: jax.device_put((r.integers(-8, 9, (64, 16)) / 64.0).astype(np.float32), sh) for f in ids}
            state = apply(state, res, g)
        out[impl] = coll.to_logical(state)
    for t in ("a", "b"):
        for k in out["xla"][t]:
            np.testing.assert_allclose(out[fused][t][k], out["xla"][t][k], rtol=1e-6,
                                       atol=1e-7, err_msg=f"{fused} {t}.{k}")
    assert not np.allclose(out["xla"]["a"]["weights"], w["a"])          # the step did update
    with pytest.raises(ValueError, match="update_impl"):
        EmbeddingCollection(specs, "row_wise", mesh, update_impl="cuda")
    with pytest.raises(ValueError, match="fused_knobs: unknown knobs"):
        EmbeddingCollection(specs, "row_wise", mesh, update_impl="pallas",
                            fused_knobs=dict(short_progs=2))


def test_trainer_with_the_fused_update_equals_xla():
    """train.sparse_update_impl=pallas (interpret mode here) trains the tiny config's
    tables (sequence and pooled features) like the XLA update: 2 steps, tables and loss
    within float32 rounding. The model is the logistic regression (the trainer's sparse
    update is the same for every model; its dense program is the cheapest to compile),
    with 4 surfaces x 4 tasks: S*K = 16 weights per id, the kernel's narrowest row."""
    from gemjax.config import get_config
    from gemjax.train.equivalence import max_rel_diff, train_steps
    from gemjax.train.step import Trainer
    over = "model.kind=lr,data.num_surfaces=4,data.num_tasks=4,data.batch_size=16"
    coll = Trainer.create(get_config("tiny", over + ",train.sparse_update_impl=pallas")).coll
    assert {coll._update_impl(s) for s in coll.specs.values()} == {"pallas"}   # every table fused
    # train steps only: the eval step has no sparse update to compare
    xla = train_steps(None, 2, overrides=over, evaluate=False)
    fused = train_steps(None, 2, overrides=over + ",train.sparse_update_impl=pallas",
                        tables0=xla["init_tables"], evaluate=False)
    assert max_rel_diff(xla["init_tables"], xla["tables"]) > 1e-3      # rows really moved
    np.testing.assert_allclose(fused["losses"], xla["losses"], rtol=1e-6)
    assert max_rel_diff(fused["tables"], xla["tables"]) < 1e-5
    with pytest.raises(ValueError, match="sparse_update_impl"):
        get_config("tiny", "train.sparse_update_impl=triton")
