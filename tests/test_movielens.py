"""experiments/movielens.py: sampled softmax against float64 numpy, the user tower's
learned positions and l2 norm, history exclusion, and the whole protocol on a tiny
synthetic catalogue (every recipe flag, both selection modes)."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gemjax.data.jagged import pack
from gemjax.data.movielens import MovieLens, exclude_history, leave_last_out, ranking_metrics
from experiments import movielens as mlx
from experiments import movielens_table


def tiny_movielens(users=12, items=30, seed=0):
    """Random histories of 3..9 distinct items over ids 1..items (id 5 never occurs)."""
    rng = np.random.default_rng(seed)
    ids = np.array([i for i in range(1, items + 1) if i != 5])
    hist, test = [], []
    for _ in range(users):
        seq = rng.choice(ids, size=int(rng.integers(4, 11)), replace=False)
        hist.append(seq[:-1].astype(np.int64))
        test.append(int(seq[-1]))
    present = np.zeros(items + 1, bool)
    present[ids] = True
    genre = np.where(present, 100 + np.arange(items + 1) % 4, 0)
    return MovieLens(hist, np.asarray(test), np.zeros((users, 3), np.int64), genre, present,
                     items)


def np_sampled_softmax(q, pos, neg, tid, nid, mask, temp):
    """float64 loop: per row -log(exp(q.pos/t) / (exp(q.pos/t) + sum_{n != target} exp(q.neg/t)))."""
    losses, grads = [], np.zeros_like(q)
    for t in np.flatnonzero(mask):
        keep = nid[t] != tid[t]
        cands = np.concatenate([pos[t][None], neg[t][keep]])           # [1 + K, d]
        z = cands @ q[t] / temp
        p = np.exp(z - z.max())
        p /= p.sum()
        losses.append(-np.log(p[0]))
        grads[t] = (p @ cands - cands[0]) / temp
    n = max(len(losses), 1)
    return sum(losses) / n, grads / n


def test_sampled_softmax_matches_float64_numpy_forward_and_backward():
    rng = np.random.default_rng(0)
    t, n, d, temp = 9, 6, 5, 0.3
    q, pos = rng.normal(size=(t, d)), rng.normal(size=(t, d))
    neg = rng.normal(size=(t, n, d))
    tid = rng.integers(1, 5, t)
    nid = rng.integers(1, 5, (t, n))                 # several negatives collide with the target
    nid[0] = tid[0]                                  # row 0: every negative is the target
    mask = np.ones(t, bool)
    mask[[3, 7]] = False
    want, want_g = np_sampled_softmax(q, pos, neg, tid, nid, mask, temp)
    f = lambda qq: mlx.sampled_softmax_loss(qq, jnp.asarray(pos, jnp.float32),
                                            jnp.asarray(neg, jnp.float32), jnp.asarray(tid),
                                            jnp.asarray(nid), jnp.asarray(mask), temp)
    got, got_g = jax.value_and_grad(f)(jnp.asarray(q, jnp.float32))
    np.testing.assert_allclose(float(got), want, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(got_g), want_g, rtol=1e-4, atol=1e-6)
    none = mlx.sampled_softmax_loss(jnp.asarray(q), jnp.asarray(pos), jnp.asarray(neg),
                                    jnp.asarray(tid), jnp.asarray(nid), jnp.zeros(t, bool))
    assert float(none) == 0.0                        # nothing masked in -> 0, not nan


def test_exclude_history_and_split_with_full_histories():
    scores = np.arange(12, dtype=np.float64).reshape(2, 6)
    out = exclude_history(scores, [np.array([1, 4]), np.array([], np.int64)])
    want = scores.copy()
    want[0, [1, 4]] = -np.inf
    np.testing.assert_array_equal(out, want)
    assert scores[0, 1] == 1.0                       # input untouched
    # excluding seen items can only raise a target's rank position (fewer items above it)
    m = ranking_metrics(out, np.array([2, 2]), ks=(3,))
    assert m["hr@3"] == pytest.approx(0.5)           # row 0: only 3, 5 above 2; row 1: 9, 10, 11
    with pytest.raises(ValueError, match="outside"):
        exclude_history(scores, [np.array([6]), np.array([0])])
    ml = tiny_movielens()
    s = leave_last_out(ml, max_len=4)
    for h, tr, full in zip(ml.histories, s["train"], s["train_full"]):
        np.testing.assert_array_equal(full, h)
        np.testing.assert_array_equal(tr, h[:-1])


def _tower(**kw):
    ml = tiny_movielens()
    r = mlx.Recipe(max_len=6, dim=8, layers=1, heads=1, batch_users=3, **kw)
    return mlx.UserTower(r, ml.item_genre, ml.item_present, rngs=nnx.Rngs(0)), r


def test_learned_positions_shape_isolation_and_window_start():
    model, r = _tower(positions="learned", dropout=0.0)
    model.eval()
    assert model.pos.embedding[...].shape == (r.max_len, r.dim)
    assert _tower(positions="rope")[0].pos is None
    a, b, c = np.array([3, 7, 9]), np.array([2, 4]), np.array([8, 1, 6, 10])
    fwd = nnx.jit(lambda m, jag: m(jnp.asarray(jag.values), jag))
    run = lambda seqs: np.asarray(fwd(model, pack(seqs, capacity=16)))
    base = run([a, b, c])
    assert base.shape == (16, r.dim) and np.all(base[9:] == 0)
    other = run([a, np.array([11, 12]), c])          # change sample 1 only
    np.testing.assert_allclose(other[:3], base[:3], rtol=1e-6)
    np.testing.assert_allclose(other[5:9], base[5:9], rtol=1e-6)
    assert not np.allclose(other[3:5], base[3:5])
    moved = run([c, a])                              # positions count from each sample's start
    np.testing.assert_allclose(moved[4:7], base[:3], rtol=1e-5, atol=1e-6)
    # the learned table matters: zeroing it changes the tokens after the first
    model.pos.embedding[...] = jnp.zeros_like(model.pos.embedding[...])
    assert not np.allclose(run([a, b, c])[:3], base[:3])


def test_l2norm_unit_vectors_and_temperature_scaled_scores():
    model, r = _tower(l2norm=True, temperature=0.25, dropout=0.0)
    model.eval()
    seqs = [np.array([3, 7, 9]), np.array([2, 4])]
    jag = pack(seqs, capacity=8)
    h = np.asarray(model(jnp.asarray(jag.values), jag))
    np.testing.assert_allclose(np.linalg.norm(h[:5], axis=1), 1.0, rtol=1e-5)
    assert np.all(h[5:] == 0)
    e = np.asarray(model.item.embedding[...], np.float64)
    s = np.asarray(model.scores(jnp.asarray(h[:5])), np.float64)
    want = (h[:5] @ (e / np.linalg.norm(e, axis=1, keepdims=True)).T) / 0.25
    present = np.asarray(model.present[...])
    np.testing.assert_allclose(s[:, present], want[:, present], rtol=1e-4, atol=1e-4)
    assert np.all(np.isneginf(s[:, ~present]))
    with pytest.raises(ValueError, match="temperature"):
        mlx.Recipe(temperature=0.0)


@pytest.mark.parametrize("kw", [
    dict(positions="learned", l2norm=True, loss="sampled", negatives=4, block_dropout=0.2,
         final_norm=False, select="valid", adam_b2=0.98),
    dict(positions="rope", loss="full", select="fixed", genre=False),
])
def test_protocol_runs_every_flag(kw):
    ml = tiny_movielens(users=7)
    r = mlx.Recipe(max_len=5, dim=16, layers=1, heads=1, batch_users=4, epochs=2, eval_every=1,
                   patience=1, **kw)
    res = mlx.run(r, ml, users=7, log=lambda *a, **k: None)
    for key in ("test", "test_unmasked"):
        assert set(res[key]) == {"hr@10", "ndcg@10", "hr@50", "ndcg@50"}
        assert all(0.0 <= v <= 1.0 for v in res[key].values())
    if kw["select"] == "valid":
        assert res["test_from"] == "refit" and res["protocol"]["refit"]
        assert res["refit_phase"]["epochs"] == res["epochs_picked"] == \
            res["select_phase"]["best_epoch"]
        assert "test_early_stopped" in res
    else:
        assert res["test_from"] == "fixed" and res["epochs_picked"] == 2
    phase = res.get("refit_phase") or res["fixed_phase"]
    assert all(np.isfinite(h["loss"]) for h in phase["history"])
    # 29 present items: with masking, hr@50 counts every target (all rank below 50)
    assert res["test"]["hr@50"] == 1.0


def test_summary_table_reads_results_and_flags_broken_files(tmp_path):
    tbl = movielens_table
    res = {"test": {"hr@10": 0.3125, "ndcg@10": 0.1875, "hr@50": 0.5625, "ndcg@50": 0.25},
           "test_unmasked": {"hr@10": 0.2813}, "test_from": "refit", "epochs_picked": 35,
           "test_early_stopped": {"hr@10": 0.2969}, "wall_s": 321.0,
           "select_phase": {"epoch_s": [9.0, 1.0, 3.0]}, "refit_phase": {"epoch_s": [5.0, 2.0]}}
    (tmp_path / "ml1m_good.json").write_text(json.dumps(res))
    (tmp_path / "ml1m_bad.json").write_text("{")
    out = tbl.table(tbl.rows(sorted(str(p) for p in tmp_path.glob("ml1m_*.json"))))
    good = next(l for l in out.splitlines() if l.startswith("good"))
    assert good.split() == ["good", "refit", "35", "0.3125", "0.1875", "0.5625", "0.2500",
                            "0.2813", "0.2969", "2.00", "321"]   # s/ep: mean of 1, 3, 2
    assert "bad" in out and "no result" in out
