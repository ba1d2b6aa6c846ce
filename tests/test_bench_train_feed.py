"""benchmarks/movielens_shaped.py (a MovieLens-shaped ranking dataset of random ids) against
the ranking converter's output and the real file's measured lengths; and
benchmarks/bench_train_feed.py end to end on it, 2 + 4 train steps of a small model, 2 steps
per jitted call."""

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq

from gemjax.features import FeatureSchema
from tests.test_converters import write_ml

from benchmarks import movielens_shaped as ms
from experiments import convert_movielens as cm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# the real converted train.parquet's counts.json (convert_movielens.py --tasks=ranking
# --train_positions=5 --max_history=50 on MovieLens-1M): rows, mean history length
REAL_TRAIN_ROWS, REAL_HISTORY_MEAN = 151_000, 43.732516556291394


def _lengths(path):
    return pc.list_value_length(pq.read_table(path).column("history_item")).to_numpy()


def test_shaped_dataset_has_the_converters_layout_and_the_real_lengths(tmp_path):
    counts = ms.write(str(tmp_path / "shaped"))
    d = tmp_path / "shaped"
    # the converter's output on a fake MovieLens: same columns, types and schema but sizes
    (tmp_path / "ml").mkdir()
    write_ml(tmp_path / "ml")
    cm.convert(str(tmp_path / "ml"), str(tmp_path / "conv"), tasks=("ranking",),
               train_positions=5, max_history=50)
    conv = tmp_path / "conv" / "ranking"
    for split in ("train", "test"):
        assert pq.read_schema(d / f"{split}.parquet") == pq.read_schema(conv / f"{split}.parquet")
    shaped = FeatureSchema.from_dict(json.load(open(d / "schema.json")))
    fake = FeatureSchema.from_dict(json.load(open(conv / "schema.json")))
    assert shaped == dataclasses.replace(fake, tables=tuple(
        dataclasses.replace(t, vocab=shaped.table(t.name).vocab) for t in fake.tables))
    assert {t.name: t.vocab for t in shaped.tables} == {
        "user": 6040, "gender": 2, "age": 7, "occupation": 21, "item": 3953, "genre": 18}

    # the real file's rows, row groups and mean history length
    train = pq.ParquetFile(d / "train.parquet")
    assert train.metadata.num_rows == counts["splits"]["train"]["rows"] == REAL_TRAIN_ROWS
    assert [train.metadata.row_group(i).num_rows for i in range(train.num_row_groups)] == \
        [65_550, 65_525, 19_925]
    lengths = _lengths(d / "train.parquet")
    np.testing.assert_allclose(lengths.mean(), REAL_HISTORY_MEAN, rtol=0, atol=1e-12)
    assert np.median(lengths) == 50 and lengths.min() == 14

    # row layout: 25 rows a user, 5 positions of 5 candidates, one history per position,
    # each position's history one event longer than the last (a sliding window, cap 50),
    # the positive first and the next position's last history event
    t = pq.read_table(d / "train.parquet").to_pydict()
    per_user = np.array(t["user"]).reshape(-1, 25)
    assert (per_user == np.arange(6040)[:, None]).all()
    assert np.array(t["label"]).reshape(-1, 5).tolist() == [[1, 0, 0, 0, 0]] * 30_200
    genre_of = dict(zip(t["item"], t["genre"]))
    for u in (0, 1, 4321):
        rows = range(25 * u, 25 * u + 25)
        hist = [t["history_item"][r] for r in rows]
        for p in range(5):
            assert all(hist[5 * p + c] == hist[5 * p] for c in range(5))
            assert [genre_of.get(i, g) for i, g in zip(hist[5 * p], t["history_genre"][25 * u + 5 * p])] \
                == t["history_genre"][25 * u + 5 * p]
        for p in range(4):
            nxt, cur = hist[5 * p + 5], hist[5 * p]
            assert nxt[-1] == t["item"][25 * u + 5 * p]           # the positive joins the history
            assert nxt[:-1] == cur[len(cur) - len(nxt) + 1:]
            assert len(nxt) == min(len(cur) + 1, 50)
    # test: each user's next position, 5 rows
    test_len = _lengths(d / "test.parquet").reshape(-1, 5)
    assert (test_len == np.minimum(lengths.reshape(-1, 25)[:, 20:21] + 1, 50)).all()


def test_bench_train_feed_measures_each_case_and_records_a_failing_one(tmp_path):
    data = tmp_path / "shaped"
    ms.write(str(data), users=120)
    out = tmp_path / "bench.json"
    r = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_train_feed", "--cases=movielens_rank,no_such_preset",
         "--case_override=movielens_rank:model.kind=lr,data.batch_size=64",
         "--warmup=2", "--steps=4", "--log_every=2", "--iters=2", "--batches=2", "--feed_steps=2",
         "--steps_per_call=2", "--cpu_devices=1", f"--data_dir={data}", f"--workdir={tmp_path / 'work'}", f"--out={out}"],
        cwd=ROOT, env={**{k: v for k, v in os.environ.items() if k != "GEMJAX_GIL_SWITCH_US"},
                       "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True,
        timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.load(open(out))
    ok, bad = res["rows"]
    assert bad["case"] == "no_such_preset" and "no_such_preset" in bad["error"]
    assert (ok["case"], ok["model"], ok["batch"], ok["source"]) == ("movielens_rank", "lr", 64, "parquet")
    assert ok["train"]["window_steps"] == [2, 6] and np.isfinite(ok["train"]["eval_auc"])
    assert ok["steps_per_call"] == ok["step"]["steps_per_call"] == 2     # one program timed
    assert 0 <= ok["train"]["host_wait_share"] <= 1
    assert ok["ratio"] == ok["train"]["samples_per_s"] / ok["step"]["samples_per_s"]
    assert np.isfinite(ok["step"]["loss"]) and ok["feed"]["workers"] == 1
    # the table is printed last: its rows are the JSON's figures
    lines = r.stdout.strip().splitlines()
    assert lines[-5].startswith("train loop vs step alone, 1 x cpu")
    assert lines[-4] == ("feed packed: True; steps per call: 2; GIL switch: 500 us; "   # CPU: no
                         f"XLA_FLAGS: {os.environ.get('XLA_FLAGS') or '(none)'}")  # graph flags added
    assert lines[-3].split()[:4] == ["case", "model", "batch", "train/s"]
    row = lines[-2].split()
    assert row[:3] == ["movielens_rank", "lr", "64"]
    assert row[3:6] == [f"{ok['train']['samples_per_s']:,.0f}", f"{ok['step']['samples_per_s']:,.0f}",
                        f"{ok['ratio']:.3f}"]
    assert lines[-1].startswith("no_such_preset") and "error" in lines[-1]
    # no checkpoint written (the timed loop skips the saves)
    ckpts = tmp_path / "work" / "movielens_rank" / "checkpoints"
    assert not (ckpts.exists() and os.listdir(ckpts))
