"""experiments/ranking.py: the --hparams file, the protocol's overrides, the conversion
check, the table; and a smoke run (2 models x 1 seed on a few fake MovieLens users, a
few steps each, one subprocess per run) when the trainer selects on validation
(gemjax.config.TrainConfig.select_metric)."""

import json
import os

import pytest

from experiments import ranking as R
from tests.test_converters import write_ml


def test_hparams_file(tmp_path):
    p = tmp_path / "h.json"
    p.write_text(json.dumps({"lr": {"train.sparse_lr": 0.1, "model.use_sequences": False},
                             "gem": {"model.wukong_mlp": [32, 32], "model.attention": "softmax"}}))
    assert R.load_hparams(str(p)) == {
        "lr": {"train.sparse_lr": "0.1", "model.use_sequences": "false"},
        "gem": {"model.wukong_mlp": "32:32", "model.attention": "softmax"}}
    assert R.load_hparams("") == {}
    (tmp_path / "sw").mkdir()
    (tmp_path / "sw" / "sweep.json").write_text(json.dumps(
        {"chosen": {"number": 3, "params": {"train.dense_lr": 0.002, "model.dim": 16}}}))
    p.write_text(json.dumps({"gem": "sw/sweep.json"}))
    assert R.load_hparams(str(p)) == {"gem": {"train.dense_lr": "0.002", "model.dim": "16"}}
    (tmp_path / "sw" / "sweep.json").write_text(json.dumps({"chosen": None}))
    with pytest.raises(ValueError, match="gem: .*sweep.json holds no chosen trial"):
        R.load_hparams(str(p))
    for bad, msg in (({"nope": {}}, "unknown model 'nope'"), ({"lr": 3}, "lr: expected an object"),
                     ({"lr": {"lr": 1}}, "'lr' is not section.field"),
                     ({"lr": {"train.x": {"a": 1}}}, r"lr.train.x: value \{'a': 1\}")):
        p.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=msg):
            R.load_hparams(str(p))
    p.write_text("{")
    with pytest.raises(ValueError, match="h.json: not JSON"):
        R.load_hparams(str(p))


def test_protocol_overrides():
    o = R.bench_overrides("/d", 1000, negatives=4, positives=128, max_epochs=10, patience=3, seed=2)
    assert o["data.batch_size"] == "640" and o["data.negatives"] == "4"
    assert o["train.valid_every"] == o["train.checkpoint_every"] == "7"     # 1000 // 128
    assert o["train.steps"] == "70" and o["train.select_metric"] == "auc"
    assert o["data.valid_path"] == "/d/valid.parquet" and o["data.eval_path"] == "/d/test.parquet"
    assert o["train.seed"] == "2" and o["train.patience"] == "3"
    with pytest.raises(ValueError, match="must be >= 1"):
        R.bench_overrides("/d", 10, negatives=0, positives=1, max_epochs=1, patience=1, seed=0)


def test_table_rows():
    rows = [{"model": "lr", "seed": s, "test_auc": a, "test_ne": n, "gflop_per_sample": 1e-6,
             "best_epoch": e, "best_step": 7 * e} for s, a, n, e in
            ((0, 0.8, 0.6, 2.0), (1, 0.9, 0.5, 4.0))]
    t = R.table(rows, ["teacher", "lr"]).splitlines()
    assert len(t) == 2 and t[1].split()[:8] == ["lr", "2", "0.8500", "±", "0.0500", "0.5500",
                                                "±", "0.0500"]
    assert t[1].split()[8:11] == ["1e-06", "3.0", "21"]


@pytest.fixture(scope="module")
def ml(tmp_path_factory):
    d = tmp_path_factory.mktemp("ml-1m")
    write_ml(d)
    return d


def test_conversion_is_made_once_and_checked(ml, tmp_path):
    out = tmp_path / "out"
    data = R.ensure_converted(str(ml), str(out), 0, 3, 4, 0)
    assert sorted(os.listdir(data)) == sorted(R.CONVERTED)
    assert R.ensure_converted(str(ml), str(out), 0, 3, 4, 0) == data       # reused
    with pytest.raises(ValueError, match=r"negatives=3 \(asked 2\)"):
        R.ensure_converted(str(ml), str(out), 0, 2, 4, 0)
    os.remove(os.path.join(data, "negatives.npz"))
    with pytest.raises(ValueError, match=r"partial conversion \(missing \['negatives.npz'\]\)"):
        R.ensure_converted(str(ml), str(out), 0, 3, 4, 0)


@pytest.mark.skipif(not R.has_selection(), reason="gemjax.config.TrainConfig has no select_metric "
                    "yet (validation-based selection, helper val's contract): the benchmark "
                    "cannot select on validation")
def test_smoke_two_models_one_seed(ml, tmp_path):
    data = R.ensure_converted(str(ml), str(tmp_path / "out"), 0, 3, 4, 0)
    bench = {"negatives": 3, "positives": 8, "max_epochs": 2, "patience": 1}
    tiny = ("model.dim=8,model.wukong_mlp=16,model.head_mlp=16,model.fmb_tokens=2,"
            "model.lcb_tokens=2,model.fm_rank=2")
    results = []
    for model in ("lr", "wukong"):
        cfg = R.run_config(data, model, 0, {}, tiny, **bench)
        assert cfg.data.negatives == 3 and cfg.data.batch_size == 32
        wd = str(tmp_path / "runs" / f"{model}_s0")
        summary = R.train_one(cfg, wd, log=lambda s: None)
        assert summary["selection"]["metric"] == "auc"
        r = R.result(model, 0, cfg, summary, wd)
        assert 0 <= r["test_auc"] <= 1 and r["test_ne"] > 0 and r["best_step"] >= 1
        assert R.train_one(cfg, wd) == summary                 # finished: read back
        results.append(r)
    t = R.table(results, ["lr", "wukong"])
    assert t.count("\n") == 2
    other = R.run_config(data, "lr", 1, {}, tiny, **bench)
    with pytest.raises(ValueError, match="another config"):
        R.train_one(other, str(tmp_path / "runs" / "lr_s0"))


def test_the_default_hparams_are_the_chosen_settings():
    """The default --hparams file names every model, and each setting resolves on the preset:
    the teacher without pyramid pooling, each model's chosen dense learning rate."""
    from gemjax.config import PRESETS, apply_overrides
    h = R.load_hparams(R.HPARAMS)
    assert set(h) == set(R.MODELS)
    cfgs = {m: apply_overrides(PRESETS[R.PRESET], {**R.MODELS[m], **h[m]}) for m in R.MODELS}
    assert cfgs["teacher"].model.teacher.pyramid_levels == ((32, None, 1),)
    assert {m: c.optim.dense.lr for m, c in cfgs.items()} == {
        "teacher": 3e-3, "gem": 1e-2, "wukong": 1e-2, "dlrm": 3e-3, "lr": 1e-2}
