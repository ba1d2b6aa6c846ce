"""The `frappe` preset through the real trainer: tiny fake Frappe files (libsvm, as the
dataset ships) converted by experiments/convert_frappe.py, trained 2 steps by train() with
the preset's model and optimizer, checkpointed, and evaluated on every test row; the
restored checkpoint scores the same on another mesh. Frappe has no dense features, so
this also covers models without a dense projection (GEM v0 and the LR baseline)."""

import dataclasses
import json
import os

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from experiments import convert_frappe as cf
from gemjax.config import apply_overrides, config_from_dict, get_config
from gemjax.features import FeatureSchema
from gemjax.presets import FRAPPE_SCHEMA
from gemjax.serve.evaluate import evaluate_checkpoint
from gemjax.train.loop import train



def write_frappe(d, n_valid=60, n_test=21, seed=0):
    """valid.libsvm and test.libsvm of 10 fields (field j: ids 30j..30j+7); the labels
    of test.libsvm."""
    rng = np.random.default_rng(seed)
    d.mkdir()
    test_labels = None
    for name, n in (("valid", n_valid), ("test", n_test)):
        rows = [[int(rng.integers(2))] + [30 * j + int(rng.integers(8)) for j in range(10)]
                for _ in range(n)]
        (d / f"{name}.libsvm").write_text("".join(
            f"{r[0]} " + " ".join(f"{i}:1" for i in r[1:]) + "\n" for r in rows))
        if name == "test":
            test_labels = np.array([r[0] for r in rows], np.float64)
    return test_labels


@pytest.fixture(scope="module")
def frappe_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("frappe")
    labels = write_frappe(root / "raw")
    cf.convert(str(root / "raw"), str(root / "out"), row_group_rows=16)
    return root / "out", labels


def test_preset_schema_is_the_converters(frappe_dir):
    out, _ = frappe_dir
    written = FeatureSchema.from_dict(json.load(open(out / "schema.json")))
    # the fake files have another id count; everything else is the preset's schema
    assert written == dataclasses.replace(
        FRAPPE_SCHEMA, tables=(dataclasses.replace(FRAPPE_SCHEMA.tables[0],
                                                   vocab=written.tables[0].vocab),))
    # the real files' table: 5,382 ids (tests/test_converters.py checks the real counts)
    assert FRAPPE_SCHEMA == cf.frappe_schema(5_382, 10)
    cfg = get_config("frappe")
    assert cfg.features == FRAPPE_SCHEMA and cfg.data.source == "parquet"
    assert cfg.data.eval_path.endswith("/test.parquet") and cfg.data.eval_batches == 0


@pytest.mark.parametrize("kind", ["gem", "lr"])
def test_two_steps_of_the_frappe_recipe(frappe_dir, tmp_path, kind):
    out, labels = frappe_dir
    schema = FeatureSchema.from_dict(json.load(open(out / "schema.json")))
    cfg = dataclasses.replace(get_config("frappe"), features=schema)
    cfg = apply_overrides(cfg, {
        "data.train_path": str(out / "train.parquet"), "data.eval_path": str(out / "test.parquet"),
        "data.batch_size": "16", "model.kind": kind, "train.steps": "2", "train.log_every": "1",
        "train.eval_every": "2", "train.checkpoint_every": "2", "train.tensorboard": "false"})
    wd = str(tmp_path / kind)
    summary = train(cfg, wd, log=lambda s: None)
    assert summary["steps"] == 2 and np.isfinite(summary["eval_ne"])
    rows = [json.loads(x) for x in open(f"{wd}/metrics.jsonl")]
    (ev,) = [r for r in rows if r["kind"] == "eval"]
    # every test row once (21 rows: 2 batches of 16, the last one part masked)
    assert ev["count"] == len(labels) == 21
    assert ev["task0/positive_rate"] == pytest.approx(labels.mean())
    assert config_from_dict(json.load(open(f"{wd}/config.json"))).name == "frappe"
    # no dense features: the dense tokens are learned constants, no zero-size parameter
    assert json.load(open(f"{wd}/config.json"))["features"]["dense"] == []
    # the step-2 checkpoint restores onto one device and scores the same
    one = Mesh(np.array(jax.devices()[:1]), ("batch",))
    again = evaluate_checkpoint(wd, None, one, log=lambda s: None)
    assert again["step"] == 2 and again["count"] == 21
    assert again["auc"] == pytest.approx(ev["auc"], abs=1e-6)
    assert again["log_loss"] == pytest.approx(ev["log_loss"], rel=1e-5)


def test_frappe_script_converts_once_trains_each_model_and_seed_and_prints_the_table(tmp_path):
    """python -m experiments.frappe on fake files, 2 steps a run: it converts into --data_out,
    trains lr over seeds 0 and 1 through train(), and its table's mean ± std is that of
    the runs' own final eval rows. A second call reuses the conversion and the finished
    runs; another split seed on the same --data_out is refused by name."""
    import subprocess
    import sys

    ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    write_frappe(tmp_path / "raw")
    data, runs = tmp_path / "data", tmp_path / "runs"
    argv = [sys.executable, "-m", "experiments.frappe", f"--data_dir={tmp_path / 'raw'}",
            f"--data_out={data}", f"--workdir={runs}", "--models=lr", "--seeds=0,1",
            "--override=data.batch_size=16,train.steps=2,train.log_every=1,train.eval_every=2,"
            "train.checkpoint_every=2,train.warmup_steps=1"]
    env = dict(os.environ, JAX_PLATFORMS="cpu")

    def run(*extra):
        return subprocess.run(argv + list(extra), cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=300)

    first = run()
    assert first.returncode == 0, first.stderr[-3000:]
    evals = [[json.loads(x) for x in open(runs / f"lr_s{s}" / "metrics.jsonl")
              if json.loads(x)["kind"] == "eval"][-1] for s in (0, 1)]
    assert [e["step"] for e in evals] == [2, 2] and evals[0]["auc"] != evals[1]["auc"]
    auc, ne = np.array([e["auc"] for e in evals]), np.array([e["ne"] for e in evals])
    header, row = first.stdout.strip().splitlines()[-2:]
    assert header.split()[:3] == ["model", "seeds", "test"]
    assert row.split()[:8] == ["lr", "2", f"{auc.mean():.4f}", "±", f"{auc.std():.4f}",
                               f"{ne.mean():.4f}", "±", f"{ne.std():.4f}"]
    counts = json.load(open(data / "counts.json"))
    assert counts["splits"]["test"]["rows"] == 21 and counts["seed"] == 0
    stamp = os.stat(data / "train.parquet").st_mtime_ns
    logged = (runs / "lr_s0" / "metrics.jsonl").read_text()

    again = run()
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.strip().splitlines()[-1].split()[:8] == row.split()[:8]
    assert os.stat(data / "train.parquet").st_mtime_ns == stamp       # not converted again
    assert (runs / "lr_s0" / "metrics.jsonl").read_text() == logged    # nor retrained
    other = run("--split_seed=3")
    assert other.returncode != 0
    assert "counts.json was converted with another split seed=0 (asked 3)" in other.stderr
