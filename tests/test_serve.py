"""Eval-only, prediction and export of a trained run (gemjax.serve, train.py --mode=eval).

One tiny run (6 steps on one device, evals and checkpoints at steps 3 and 6) is
trained once; its own metrics.jsonl eval rows, computed in the training process
from the state in memory, are the reference every reload must reproduce.
"""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

import gemjax
from gemjax.config import PRESETS, apply_overrides, config_from_dict, get_config
from gemjax.data.feeding import concat_shards, merge_shards
from gemjax.data.synthetic import SyntheticStream
from gemjax.serve.evaluate import evaluate_checkpoint, eval_path
from gemjax.serve.export import export_model, load_exported
from gemjax.serve.inference import load_for_inference
from gemjax.train.loop import train
from gemjax.train.metrics import EvalAccumulator, flat

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = apply_overrides(get_config("tiny"), "train.steps=6,train.log_every=3,train.eval_every=3,"
                                          "train.checkpoint_every=3")
MOD_TABLES = {"replicate_below_bytes": 0}    # every table row-wise, "mod" split (permuted storage)


def _mesh(n):
    return Mesh(np.array(jax.devices()[:n]), ("batch",))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("serve") / "run")
    train(CFG, workdir, log=lambda s: None, mesh=_mesh(1))
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        evals = {r["step"]: r for r in map(json.loads, f) if r["kind"] == "eval"}
    assert sorted(evals) == [3, 6]
    return workdir, evals


def _same_metrics(row, reference):
    """Every metric of `row` (NE, AUC, calibration, log loss, counts; overall, per task,
    per surface/task; Bayes NE) equals the training's eval row, to every digit."""
    keys = [k for k in row if k not in ("step", "kind", "mesh", "devices", "eval_batches")]
    assert len(keys) > 40 and all(k in reference for k in keys), sorted(set(keys) - set(reference))
    assert {k: row[k] for k in keys} == {k: reference[k] for k in keys}


def test_eval_only_reproduces_the_runs_eval_rows(run):
    workdir, evals = run
    for step, want in ((None, 6), (3, 3)):
        row = evaluate_checkpoint(workdir, step, _mesh(1), log=lambda s: None)
        assert row["step"] == want and row["kind"] == "eval_only" and row["mesh"] == {"batch": 1}
        _same_metrics(row, evals[want])
        with open(eval_path(workdir, want)) as f:
            assert json.load(f) == row


def test_eval_mode_flag(run, tmp_path):
    workdir, evals = run
    if os.path.exists(eval_path(workdir, 6)):
        os.remove(eval_path(workdir, 6))           # the subprocess must write it
    r = subprocess.run([sys.executable, "-m", "experiments.train", "--mode=eval",
                        f"--workdir={workdir}", "--cpu_devices=1"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"[eval] checkpoint step 6 of {workdir}" in r.stdout
    with open(eval_path(workdir, 6)) as f:
        _same_metrics(json.load(f), evals[6])
    # --checkpoint_step belongs to --mode=eval: refused before any jax work
    r = subprocess.run([sys.executable, "-m", "experiments.train",
                        "--checkpoint_step=3", f"--workdir={tmp_path}"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode != 0 and "--checkpoint_step picks the checkpoint of --mode=eval" in r.stderr


def _eval_batches(cfg, num_shards):
    stream = SyntheticStream(cfg.data, cfg.train.seed, "eval")
    return [[stream.shard_batch(i, s, num_shards)[0] for s in range(num_shards)]
            for i in range(cfg.data.eval_batches)]


def test_predictions_reproduce_the_runs_eval(run):
    workdir, evals = run
    predict = gemjax.load_for_inference(workdir)
    assert predict.step == 6 and predict.cfg == CFG
    acc = EvalAccumulator(CFG.data.synthetic.num_surfaces, CFG.data.synthetic.num_tasks)
    for (b,) in _eval_batches(CFG, 1):
        probs = predict(b)
        assert probs.shape == (CFG.data.batch_size, CFG.data.synthetic.num_tasks)
        acc.add(probs, b.labels, b.label_mask, b.surface, b.weights)
    res = acc.result()
    _same_metrics({"loss": res["log_loss"], **flat(res), "bayes_ne": evals[6]["bayes_ne"]}, evals[6])


def test_predictions_on_another_mesh_and_table_layout(run):
    """2 devices, tables row-sharded with permuted ("mod") storage: same probabilities as
    one device for the same samples (one packed buffer per device vs both merged)."""
    workdir, _ = run
    two = load_for_inference(workdir, mesh=_mesh(2), trainer_kw=MOD_TABLES)
    assert {p.kind for p in two.trainer.coll.plans.values()} == {"row_wise"}
    one = load_for_inference(workdir, step=6)
    shards = _eval_batches(CFG, 2)[0]
    got = two(concat_shards(shards))
    want = one(merge_shards(shards))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    merged = merge_shards(shards)
    bad = merged.replace(sparse={**merged.sparse, "user": np.full_like(merged.sparse["user"], 1000)})
    with pytest.raises(ValueError, match="feature 'user'.*outside \\[0, 1000\\)"):
        one(bad)


_FRESH = """
import sys, numpy as np
from gemjax.serve.export import load_exported
from gemjax.data.synthetic import SyntheticStream
model = load_exported(sys.argv[1])
cfg = model.config
batch, _ = SyntheticStream(cfg.data, cfg.train.seed, "eval").shard_batch(1, 0, 1)
np.save(sys.argv[2], model(batch))
print("devices", len(__import__("jax").devices()), "step", model.manifest["step"])
"""


def test_export_reloads_in_a_fresh_process(run, tmp_path):
    workdir, _ = run
    out = export_model(workdir, str(tmp_path / "export"), mesh=_mesh(2), trainer_kw=MOD_TABLES,
                       log=lambda s: None)   # tables gathered from permuted, sharded storage
    with open(os.path.join(out, "model.stablehlo"), "rb") as f:
        assert f.read(4) == b"ML\xefR"       # MLIR bytecode
    manifest = json.load(open(os.path.join(out, "manifest.json")))
    assert manifest["step"] == 6 and manifest["inputs"]["tables"]["user"]["shape"] == [1000, 8]
    assert manifest["inputs"]["batch"]["dense"]["shape"] == [64, 4] and manifest["output"]["shape"] == [64, 2]
    assert manifest["features"]["clicks.item"]["input"] == "sequences/clicks/values/item"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
    r = subprocess.run([sys.executable, "-c", _FRESH, out, str(tmp_path / "p.npy")], capture_output=True,
                       text=True, timeout=300, cwd=ROOT, env={**env, "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "devices 1 step 6" in r.stdout
    (batch,) = _eval_batches(CFG, 1)[1]
    want = load_for_inference(workdir)(batch)
    got = np.load(tmp_path / "p.npy")
    assert got.shape == want.shape == (64, 2)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)

    model = load_exported(out)                 # bad inputs: named
    small = SyntheticStream(dataclasses.replace(CFG.data, batch_size=32), 0, "eval").shard_batch(0)[0]
    with pytest.raises(ValueError, match="batch input 'sparse/context' is int32\\[32\\], "
                                         "the export takes int32\\[64\\]"):
        model(small)
    ids = batch.sequences["clicks"].values["item"].copy()
    ids[0] = 400
    seqs = {**batch.sequences, "clicks": batch.sequences["clicks"].with_values(
        {**batch.sequences["clicks"].values, "item": ids})}
    with pytest.raises(ValueError, match="feature 'clicks.item'.*outside \\[0, 400\\)"):
        model(batch.replace(sequences=seqs))
    with pytest.raises(FileNotFoundError, match="not a gemjax export"):
        load_exported(str(tmp_path))


def test_bad_workdir_and_step_are_named(run, tmp_path):
    workdir, _ = run
    with pytest.raises(FileNotFoundError, match="config.json: no such file"):
        load_for_inference(str(tmp_path / "nothing"))
    empty = tmp_path / "fresh"
    empty.mkdir()
    with open(os.path.join(workdir, "config.json")) as f:
        (empty / "config.json").write_text(f.read())
    with pytest.raises(FileNotFoundError, match="has not saved a checkpoint"):
        evaluate_checkpoint(str(empty))
    assert not (empty / "checkpoints").exists()          # nothing created
    (empty / "checkpoints").mkdir()
    with pytest.raises(FileNotFoundError, match="no finished checkpoint"):
        load_for_inference(str(empty))
    with pytest.raises(FileNotFoundError, match=r"no checkpoint for step 5 .*\(have \[3, 6\]\)"):
        evaluate_checkpoint(workdir, 5, _mesh(1))
    (empty / "config.json").write_text('{"model": {"dim": "wide"}}')
    with pytest.raises(ValueError, match="config.json: config field model.dim: expected int"):
        load_for_inference(str(empty))


def test_config_from_dict_round_trips():
    cfgs = [get_config(n) for n in PRESETS] + [apply_overrides(
        get_config("small"), "model.pyramid_levels=32:4:1/32:none:1,model.capacity_factor=1.5")]
    for cfg in cfgs:
        back = config_from_dict(json.loads(json.dumps(dataclasses.asdict(cfg))))
        assert back == cfg and type(back.model.wukong_mlp) is tuple
    assert cfgs[-1].model.teacher.pyramid_levels == ((32, 4, 1), (32, None, 1))
    with pytest.raises(ValueError, match="data has no fields \\['bogus'\\]"):
        config_from_dict({"data": {"bogus": 1}})


def test_importing_gemjax_stays_cheap():
    r = subprocess.run([sys.executable, "-c", "import sys, gemjax; print('jax' in sys.modules)"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.stdout.strip() == "False", r.stderr
    assert gemjax.load_for_inference is load_for_inference
