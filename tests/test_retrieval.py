"""Next-item retrieval through the trainer (gemjax.train.retrieval, preset
movielens_retrieval): the per-token targets, the sampled-softmax loss and the full-ranking
ranks against numpy; the evaluator against a numpy recomputation from the table rows; a
resumed run of the preset (sampled negatives, dropout) on a small fake MovieLens equal to
the uninterrupted one."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

from gemjax.config import apply_overrides, get_config
from gemjax.features import FeatureSchema
from gemjax.data.jagged import pack
from gemjax.data.movielens import exclude_history
from gemjax.train.ranking import ranking_metrics, ranking_summary, target_ranks
from gemjax.train.retrieval_loss import history_mask, next_item_targets, sampled_softmax
from tests.test_converters import write_ml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_next_item_targets_shift_each_history_and_end_on_the_candidate():
    hist = [np.array([5, 6, 7]), np.array([], np.int32), np.array([9]), np.array([3, 4])]
    jag = pack(hist, capacity=16)
    cand = jnp.array([11, 12, 13, 14])
    got = np.asarray(next_item_targets(jag, jnp.asarray(jag.values), cand))
    n = int(jag.offsets[-1])
    assert got[:n].tolist() == [6, 7, 11, 13, 4, 14]
    # per-token vectors follow the same rule (the rows the loss scores as targets)
    vec = jnp.asarray(jag.values, jnp.float32)[:, None] * jnp.ones((1, 3))
    got_v = np.asarray(next_item_targets(jag, vec, cand.astype(jnp.float32)[:, None] * jnp.ones((1, 3))))
    assert np.array_equal(got_v[:n, 0], got[:n]) and np.all(got_v[:n] == got_v[:n, :1])


def test_sampled_softmax_matches_numpy_with_target_and_padding_negatives_dropped():
    rng = np.random.default_rng(0)
    t, n, d, tau = 6, 5, 4, 0.3
    h, te, ne = rng.normal(size=(t, d)), rng.normal(size=(t, d)), rng.normal(size=(n, d))
    tid = np.array([3, 1, 4, 4, 2, 9])
    nid = np.array([4, 0, 7, 3, 4])                  # holds targets 3 and 4 (twice) and padding 0
    got = np.asarray(sampled_softmax(jnp.asarray(h), jnp.asarray(te), jnp.asarray(tid),
                                     jnp.asarray(ne), jnp.asarray(nid), tau))
    want = []
    for i in range(t):
        logits = [h[i] @ te[i] / tau] + [h[i] @ ne[j] / tau for j in range(n)
                                         if nid[j] != tid[i] and nid[j] != 0]
        logits = np.array(logits)
        want.append(np.log(np.exp(logits).sum()) - logits[0])
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert got[0] != got[2]      # the rows drop different negatives


def test_ranks_with_history_excluded_and_ties_match_numpy():
    rng = np.random.default_rng(1)
    b, v = 7, 12
    scores = rng.integers(0, 4, size=(b, v)).astype(np.float32)   # many ties
    scores[:, 0] = -np.inf                                        # padding column
    hist = [rng.choice(np.arange(1, v), size=k, replace=False) for k in (0, 1, 3, 5, 2, 4, 6)]
    targets = np.array([rng.choice(np.setdiff1d(np.arange(1, v), h)) for h in hist])
    jag = pack([h.astype(np.int32) for h in hist], capacity=32)
    excl = history_mask(jag, jnp.asarray(jag.values), v)
    pad = jnp.zeros((b, v), bool).at[:, 0].set(True)
    masked = np.asarray(target_ranks(jnp.asarray(scores), jnp.asarray(targets), excl | pad))
    kept = np.asarray(target_ranks(jnp.asarray(scores), jnp.asarray(targets), pad))
    # reference: numpy ranks of the scores with the history columns at -inf (exclude_history)
    for ranks, s in ((masked, exclude_history(scores, hist)), (kept, scores)):
        ref = ranking_metrics(s, targets, ks=(1, 3, 10))
        got = ranking_summary(ranks, ks=(1, 3, 10))
        assert got == pytest.approx(ref), (got, ref)
        t = s[np.arange(b), targets]
        assert ranks.tolist() == [int(np.sum(row > x)) for row, x in zip(s, t)]
    assert (masked <= kept).all() and (masked < kept).any()


@pytest.fixture(scope="module")
def fake_retrieval(tmp_path_factory):
    """experiments/convert_movielens.py --tasks=retrieval --train_positions=1 on the fake
    MovieLens: (config of the movielens_retrieval preset on it, one transformer layer of
    width 8, retrieval dir)."""
    src, out = tmp_path_factory.mktemp("ml-1m"), tmp_path_factory.mktemp("conv")
    write_ml(src)
    r = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "convert_movielens.py"),
                        f"--out={out}", "--tasks=retrieval", "--train_positions=1",
                        f"--data_dir={src}"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    d = out / "retrieval"
    schema = FeatureSchema.from_dict(json.load(open(d / "schema.json")))
    cfg = dataclasses.replace(get_config("movielens_retrieval"), features=schema)
    cfg = apply_overrides(cfg, {
        "data.train_path": str(d / "train.parquet"), "data.eval_path": str(d / "test.parquet"),
        "data.batch_size": "4", "model.dim": "8", "model.seq_layers": "1",
        "train.tensorboard": "false"})
    return cfg, d


def test_evaluator_matches_a_numpy_ranking_of_the_table_rows(fake_retrieval):
    """Untrained state: the evaluator's HR / NDCG equal numpy's from the user vectors at
    each test row's last token scored against the item table (catalogue: the items of the
    files; history excluded, and kept)."""
    import pyarrow.parquet as pq

    from gemjax.data.parquet import sequence_column
    from gemjax.train.retrieval import RetrievalEvaluator, RetrievalTrainer
    cfg, d = fake_retrieval
    mesh = Mesh(np.array(jax.devices()[:1]), ("batch",))
    tr = RetrievalTrainer.create(cfg, mesh)
    state = tr.init_state(3)
    ev = RetrievalEvaluator(tr, cfg)
    got = ev(state)
    test = pq.read_table(d / "test.parquet").to_pydict()
    train = pq.read_table(d / "train.parquet").to_pydict()
    hist_col = sequence_column("history", "item")
    table = np.asarray(tr.coll.to_logical(state["tables"])["item"]["weights"])
    genre = np.asarray(tr.coll.to_logical(state["tables"])["genre"]["weights"])
    model = nnx.merge(tr.graphdef, state["params"])
    hists = [np.asarray(h, np.int32) for h in test[hist_col]]
    jag = pack(hists, capacity=128)
    gjag = pack([np.asarray(h, np.int32) for h in test[sequence_column("history", "genre")]],
                capacity=128)
    from gemjax.data.batch import Batch
    batch = Batch(sparse={}, dense=None, sequences={"history": jag}, labels=None,
                  label_mask=None, surface=None, weights=None)
    acts = {"history.item": jnp.asarray(table[jag.values]),
            "history.genre": jnp.asarray(genre[gjag.values])}
    # one jitted forward (eagerly, each of the tower's ops would compile on its own)
    h = np.asarray(jax.jit(lambda a, b: model(a, b))(acts, batch))[np.asarray(jag.offsets[1:]) - 1]
    scores = h @ table[:len(table)].T
    seen = set(test["item"]) | set(train["item"]) | {i for x in test[hist_col] + train[hist_col]
                                                     for i in x}
    off = np.array([i not in seen or i == 0 for i in range(scores.shape[1])])
    scores[:, off] = -np.inf
    targets = np.asarray(test["item"])
    want = ranking_metrics(exclude_history(scores, hists), targets)
    want_kept = ranking_metrics(scores, targets)
    assert got["rows"] == len(targets) and got["catalog"] == len(seen - {0})
    for k in ("hr@10", "ndcg@10", "hr@50"):
        assert got[k] == pytest.approx(want[k]), k
        assert got[f"{k}_unmasked"] == pytest.approx(want_kept[k]), k
    assert 0 < got["ndcg@10"] < 1


def test_retrieval_preset_resume_equals_the_uninterrupted_run(fake_retrieval, tmp_path):
    """The preset with sampled negatives and dropout on 2 devices: stopped after 3 steps
    and resumed, every logged loss, validation figure (HR@10 on the converter's
    valid.parquet, the preset's selection) and the test eval of the best step equal the
    uninterrupted run's."""
    from test_own_data import whole_and_resumed
    cfg, _ = fake_retrieval
    cfg = apply_overrides(cfg, {"model.retrieval_negatives": "6", "train.steps": "6",
                                "train.log_every": "1", "train.eval_every": "3",
                                "train.checkpoint_every": "3", "train.warmup_steps": "1"})
    mesh = Mesh(np.array(jax.devices()[:2]), ("batch",))
    whole, resumed, a, b = whole_and_resumed(cfg, tmp_path, mesh, stop_after=3)
    assert [r["kind"] for r in a].count("valid") == 2 and a == b
    losses = [r["loss"] for r in a if r["kind"] == "train"]
    assert len(losses) == 6 and all(np.isfinite(losses)) and len(set(losses)) == 6
    assert a[-1]["rows"] == 5 and a[-1]["kind"] == "eval" and a[-1]["split"] == "test"
    valid = [r for r in a if r["kind"] == "valid"]
    best = max(valid, key=lambda r: r["hr@10"])         # the first of equals: strictly better wins
    assert whole["selection"] == resumed["selection"]
    assert whole["selection"]["best_step"] == best["step"] == a[-1]["eval_step"]
    for k in ("eval_hr@10", "eval_ndcg@10", "eval_hr@50", "eval_hr@10_unmasked"):
        assert whole[k] == resumed[k] and 0 <= whole[k] <= 1, k
    assert whole["eval_ne"] is None and whole["model"] == "retrieval"
    # eval-only on the finished run (experiments/train.py --mode=eval) reproduces its test
    # eval: that of the best step (WORKDIR/best)
    from gemjax.serve.evaluate import evaluate_checkpoint
    row = evaluate_checkpoint(str(tmp_path / "whole"), None, mesh, log=lambda s: None)
    assert row["step"] == best["step"] and all(row[k] == a[-1][k] for k in (
        "hr@10", "ndcg@10", "hr@50", "hr@10_unmasked", "mrr", "rows"))


@pytest.fixture(scope="module")
def hstu_runs(fake_retrieval, tmp_path_factory):
    """run(preset, k) -> (summary, metrics.jsonl rows) of train() on the fake MovieLens, once
    per (preset, k): a movielens_hstu_large-derived preset (dropout 0.2, sampled negatives
    drawn per step) with small shapes, 8 steps of 4 rows (5 train rows: 2 steps an epoch),
    train.steps_per_call=k, train and validation rows every 4 steps, selection on
    validation HR@10, the best step tested. The K-steps test and the movielens_hstu_large
    case of the preset test share the k=1 run."""
    base, d = fake_retrieval
    root = tmp_path_factory.mktemp("hstu_runs")
    mesh = Mesh(np.array(jax.devices()[:1]), ("batch",))
    done = {}

    def run(preset, k):
        from gemjax.train.loop import train
        if (preset, k) not in done:
            cfg = dataclasses.replace(get_config(preset), features=base.features)
            cfg = apply_overrides(cfg, {
                "data.train_path": str(d / "train.parquet"),
                "data.eval_path": str(d / "test.parquet"),
                "data.valid_path": str(d / "valid.parquet"), "train.select_metric": "hr@10",
                "data.batch_size": "4", "model.dim": "8", "model.seq_layers": "1",
                "model.retrieval_negatives": "6", "train.steps": "8", "train.log_every": "4",
                "train.eval_every": "4", "train.valid_every": "4", "train.checkpoint_every": "4",
                "train.tensorboard": "false", "train.dense_lr": "1e-2",
                "train.steps_per_call": str(k)})
            wd = root / f"{preset}-k{k}"
            summary = train(cfg, str(wd), log=lambda s: None, mesh=mesh)
            done[preset, k] = cfg, summary, [json.loads(ln) for ln in open(wd / "metrics.jsonl")]
        return done[preset, k]

    return run


def test_k_steps_per_call_train_what_one_step_per_call_trains(hstu_runs):
    """movielens_hstu_large (dropout 0.2, sampled negatives drawn per step) with selection
    on validation HR@10: 4 steps per jitted call write the one-step run's metrics.jsonl
    rows (losses, validation and test figures, to float32 rounding) and select its step."""
    (_, one, rows1), (_, four, rows4) = (hstu_runs("movielens_hstu_large", k) for k in (1, 4))
    assert [(r["kind"], r["step"]) for r in rows1] == [(r["kind"], r["step"]) for r in rows4]
    assert [r["kind"] for r in rows1].count("train") == 2
    assert [r["kind"] for r in rows1].count("valid") == 2
    for a, b in zip(rows1, rows4):
        for key in ("loss", "grad_norm", "hr@10", "ndcg@10", "hr@50", "mrr"):
            if a.get(key) is not None:
                np.testing.assert_allclose(b[key], a[key], rtol=2e-6, err_msg=f"{a['kind']} {key}")
    assert one["selection"]["best_step"] == four["selection"]["best_step"]
    np.testing.assert_allclose(four["eval_ndcg@10"], one["eval_ndcg@10"], rtol=2e-6)


def test_ranking_summary_hr200_ndcg_mrr_match_a_brute_force_sort():
    """The evaluator's figures: HR@k / NDCG@k / MRR from target_ranks + ranking_summary equal a per-row sort of the
    catalogue (ties ordered with the target first) for k = 10, 50, 200."""
    from gemjax.train.retrieval import KS
    assert 200 in KS
    rng = np.random.default_rng(5)
    n, v = 40, 300
    scores = rng.integers(0, 60, size=(n, v)).astype(np.float32)      # ties
    targets = rng.integers(0, v, size=n)
    ranks = np.asarray(target_ranks(jnp.asarray(scores), jnp.asarray(targets)))
    got = ranking_summary(ranks, ks=(10, 50, 200))
    pos = []
    for row, t in zip(scores, targets):
        order = sorted(range(v), key=lambda i: (-float(row[i]), i != t))
        pos.append(order.index(t))
    pos = np.asarray(pos, np.float64)
    for k in (10, 50, 200):
        assert got[f"hr@{k}"] == pytest.approx(np.mean(pos < k))
        assert got[f"ndcg@{k}"] == pytest.approx(np.mean([1 / np.log2(p + 2) if p < k else 0.0
                                                          for p in pos]))
    assert got["mrr"] == pytest.approx(np.mean(1 / (pos + 1)))
    assert 0 < got["hr@10"] < got["hr@50"] < got["hr@200"] < 1


@pytest.mark.parametrize("preset", ["movielens_hstu_large", "movielens_hstu_large_rab"])
def test_hstu_preset_trains_through_train_and_its_encoder_is_hstu(hstu_runs, preset):
    """movielens_hstu_large (RoPE) and its _rab variant (relative position bias) with small
    shapes (hstu_runs, one step per call): 8 train steps through train() on the fake
    MovieLens, losses finite and falling on the same rows (the mean of steps 5-8 below that
    of steps 1-4), the eval figures ordered (HR@10 <= HR@50 <= HR@200, MRR in (0, 1]); the
    model holds HSTU blocks, with a bias table per block in the _rab one."""
    from gemjax.layers.hstu import HSTUEncoder
    from gemjax.train.retrieval import RetrievalTrainer
    cfg, summary, rows = hstu_runs(preset, 1)
    tr = RetrievalTrainer.create(cfg, Mesh(np.array(jax.devices()[:1]), ("batch",)))
    enc = nnx.merge(tr.graphdef, tr.init_state(0)["params"]).encoder
    assert isinstance(enc, HSTUEncoder)
    rab = preset.endswith("_rab")
    assert all((b.rel_bias is not None) == rab and b.rope != rab for b in enc.blocks)
    losses = [r["loss"] for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in rows if r["kind"] == "train"] == [4, 8]
    assert all(np.isfinite(losses)) and losses[1] < losses[0]    # 5 rows: 2 steps an epoch
    assert summary["eval_hr@10"] <= summary["eval_hr@50"] <= summary["eval_hr@200"] <= 1
    assert 0 < summary["eval_mrr"] <= 1 and summary["model"] == "retrieval"


def test_hstu_rel_bias_flag_is_checked_and_time_needs_timestamps():
    """model.hstu_rel_bias: an unknown value fails validation naming the flag; position+time
    is refused when the tower is built (the schema's sequences carry no timestamps)."""
    from gemjax.models.retrieval import RetrievalTower
    cfg = get_config("movielens_hstu_large")
    assert cfg.model.retrieval.hstu_rel_bias == "none" and cfg.model.rope            # the default path
    with pytest.raises(ValueError, match="model.retrieval.hstu_rel_bias must be"):
        apply_overrides(cfg, {"model.hstu_rel_bias": "time"})
    with pytest.raises(ValueError, match="needs model.retrieval.encoder=hstu"):
        apply_overrides(get_config("movielens_retrieval"), {"model.hstu_rel_bias": "position"})
    small = apply_overrides(cfg, {"model.dim": "8", "model.seq_layers": "1",
                                  "model.hstu_rel_bias": "position+time"})
    with pytest.raises(ValueError, match="position\\+time needs per-event timestamps"):
        RetrievalTower(small, rngs=nnx.Rngs(0))
