"""Model selection in the trainer (gemjax.train.selection through gemjax.train.loop.train):
validation rows whose labels are the train rows' inverted, so the better the model fits
the train rows the worse it scores on them: the validation metric peaks at the first
eval, WORKDIR/best keeps that step, the run stops after the patience, a resumed run
selects what the uninterrupted one did, the serve readers default to the best step,
refit trains on train + validation rows; config errors name their field."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from jax.sharding import Mesh

from gemjax.config import apply_overrides, get_config, select_mode
from gemjax.features import FeatureSchema, SparseFeature, Table
from gemjax.data.source import make_source
from gemjax.train.selection import Selection

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCHEMA = FeatureSchema(tables=(Table("user", 20), Table("item", 16)),
                       sparse=(SparseFeature("user", "user"), SparseFeature("item", "item")),
                       tasks=("click",))
TIMING = ("samples_per_sec", "tokens_per_sec")


def _write(path, n, seed, flip):
    """n rows; click = item is even (inverted with `flip`), 1 in 10 labels noise."""
    rng = np.random.default_rng(seed)
    user, item = rng.integers(0, 20, n), rng.integers(0, 16, n)
    click = ((item % 2 == 0) ^ flip ^ (rng.random(n) < 0.1)).astype(np.float32)
    pq.write_table(pa.table({"user": user.astype(np.int32), "item": item.astype(np.int32),
                             "click": click}), path, row_group_size=32)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("sel")
    _write(d / "train.parquet", 256, 0, flip=False)
    _write(d / "valid.parquet", 96, 1, flip=True)      # the train rows' rule, inverted
    _write(d / "test.parquet", 96, 2, flip=False)
    return d


def _config(d, **over):
    cfg = dataclasses.replace(get_config("tiny"), features=SCHEMA)
    return apply_overrides(cfg, {
        "data.source": "parquet", "data.train_path": str(d / "train.parquet"),
        "data.eval_path": str(d / "test.parquet"), "data.valid_path": "valid.parquet",
        "data.batch_size": "32", "data.eval_batches": "0", "model.kind": "lr",
        "train.steps": "12", "train.log_every": "2", "train.eval_every": "4",
        "train.valid_every": "2", "train.checkpoint_every": "4", "train.warmup_steps": "0",
        "train.dense_lr": "0.05", "train.sparse_lr": "0.5", "train.tensorboard": "false",
        "train.select_metric": "auc", "train.patience": "2", **over})


def _rows(wd):
    return [{k: v for k, v in json.loads(ln).items() if k not in TIMING}
            for ln in open(os.path.join(wd, "metrics.jsonl"))]


def _mesh():
    return Mesh(np.array(jax.devices()[:1]), ("batch",))


@pytest.fixture(scope="module")
def whole(data, tmp_path_factory):
    """The uninterrupted selection run: (workdir, summary)."""
    from gemjax.train.loop import train
    wd = str(tmp_path_factory.mktemp("whole"))
    return wd, train(_config(data), wd, log=lambda s: None, mesh=_mesh())


def test_best_step_is_the_early_peak_and_patience_stops_the_run(whole):
    wd, summary = whole
    rows = _rows(wd)
    valid = [r for r in rows if r["kind"] == "valid"]
    # validation AUC falls as the model learns the train rows' rule: best at the first eval
    aucs = [r["auc"] for r in valid]
    assert [r["step"] for r in valid] == [2, 4, 6] and all(r["split"] == "valid" for r in valid)
    assert aucs[0] > aucs[1] > aucs[2] and aucs[0] < 0.5
    assert valid[0]["count"] == 96            # every validation row once
    sel = summary["selection"]
    assert (sel["metric"], sel["mode"], sel["best_step"], sel["evals"]) == ("auc", "max", 2, 3)
    assert sel["stopped_early"] and sel["last_step"] == 6 and sel["best_value"] == aucs[0]
    assert sel["best"]["auc"] == aucs[0] and sel["best"]["count"] == 96
    assert os.listdir(os.path.join(wd, "best")) == ["2"]
    assert sorted(map(int, os.listdir(os.path.join(wd, "checkpoints")))) == [4, 6]
    # the test rows once, at the end, on the best state
    (test,) = [r for r in rows if r["kind"] == "eval"]
    assert test["split"] == "test" and test["eval_step"] == 2 and test["step"] == 6
    assert test["count"] == 96 and summary["eval"]["eval_step"] == 2
    assert summary["eval_auc"] == test["auc"] == summary["eval"]["auc"]
    # train rows up to the early stop, none past it
    assert [r["step"] for r in rows if r["kind"] == "train"] == [2, 4, 6]


def test_resume_after_a_stop_selects_what_the_uninterrupted_run_did(data, whole, tmp_path):
    """Stopped after step 4 (best step 2, one eval without improvement), then resumed:
    the same rows, best step, patience count and early stop at step 6."""
    from gemjax.train.checkpoint import Checkpointer
    from gemjax.train.loop import train
    wd, summary = whole
    cut = str(tmp_path / "cut")
    cfg = _config(data)
    assert train(cfg, cut, log=lambda s: None, mesh=_mesh(), stop_after=4)["stopped_early"]
    with Checkpointer(os.path.join(cut, "checkpoints"), read_only=True) as ck:
        saved = ck.metadata(4)[1]["selection"]
    assert (saved["best_step"], saved["bad"], saved["evals"]) == (2, 1, 2)
    resumed = train(cfg, cut, log=lambda s: None, mesh=_mesh())
    assert _rows(cut) == _rows(wd)
    assert resumed["selection"] == summary["selection"]
    assert resumed["eval"] == summary["eval"]
    assert os.listdir(os.path.join(cut, "best")) == ["2"]
    # a rerun of the finished (early-stopped) run trains nothing and reports the same
    again = train(cfg, cut, log=lambda s: None, mesh=_mesh())
    assert again["selection"] == summary["selection"] and again["eval"] == summary["eval"]
    assert _rows(cut) == _rows(wd)                 # no second test row


def test_serve_readers_default_to_best_and_newest_on_request(whole):
    from gemjax.serve.evaluate import evaluate_checkpoint
    from gemjax.serve.inference import load_for_inference
    from gemjax.serve.restore import pick_checkpoint
    wd, summary = whole
    assert pick_checkpoint(wd) == (os.path.join(wd, "best"), None)
    assert pick_checkpoint(wd, "newest") == (os.path.join(wd, "checkpoints"), None)
    assert pick_checkpoint(wd, "2") == (os.path.join(wd, "best"), 2)
    with pytest.raises(ValueError, match="expected best, newest or a step"):
        pick_checkpoint(wd, "latest")
    pred = load_for_inference(wd, mesh=_mesh())
    assert pred.step == 2 and pred.directory == os.path.join(wd, "best")
    assert load_for_inference(wd, "newest", mesh=_mesh()).step == 6
    lines = []
    row = evaluate_checkpoint(wd, None, _mesh(), log=lines.append)
    assert row["step"] == 2 and f"checkpoint step 2 of {wd} (best)" in lines[-1]
    # the test eval of the best state, evaluated again through the serve path
    for k in ("ne", "auc", "count", "log_loss"):
        assert row[k] == summary["eval"][k], k


def test_train_py_mode_eval_reads_best_by_default_and_newest_on_request(whole):
    wd, _ = whole
    env = {**os.environ, "PYTHONPATH": ROOT}
    out = []
    for extra in ([], ["--checkpoint=newest"]):
        r = subprocess.run([sys.executable, "-m", "experiments.train", "--mode=eval",
                            f"--workdir={wd}", "--compile_cache=", *extra], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        out.append(r.stdout)
    assert f"checkpoint step 2 of {wd} (best)" in out[0]
    assert f"checkpoint step 6 of {wd} (checkpoints)" in out[1]


def test_refit_trains_best_step_steps_on_train_and_valid_rows(whole):
    from gemjax.train.refit import refit
    wd, summary = whole
    got = refit(wd, log=lambda s: None, mesh=_mesh())
    assert got["steps"] == 2 and "selection" not in got
    data = os.path.join(wd, "refit", "data")
    assert sorted(os.listdir(data)) == ["train-00000.parquet", "valid-00000.parquet"]
    cfg = json.load(open(os.path.join(wd, "refit", "config.json")))
    assert cfg["data"]["train_path"] == data and cfg["train"]["select_metric"] == ""
    from gemjax.config import config_from_dict
    src = make_source(config_from_dict(cfg), "train")
    assert src.num_rows == 256 + 96
    rows = _rows(os.path.join(wd, "refit"))
    assert [(r["step"], r["kind"]) for r in rows] == [(2, "train"), (2, "eval")]


def test_refit_on_the_valid_rows_alone_links_only_them(whole, tmp_path):
    from gemjax.train.refit import refit_config
    wd, summary = whole
    work = tmp_path / "w"
    work.mkdir()
    for name in ("config.json", "summary.json"):
        shutil.copy(os.path.join(wd, name), work / name)
    cfg = refit_config(str(work), rows="valid")
    assert sorted(os.listdir(cfg.data.train_path)) == ["valid-00000.parquet"]
    assert make_source(cfg, "train").num_rows == 96
    assert cfg.train.steps == summary["selection"]["best_step"] and cfg.data.valid_path == ""
    assert sorted(os.listdir(refit_config(str(work)).data.train_path)) == \
        ["train-00000.parquet", "valid-00000.parquet"]          # relinked for train + valid
    with pytest.raises(ValueError, match=r"refit rows='test': expected one of train\+valid, "
                                         r"valid"):
        refit_config(str(work), rows="test")


def test_metric_direction():
    assert [select_mode(m, "gem") for m in ("ne", "loss", "log_loss", "task0/ne", "auc",
                                            "surface1/task0/auc")] == \
        ["min", "min", "min", "min", "max", "max"]
    assert [select_mode(m, "retrieval") for m in ("hr@10", "ndcg@10", "mrr", "ne")] == \
        ["max", "max", "max", None]
    assert select_mode("calibration", "gem") is None
    ne = Selection("ne", "min", patience=2)
    assert [ne.update(s, {"ne": v}) for s, v in ((1, 0.9), (2, 0.8), (3, 0.85), (4, 0.8))] == \
        [True, True, False, False]           # a tie is no improvement
    assert (ne.best_step, ne.best_value, ne.bad, ne.exhausted) == (2, 0.8, 2, True)
    auc = Selection("auc", "max")
    assert [auc.update(s, {"auc": v}) for s, v in ((1, 0.6), (2, float("nan")), (3, 0.7))] == \
        [True, False, True]
    assert auc.best_step == 3 and not auc.exhausted       # patience 0: never stops
    assert Selection.from_dict(ne.to_dict()) == ne


def test_bad_select_metric_or_missing_valid_path_name_the_field(data, tmp_path):
    with pytest.raises(ValueError, match=r"train.select_metric='calibration' is no eval metric"):
        _config(data, **{"train.select_metric": "calibration"})
    with pytest.raises(ValueError, match=r"train.select_metric=auc needs data.valid_path"):
        _config(data, **{"data.valid_path": ""})
    with pytest.raises(ValueError, match=r"train.patience needs train.select_metric"):
        _config(data, **{"train.select_metric": ""})
    with pytest.raises(ValueError, match=r"data.valid_path=synthetic is the synthetic"):
        _config(data, **{"data.valid_path": "synthetic"})
    cfg = _config(data, **{"data.valid_path": "missing.parquet"})
    with pytest.raises(FileNotFoundError, match=r"data.valid_path=.*missing.parquet"):
        make_source(cfg, "valid")


def test_synthetic_valid_stream_is_held_out_and_seeded():
    cfg = get_config("tiny", "data.valid_path=synthetic,train.select_metric=ne")
    valid = make_source(cfg, "valid").shard_batch(0, 0, 1)[0]
    again = make_source(cfg, "valid").shard_batch(0, 0, 1)[0]
    np.testing.assert_array_equal(valid.sparse["user"], again.sparse["user"])
    for other in ("train", "eval"):
        b = make_source(cfg, other).shard_batch(0, 0, 1)[0]
        assert not np.array_equal(b.sparse["user"], valid.sparse["user"]), other
