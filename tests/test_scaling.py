"""experiments/scaling.py: the ladder's FLOPs (span, matched families), the report writer,
gemjax.perf.retrieval_flops against independent counts, and a 2-rung end-to-end smoke."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import types

import jax
import numpy as np
import pytest
from flax import nnx

from experiments import ranking, scaling
from gemjax.config import ModelConfig, get_config, schema_of
from gemjax.perf.retrieval_flops import retrieval_forward_flops

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ML1M = os.path.join(REPO, "..", "shared", "datasets", "ml-1m")
HAS_HSTU = hasattr(ModelConfig().retrieval, "encoder")

# history lengths of two fake batches (ML-1M-like: many capped at 200)
LENGTHS = (np.array([200, 17, 96, 3, 200, 150, 1, 64]), np.array([5, 200, 120, 33, 8, 200, 77, 2]))


def _batches(lengths=LENGTHS):
    """Host-batch stand-ins carrying only what the retrieval FLOPs read: the history offsets."""
    return [types.SimpleNamespace(sequences={"history": types.SimpleNamespace(
        offsets=np.concatenate([[0], np.cumsum(n)]))}) for n in lengths]


def _reference(cfg, lengths) -> int:
    """2 x (matmul weights of the encoder) x tokens + 4 d x the causal pairs counted one
    by one: the encoder's forward FLOPs from the built model's shapes."""
    from gemjax.models.gem import build_model
    model = nnx.eval_shape(lambda: build_model(cfg, nnx.Rngs(0)))
    weights = sum(int(np.prod(leaf.shape)) for path, leaf in
                  jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))
                  if "encoder" in jax.tree_util.keystr(path) and "kernel" in jax.tree_util.keystr(path))
    pairs = sum(1 for n in lengths for i in range(n) for j in range(i + 1))
    return 2 * weights * int(sum(lengths)) + 4 * cfg.model.dim * pairs * cfg.model.seq_layers


ENCODERS = ["softmax"] + (["hstu"] if HAS_HSTU else [])


@pytest.mark.parametrize("encoder", ENCODERS)
def test_retrieval_flops_match_model_shapes(encoder):
    ov = "model.dim=24,model.seq_layers=3"
    if encoder == "hstu":
        ov += ",model.retrieval_encoder=hstu,model.attention=gdpa"
    cfg = get_config("movielens_retrieval", ov)
    lengths = np.array([7, 1, 0, 12, 3])
    enc, score = retrieval_forward_flops(cfg, lengths)
    assert enc == _reference(cfg, lengths)
    vocab = next(t.vocab for t in schema_of(cfg).tables if t.name == "item")
    assert score == 2 * 23 * 24 * vocab                       # full softmax over the item table
    sampled = get_config("movielens_retrieval", ov + ",model.retrieval_negatives=128")
    assert retrieval_forward_flops(sampled, lengths)[1] == 2 * 23 * 24 * 129


def test_retrieval_flops_refuse_other_kinds():
    with pytest.raises(ValueError, match="model.kind must be retrieval"):
        retrieval_forward_flops(get_config("tiny"), np.array([3]))


def test_default_retrieval_ladder_spans_16x():
    fam = scaling.FAMILIES["retrieval"][0]
    base = get_config(fam.preset)
    rungs = [scaling.make_rung(base, fam, i, w, d, _batches(), count_params=False)
             for i, (w, d) in enumerate(scaling.LADDERS["retrieval"])]
    assert len(rungs) >= 4
    flops = [r.dense_flops for r in rungs]
    assert flops == sorted(flops)
    assert max(flops) / min(flops) >= 16
    assert scaling.check_span(rungs) == pytest.approx(max(flops) / min(flops))
    # every rung's count is the per-sample encoder FLOPs of its own config
    total = sum(len(n) for n in LENGTHS)
    for r, (w, d) in zip(rungs, scaling.LADDERS["retrieval"]):
        cfg = get_config(fam.preset, f"model.dim={w},model.seq_layers={d}")
        ref = sum(_reference(cfg, n) for n in LENGTHS) / total
        assert r.dense_flops == pytest.approx(ref)


def test_default_ranking_ladder_spans_16x():
    fam = scaling.FAMILIES["ranking"][0]
    base = get_config(fam.preset, {**fam.base, "data.batch_size": "32"})   # synthetic stream
    batches = scaling.flops_batches(base, 1)
    rungs = [scaling.make_rung(base, fam, i, w, d, batches, count_params=False)
             for i, (w, d) in enumerate(scaling.LADDERS["ranking"])]
    assert max(r.dense_flops for r in rungs) / min(r.dense_flops for r in rungs) >= 16
    scaling.check_span(rungs)


def test_ranking_families_use_the_benchmarks_chosen_settings():
    """The ranking curve trains each family as the ranking benchmark does: its model
    overrides, then the settings that benchmark's validation chose."""
    chosen = ranking.load_hparams(ranking.HPARAMS)
    for fam, model in zip(scaling.FAMILIES["ranking"], ("teacher", "gem")):
        cfg = get_config(fam.preset, fam.base)
        want = get_config(fam.preset, {**ranking.MODELS[model], **chosen[model]})
        assert cfg == want and cfg.model.kind == model
    teacher = scaling.FAMILIES["ranking"][0]          # its chosen settings are not the preset's
    assert get_config(teacher.preset, teacher.base) != get_config(teacher.preset,
                                                                  ranking.MODELS["teacher"])


def test_narrow_or_short_ladders_are_refused():
    fam = scaling.FAMILIES["retrieval"][0]
    base = get_config(fam.preset)
    narrow = [scaling.make_rung(base, fam, i, w, 1, _batches(), count_params=False)
              for i, w in enumerate((32, 36, 40, 44))]
    with pytest.raises(ValueError, match="must span >= 16x"):
        scaling.check_span(narrow)
    with pytest.raises(ValueError, match=">= 4"):
        scaling.check_span(narrow[:3])
    with pytest.raises(ValueError, match="--ladder"):
        scaling.parse_ladder("32x1,64")
    assert scaling.parse_ladder("32x1, 64X2") == ((32, 1), (64, 2))


def test_match_rung_finds_a_width_within_tolerance():
    """A target between widths at another depth: the matched rung is within MATCH_TOL and
    no other width of the family at that depth is nearer."""
    fam = scaling.FAMILIES["retrieval"][0]
    base = get_config(fam.preset)
    target = scaling.make_rung(base, fam, 0, 72, 3, _batches(), count_params=False).dense_flops
    got = scaling.match_rung(base, fam, 0, target, 2, _batches())
    assert got.depth == 2 and got.width % fam.width_step == 0
    assert abs(got.dense_flops / target - 1) <= scaling.MATCH_TOL
    others = [scaling.make_rung(base, fam, 0, w, 2, _batches(), count_params=False).dense_flops
              for w in range(fam.width_step, 256, fam.width_step)]
    assert min(abs(math.log(f / target)) for f in others) == pytest.approx(
        abs(math.log(got.dense_flops / target)))
    assert got.params > 0
    off = scaling.make_rung(base, fam, 0, 32, 2, _batches(), count_params=False)
    with pytest.raises(ValueError, match="off by more than 10%"):
        scaling.check_match([got], [off])


@pytest.mark.parametrize("task", ["retrieval", "ranking"])
def test_families_match_per_rung(task):
    fams = scaling.FAMILIES[task]
    why = fams[1].requires()
    if why:
        pytest.skip(f"{fams[1].name}: {why}")
    if task == "ranking":          # the preset's synthetic stream, small batches
        bases = {f.name: get_config(f.preset, {**f.base, "data.batch_size": "32"}) for f in fams}
        batches = scaling.flops_batches(bases[fams[0].name], 1)
    else:
        bases = {f.name: get_config(f.preset, f.base) for f in fams}
        batches = _batches()
    ladder = scaling.build_ladder(bases, fams, scaling.LADDERS[task], batches, log=lambda s: None,
                                  count_params=False)
    first, second = (ladder[f.name] for f in fams)
    assert len(first) == len(second) == len(scaling.LADDERS[task])
    for a, b in zip(first, second):
        assert abs(b.dense_flops / a.dense_flops - 1) <= scaling.MATCH_TOL


def _fake_report(teacher_gain: float, other_gain: float) -> dict:
    rungs = []
    for fam, gain in (("teacher", teacher_gain), ("gem", other_gain)):
        for i in range(4):
            flops = 1e6 * 2.0 ** (2 * i)
            seeds = [{"seed": s, "best_step": 100 + s, "samples": 128 * (100 + s),
                      "train_pflop": 3 * flops * 128 * (100 + s) / 1e15,
                      "valid": 0.2 + gain * i + 0.01 * s, "test": 0.1 + gain * i + 0.02 * s,
                      "stopped_early": True, "wall_s": 1.0} for s in range(2)]
            rungs.append({"family": fam, "index": i, "width": 16 << i, "depth": i + 1,
                          "overrides": {}, "params": 1000 * 4 ** i, "dense_flops": flops,
                          "scoring_flops": 0.0, "seeds": seeds})
    return {"task": "retrieval", "metric": "hr@10", "seeds": 2,
            "families": [{"name": "teacher", "label": "T", "preset": "p"},
                         {"name": "gem", "label": "G", "preset": "p"}], "rungs": rungs}


def test_write_report_json_table_plot(tmp_path):
    pytest.importorskip("matplotlib")
    report = scaling.write_report(_fake_report(0.01, 0.03), str(tmp_path))
    png = tmp_path / "scaling.png"
    assert png.stat().st_size > 1000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads((tmp_path / "scaling.json").read_text())
    assert {(r["family"], r["index"]) for r in saved["rungs"]} == {
        (f, i) for f in ("teacher", "gem") for i in range(4)}
    for r in saved["rungs"]:
        tests = [s["test"] for s in r["seeds"]]
        assert r["test_mean"] == pytest.approx(sum(tests) / 2)
        assert r["test_std"] == pytest.approx(abs(tests[1] - tests[0]) / math.sqrt(2))
    assert "teacher does NOT scale better than gem" in saved["verdict"]
    md = (tmp_path / "scaling.md").read_text()
    assert md.count("\n| teacher |") == 4 and md.count("\n| gem |") == 4
    assert saved == report
    better = scaling.write_report(_fake_report(0.03, 0.01), str(tmp_path / "b"))
    assert better["verdict"].startswith("teacher scales better than gem")
    # a loss falling faster with compute is the better scaling
    loss = scaling.write_report({**_fake_report(-0.03, -0.01), "metric": "loss"},
                                str(tmp_path / "c"))
    assert loss["verdict"].startswith("teacher scales better than gem")


def test_prepare_rung_refuses_another_config(tmp_path):
    a, b = get_config("tiny"), get_config("tiny", "model.dim=16")
    wd = str(tmp_path / "r0")
    os.makedirs(wd)
    with open(os.path.join(wd, "rung.json"), "w") as f:
        json.dump({"config": scaling._jsonable(a)}, f)
    with pytest.raises(ValueError, match="another config"):
        scaling.prepare_rung(b, wd, log=lambda s: None)
    with open(os.path.join(wd, "summary.json"), "w") as f:   # finished: read back, not rerun
        json.dump({"steps": 20}, f)
    assert scaling.prepare_rung(a, wd, log=lambda s: None) == {"steps": 20}


@pytest.mark.slow
def test_smoke_two_rungs_end_to_end(tmp_path):
    why = scaling.selection_available()
    if why:
        pytest.skip(why)
    if not os.path.exists(os.path.join(ML1M, "train.csv.zip")):
        pytest.skip(f"MovieLens-1M not at {ML1M}")
    """The comparison family trained alone: its rungs keep the widths matched to the
    teacher family's ladder, train side by side (--jobs=2) an epoch per jitted call,
    select on validation, test once, and rerun as reused."""
    fam = scaling.FAMILIES["retrieval"][1]
    if fam.requires():
        pytest.skip(fam.requires())
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "experiments.scaling", "--task=retrieval",
           f"--data_dir={ML1M}", f"--data_out={tmp_path / 'data'}", "--max_users=16",
           f"--out={out}", f"--families={fam.name}", "--ladder=16x1,32x1,48x2,64x4",
           "--rungs=0,1", "--epochs=1", "--valid_epochs=1", "--override=data.batch_size=4",
           "--jobs=2", "--steps_per_call=0"]
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    printed = {}                     # the ladder table: (family, rung) -> (width, GFLOP)
    for line in run.stdout.splitlines():
        cols = line.split()
        if len(cols) == 7 and cols[0] in ("gem_tower", fam.name) and cols[1].isdigit():
            printed[cols[0], int(cols[1])] = (int(cols[2]), float(cols[5]))
    assert [printed["gem_tower", i][0] for i in range(4)] == [16, 32, 48, 64]
    for i in range(4):
        assert printed[fam.name, i][1] == pytest.approx(printed["gem_tower", i][1],
                                                        rel=scaling.MATCH_TOL, abs=1e-4)
    report = json.loads((out / "scaling.json").read_text())
    assert [(r["family"], r["index"]) for r in report["rungs"]] == [(fam.name, 0), (fam.name, 1)]
    for r in report["rungs"]:
        assert r["width"] == printed[fam.name, r["index"]][0]
        (s,) = r["seeds"]
        assert s["test"] is not None and 0.0 <= s["test"] <= 1.0
        assert s["train_pflop"] == pytest.approx(3 * r["dense_flops"] * 4 * s["best_step"] / 1e15)
        wd = out / fam.name / f"r{r['index']}_s0"
        # 16 users, 4 a step: the epoch and the validation interval are 4 steps, one call
        assert json.loads((wd / "config.json").read_text())["train"]["steps_per_call"] == 4
        assert (wd / "best").is_dir()
        rows = [json.loads(line) for line in (wd / "metrics.jsonl").read_text().splitlines()]
        assert any(row.get("split") == "valid" for row in rows)
    assert (out / "scaling.png").stat().st_size > 0
    again = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0 and again.stdout.count("finished, reusing") == 2
