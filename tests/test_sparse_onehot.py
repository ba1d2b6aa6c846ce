"""One-hot duplicate sums (routing.onehot_sums, onehot_rows=) against the sorted segment sum.

Routing level: random grads (bfloat16 / float32, one array or a tuple of sources with
the zero row last), ids with duplicates and padding, segment counts K that cut off
some unique ids, missing features reading the zero row, source rows nobody reads;
both residuals (sort, scatter). The one-hot sums equal the sorted path's and a float64
numpy reference; NaN / +-Inf stay in their own segment. Collection level: an
unpooled table takes the one-hot path (a dot_general in its program), a pooled one
does not (bitwise the same update). The tiny trainer's losses with
train.sparse_onehot_rows=128 match the default's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh

from gemjax.sparse import routing

INVALID = int(routing.INVALID)
N, D = 96, 16


def _case(rng, dtype, n_sources, vocab):
    """(key [N], sources (tuple of [M_j, D] in dtype, zero row last), src_index [N]).

    Each position reads its own source row (unpooled) except missing-feature positions,
    which read the zero row; some source rows are read by nobody (nonzero values)."""
    key = rng.integers(0, vocab, N).astype(np.int32)
    key[rng.random(N) < 0.15] = INVALID                               # padding ids
    m = N + 7                                                         # 7 rows nobody reads
    rows = rng.permutation(m)[:N].astype(np.int32)
    rows[rng.random(N) < 0.1] = m                                     # missing feature: zero row
    g = rng.normal(size=(m, D)).astype(dtype)
    cuts = np.sort(rng.choice(np.arange(1, m), n_sources - 1, replace=False))
    parts = tuple(np.split(g, cuts)) + (np.zeros((1, D), dtype),)
    return key, parts, rows


def _reference(key, parts, rows, k):
    """float64 sums per unique id (ascending), first k."""
    g = np.concatenate([p.astype(np.float64) for p in parts])[rows]
    uniq = np.unique(key)
    out = np.zeros((k, D))
    for s, u in enumerate(uniq[:k]):
        out[s] = g[key == u].sum(0)
    return out


def _sums(parts, key, rows, k, onehot_rows, dedup="sort", as_tuple=True, with_jaxpr=False):
    """(sums with onehot_rows, sums with 0 (the sorted path), jaxpr of the first or None)."""
    g = tuple(map(jnp.asarray, parts)) if as_tuple else jnp.concatenate(parts)

    def f(g, key, rows, onehot_rows):
        _, res = routing.dedup_ids(key, dedup)
        return routing.sum_duplicates(g, res, k, src_index=rows, segment_sum="xla",
                                      onehot_rows=onehot_rows)
    jaxpr = str(jax.make_jaxpr(f, static_argnums=3)(g, key, rows, onehot_rows)) if with_jaxpr else None
    both = jax.jit(lambda g, key, rows: (f(g, key, rows, onehot_rows), f(g, key, rows, 0)))
    got, base = both(g, key, rows)
    return np.asarray(got), np.asarray(base), jaxpr


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float32])
def test_onehot_sums_match_sorted_path_and_numpy(dtype):
    rng = np.random.default_rng(0)
    cut = []
    for k, n_sources, vocab, dedup, as_tuple in (
            (1, 1, 3, "sort", True), (4, 3, 9, "sort", True), (64, 3, 40, "sort", False),
            (64, 1, 200, "scatter", False), (4, 3, 30, "scatter", True)):
        key, parts, rows = _case(rng, dtype, n_sources, vocab)
        want = _reference(key, parts, rows, k)
        got, base, jaxpr = _sums(parts, key, rows, k, 128, dedup, as_tuple, with_jaxpr=True)
        assert "dot_general" in jaxpr                                     # the one-hot path ran
        assert got.dtype == np.float32 and got.shape == (k, D)
        # bfloat16 / float32 products with the one-hot are exact: only the float32
        # summation order differs
        np.testing.assert_allclose(got, base, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        cut.append(len(np.unique(key[key != INVALID])) > k)
    assert cut == [True, True, False, True, True]      # valid unique ids past K: cut off
    # K above onehot_rows: the sorted path, the same bits
    key, parts, rows = _case(rng, dtype, 3, 40)
    got, base, jaxpr = _sums(parts, key, rows, 64, 63, with_jaxpr=True)
    assert "dot_general" not in jaxpr
    np.testing.assert_array_equal(got, base)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_grad_stays_in_its_segment(bad):
    rng = np.random.default_rng(1)
    k = 8
    key, parts, rows = _case(rng, np.float32, 3, 12)
    _, res = routing.dedup_ids(jnp.asarray(key), "sort")
    seg = np.asarray(routing.inverse(res))
    m = sum(p.shape[0] for p in parts) - 1
    p = int(np.flatnonzero((key != INVALID) & (rows < m) & (seg < k))[0])
    g = np.concatenate(parts)
    g[rows[p], 5] = bad
    src = (g[:40], g[40:-1], g[-1:])
    got, base, _ = _sums(src, key, rows, k, 128)
    np.testing.assert_array_equal(got, base)                          # NaN == NaN here
    bad_at = np.argwhere(~np.isfinite(got))
    assert bad_at.tolist() == [[seg[p], 5]]
    if not np.isnan(bad):
        assert got[seg[p], 5] == bad
    # a non-finite value in a row nobody reads changes nothing (the sorted path's sums)
    unread = np.setdiff1d(np.arange(m), rows)[0]
    g2 = np.concatenate(parts)
    g2[unread, 3] = bad
    got2, _, _ = _sums((g2[:40], g2[40:-1], g2[-1:]), key, rows, k, 128)
    _, want, _ = _sums(parts, key, rows, k, 128)
    np.testing.assert_array_equal(got2, want)
    assert np.isfinite(got2).all()


def test_onehot_result_is_the_matmul_and_fallback_is_the_sorted_path(monkeypatch):
    """With the sorted path replaced by a marker: finite grads give the one-hot sums (the
    marker never shows), a non-finite grad gives the marker (the fallback ran)."""
    rng = np.random.default_rng(2)
    k = 4
    key, parts, rows = _case(rng, np.float32, 3, 9)
    marker = lambda g, idx, seg, num_segments, impl=None: jnp.full((num_segments, D), 7.0)  # noqa: E731
    monkeypatch.setattr(routing, "sorted_segment_sum", marker)
    got, _, _ = _sums(parts, key, rows, k, 128)
    np.testing.assert_allclose(got, _reference(key, parts, rows, k), rtol=1e-5, atol=1e-5)
    g = np.concatenate(parts)
    g[rows[np.flatnonzero(rows < g.shape[0] - 1)[0]], 0] = np.inf
    got, _, _ = _sums((g,), key, rows, k, 128)
    np.testing.assert_array_equal(got, np.full((k, D), 7.0, np.float32))


def test_onehot_rows_must_be_a_non_negative_int():
    from gemjax.config import get_config
    from gemjax.sparse import EmbeddingCollection, TableSpec
    for bad in (-1, 1.5, True, "8"):
        with pytest.raises(ValueError, match="onehot_rows"):
            routing.check_onehot_rows(bad)
    with pytest.raises(ValueError, match="onehot_rows"):
        EmbeddingCollection([TableSpec("a", 8, 4, features=("a",))], onehot_rows=-3)
    with pytest.raises(ValueError, match="sparse.onehot_rows"):
        get_config("tiny", "train.sparse_onehot_rows=-1")
    assert get_config("tiny").sparse.onehot_rows == 0                # off by default


def test_collection_onehot_equals_sorted_and_skips_pooled_tables():
    """apply_gradients with onehot_rows=128 vs 0 on one device: the unpooled table (one
    feature without gradient: the zero row) gets the same update up to float32 summation
    order through a one-hot matmul; the pooled table keeps the sorted sum (same bits)."""
    from gemjax.data.jagged import pack
    from gemjax.sparse import EmbeddingCollection, RowWiseAdagrad, TableSpec
    mesh = Mesh(np.array(jax.devices()[:1]), ("batch",))
    opt = RowWiseAdagrad(lr=0.1, eps=1e-3)
    specs = [TableSpec("small", 64, 16, features=("fa", "fb"), optimizer=opt),
             TableSpec("bag", 50, 16, features=("fp",), pooling="sum", optimizer=opt)]
    rng = np.random.default_rng(3)
    logical = {s.name: {"weights": rng.normal(size=(s.vocab, 16)).astype(np.float32),
                        "accum": np.zeros(s.vocab, np.float32)} for s in specs}
    feats = {"fa": jnp.asarray(rng.integers(0, 64, (32, 3)), jnp.int32),
             "fb": jnp.asarray(rng.integers(0, 64, 16), jnp.int32),
             "fp": pack([rng.integers(0, 50, n).astype(np.int32) for n in (0, 3, 5, 1, 7, 2)],
                        capacity=32)}
    feats["fp"] = jax.tree.map(jnp.asarray, feats["fp"])
    g = {"fa": jnp.asarray(rng.normal(size=(32, 3, 16)), jnp.float32),
         "fp": jnp.asarray(rng.normal(size=(6, 16)), jnp.float32)}    # fb: no gradient
    out, jaxprs = {}, {}
    for rows in (0, 128):
        coll = EmbeddingCollection(specs, None, mesh, onehot_rows=rows)
        state = coll.from_logical(logical)
        _, res = jax.jit(coll.lookup)(state, feats)
        jaxprs[rows] = str(jax.make_jaxpr(coll.apply_gradients)(state, res, g))
        out[rows] = coll.to_logical(jax.jit(coll.apply_gradients)(state, res, g))
        if rows:   # the pooled table alone: no one-hot matmul in its update
            alone = {"fp": g["fp"]}
            assert "dot_general" not in str(jax.make_jaxpr(coll.apply_gradients)(state, res, alone))
            only = {"fa": g["fa"]}
            assert "dot_general" in str(jax.make_jaxpr(coll.apply_gradients)(state, res, only))
    assert "dot_general" in jaxprs[128] and "dot_general" not in jaxprs[0]
    for name in ("weights", "accum"):
        np.testing.assert_allclose(out[128]["small"][name], out[0]["small"][name],
                                   rtol=1e-6, atol=1e-6, err_msg=name)
        np.testing.assert_array_equal(out[128]["bag"][name], out[0]["bag"][name], err_msg=name)
    assert not np.allclose(out[0]["small"]["weights"], logical["small"]["weights"])  # updated
    assert not np.allclose(out[0]["bag"]["weights"], logical["bag"]["weights"])


def test_tiny_trainer_loss_matches(monkeypatch):
    """Two tiny train steps on one device with train.sparse_onehot_rows=128 (sequences off:
    half the compile time; the collection test covers multi-feature tables): the one-hot
    sums are in the step (tiny's small tables are unpooled) and the losses match the
    default's."""
    from gemjax.config import get_config
    from gemjax.data.feeding import Feeder
    from gemjax.data.synthetic import SyntheticStream
    from gemjax.train.step import Trainer
    mesh = Mesh(np.array(jax.devices()[:1]), ("batch",))
    losses, init, used = {}, None, []
    onehot_sums = routing.onehot_sums

    def counted(g, res, k, *a, **kw):
        used.append(k)
        return onehot_sums(g, res, k, *a, **kw)
    monkeypatch.setattr(routing, "onehot_sums", counted)
    for rows in (0, 128):
        cfg = get_config("tiny", f"model.use_sequences=false,train.sparse_onehot_rows={rows}")
        trainer = Trainer.create(cfg, mesh)
        assert trainer.coll.onehot_rows == rows
        if init is None:                   # the same initial state (onehot_rows is not in it)
            init = trainer.init_state(0)
        feeder = Feeder(SyntheticStream(cfg.data, 0).shard_batch, trainer.mesh)
        step = trainer.make_train_step()
        state, losses[rows] = jax.tree.map(jnp.copy, init), []      # the step donates it
        for i in range(2):
            batch = feeder.to_device(feeder.host_batch(i)[0])
            state, m = step(state, batch)
            losses[rows].append(float(m["loss"]))
        # traced once per bucket branch of each small unpooled table, and only when on
        assert bool(used) == bool(rows) and all(0 < k <= 128 for k in used), used
        used.clear()
    assert np.all(np.isfinite(losses[0]))
    np.testing.assert_allclose(losses[128], losses[0], rtol=1e-5)
