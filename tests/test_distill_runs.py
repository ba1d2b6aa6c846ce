"""Students as runs (gemjax.distill.runs): a student trained through train() in its own
workdir, stopped and resumed, ends with the eval of an uninterrupted one (the Distiller's
host state travels in the checkpoints); the serve paths read a plain student as any run;
a repr student's export computes its teacher's features itself and reproduces the
student's eval in a fresh process with the teacher's run gone."""

import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from experiments import distill as distill_exp
from gemjax.config import apply_overrides, get_config, schema_of
from gemjax.distill.runs import (evaluate_student, export_student, load_student, read_record,
                                 train_student)
from gemjax.distill.transfer import DistillConfig, Teacher
from gemjax.serve.evaluate import evaluate_checkpoint
from gemjax.serve.export import export_model
from gemjax.serve.inference import load_for_inference
from gemjax.train.guards import ResumeMismatch
from gemjax.train.loop import train
from gemjax.train.step import default_mesh
from tests.distill_teacher import TEACHER   # experiments/distill.py's, cheaper to compile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = ("data.batch_size=32,data.eval_batches=2,train.tensorboard=false,"
        "train.baselines=false")
# every host-side piece of the Distiller: the adapter (refit each step), the repr cache,
# the normaliser's statistics and the dropout draws
ONE = default_mesh(jax.devices()[:1])
REPR = DistillConfig(methods="kd,adapter,repr", adapter_refresh=1, adapter_window=64,
                     repr_window=2, repr_norm="standardize", repr_dropout=0.3)


def _cfg(override, steps, seed=0):
    base = apply_overrides(get_config("tiny", distill_exp.SYNTHETIC_DATA), DATA)
    return distill_exp.model_config(base, override, steps, seed)


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    wd = str(tmp_path_factory.mktemp("teacher") / "teacher")
    train(_cfg(TEACHER, 4), wd, log=lambda s: None, mesh=ONE)
    return wd


@pytest.fixture(scope="module")
def teacher(teacher_dir):
    """The offline teacher of every student here: one Teacher read from teacher_dir (its
    state is only read), so its outputs program is traced once."""
    return Teacher.from_workdir(teacher_dir, mesh=ONE)


def _eval_rows(wd):
    with open(os.path.join(wd, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["kind"] == "eval"]


def test_stopped_and_resumed_student_equals_uninterrupted(teacher_dir, teacher, repr_student,
                                                         tmp_path):
    # the uninterrupted run: the module's repr student (REPR, 4 steps)
    scfg = _cfg(distill_exp.STUDENT, 4)
    whole = repr_student[1]
    part = str(tmp_path / "part")
    got = train_student(scfg, part, teacher, REPR, log=lambda s: None, stop_after=2)
    assert got == {"steps": 2, "stopped_early": True}
    lost = str(tmp_path / "lost")
    shutil.copytree(part, lost)
    resumed = train_student(scfg, part, teacher, REPR, log=lambda s: None)
    assert abs(resumed["eval_ne"] - whole["eval_ne"]) <= 1e-6
    assert abs(resumed["eval_auc"] - whole["eval_auc"]) <= 1e-6
    for name in ("checkpoints", "config.json", "metrics.jsonl", "summary.json"):
        assert os.path.exists(os.path.join(part, name)), name
    rec = read_record(part)
    assert rec["teacher"] == {"workdir": os.path.abspath(teacher_dir), "step": 4}
    assert rec["distill"]["methods"] == "kd,adapter,repr"

    # without the host state the resumed student differs (the test can fail): the same
    # stop and resume with the adapter, cache, normaliser and generator reset
    from gemjax.distill.runs import StudentTrainer
    orig = StudentTrainer.resume_meta
    StudentTrainer.resume_meta = lambda self, meta: None
    try:
        forgot = train_student(scfg, lost, teacher, REPR, log=lambda s: None)
    finally:
        StudentTrainer.resume_meta = orig
    assert abs(forgot["eval_ne"] - whole["eval_ne"]) > 1e-6

    # eval-only of the repr student (its features from the teacher run) = the run's eval row
    row = evaluate_student(part, mesh=ONE, log=lambda s: None)
    assert abs(row["ne"] - resumed["eval_ne"]) <= 1e-6
    # the plain serve paths refuse it, naming the way
    for call in (lambda: load_for_inference(part), lambda: evaluate_checkpoint(part, None, ONE, log=print),
                 lambda: export_model(part, log=print)):
        with pytest.raises(ValueError, match="teacher_repr_dim.*gemjax.distill.runs"):
            call()
    # another DistillConfig on the same workdir: refused
    with pytest.raises(ResumeMismatch, match="distill"):
        train_student(scfg, part, teacher, DistillConfig(methods="kd"), log=lambda s: None)


def test_cotrained_student_run_resumes_with_its_teacher(tmp_path):
    """--teacher_mode=cotrain as a run: the fresh teacher that trains beside the student
    is checkpointed in WORKDIR/teacher at every student checkpoint's step; stopped and
    resumed, student and teacher end as in an uninterrupted run (and differ when the
    resume keeps the fresh teacher: the test can fail); the student's eval reads back."""
    import jax
    from gemjax.serve.restore import restore
    from gemjax.train.step import Trainer
    tcfg, scfg = _cfg(TEACHER, 4), _cfg(distill_exp.STUDENT, 4)
    dcfg = DistillConfig(methods="kd,adapter,repr", adapter_refresh=1, adapter_window=64,
                         teacher_mode="cotrain")

    tr = Trainer.create(tcfg, ONE)
    teacher = Teacher(tr, None)
    init = tr.init_state(0)
    host = jax.device_get(init)

    def fresh():
        """The teacher at its initial state: one Teacher (its programs traced once), its
        state reset for every run (new device buffers of the one initial state)."""
        teacher.state = jax.tree.map(lambda h, d: jax.device_put(h, d.sharding), host, init)
        return teacher

    def leaves(wd):
        return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(restore(wd, log=lambda s: None).state["params"]))]

    whole, part, lost = (str(tmp_path / n) for n in ("whole", "part", "lost"))
    want = train_student(scfg, whole, fresh(), dcfg, log=lambda s: None)
    assert train_student(scfg, part, fresh(), dcfg, log=lambda s: None, stop_after=2)["steps"] == 2
    shutil.copytree(part, lost)
    got = train_student(scfg, part, fresh(), dcfg, log=lambda s: None)
    assert got["eval_ne"] == want["eval_ne"] and got["eval_auc"] == want["eval_auc"]
    for sub in ("", "teacher"):
        for a, b in zip(leaves(os.path.join(part, sub)), leaves(os.path.join(whole, sub)), strict=True):
            np.testing.assert_array_equal(a, b)
    assert read_record(part)["teacher"] == {"cotrained": "teacher"}
    assert Teacher.from_workdir(os.path.join(part, "teacher"), mesh=ONE).step == 4
    from gemjax.distill.runs import StudentTrainer
    orig = StudentTrainer.resume_meta
    StudentTrainer.resume_meta = lambda self, meta: orig(
        StudentTrainer(self.distiller), meta)     # the host state, not the teacher's
    try:
        forgot = train_student(scfg, lost, fresh(), dcfg, log=lambda s: None)
    finally:
        StudentTrainer.resume_meta = orig
    assert forgot["eval_ne"] != want["eval_ne"]
    assert abs(evaluate_student(part, mesh=ONE, log=lambda s: None)["ne"] - want["eval_ne"]) <= 1e-6


def test_plain_student_is_served_as_any_run(teacher_dir, teacher, tmp_path):
    """A kd+adapter+share student: train.py --mode=eval, load_for_inference and
    export_model read its workdir with no teacher (the run's eval reproduced)."""
    wd = str(tmp_path / "kd")
    summary = train_student(_cfg(distill_exp.STUDENT, 3), wd, teacher,
                            DistillConfig(methods="kd,adapter,share", share="tuned"),
                            log=lambda s: None)
    shutil.move(teacher_dir, teacher_dir + ".away")
    try:
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        p = subprocess.run([sys.executable, "-m", "experiments.train", "--mode=eval",
                            f"--workdir={wd}"], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        row = json.load(open(os.path.join(wd, "eval", "step_3.json")))
        assert row["ne"] == _eval_rows(wd)[-1]["ne"] == summary["eval_ne"]
        pred = load_for_inference(wd)
        assert pred.step == 3
        out = export_model(wd, log=lambda s: None)
        assert os.path.exists(os.path.join(out, "model.jax_exported"))
    finally:
        shutil.move(teacher_dir + ".away", teacher_dir)


_FRESH = """
import sys
import numpy as np
from gemjax.config import schema_of
from gemjax.data.source import eval_steps, make_source
from gemjax.serve.export import load_exported
from gemjax.train.metrics import EvalAccumulator
model = load_exported(sys.argv[1])
cfg = model.config
stream = make_source(cfg, "eval")
acc = EvalAccumulator(schema_of(cfg).num_surfaces, schema_of(cfg).num_tasks)
for i in range(eval_steps(stream, cfg)):
    b, _ = stream.shard_batch(i, 0, 1)
    acc.add(model(b), b.labels, b.label_mask, b.surface, b.weights)
r = acc.result()
print("NE", repr(r["ne"]), "AUC", repr(r["auc"]))
"""


@pytest.fixture(scope="module")
def repr_student(teacher, tmp_path_factory):
    wd = str(tmp_path_factory.mktemp("repr") / "repr")
    summary = train_student(_cfg(distill_exp.STUDENT, 4), wd, teacher, REPR,
                            log=lambda s: None)
    return wd, summary


def test_repr_student_exports_self_contained(teacher_dir, repr_student, tmp_path):
    """export_student folds the teacher's representation into the export; a fresh process
    with the teacher's run moved away reproduces the student's eval NE and AUC."""
    wd, summary = repr_student
    out = export_student(wd, str(tmp_path / "export"), log=lambda s: None)
    manifest = json.load(open(os.path.join(out, "manifest.json")))
    assert manifest["teacher"]["workdir"] == os.path.abspath(teacher_dir)
    assert any(k.startswith("teacher/") for k in manifest["inputs"]["tables"])
    assert "teacher_repr/std" in manifest["inputs"]["params"]
    assert not any(k.startswith("teacher") for k in manifest["inputs"]["batch"])
    moved = str(tmp_path / "teacher-gone")
    shutil.move(teacher_dir, moved)
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
        p = subprocess.run([sys.executable, "-c", _FRESH, out], cwd=ROOT, capture_output=True,
                           text=True, timeout=300, env={**env, "JAX_PLATFORMS": "cpu"})
    finally:
        shutil.move(moved, teacher_dir)
    assert p.returncode == 0, p.stderr[-3000:]
    _, ne, _, auc = p.stdout.split()[-4:]
    assert abs(float(ne) - summary["eval_ne"]) <= 1e-6
    assert abs(float(auc) - summary["eval_auc"]) <= 1e-6
    # the same predictions through load_student (the teacher's features from its run)
    pred = load_student(wd)
    assert pred.step == 4


def _bench(args, cwd):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "benchmarks.bench_serve", *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=600)


def test_bench_serve_smoke(teacher_dir, repr_student, tmp_path):
    """benchmarks/bench_serve.py at a tiny batch on CPU: a row per model and path,
    finite figures, each model's NE from its run (no timing assertions)."""
    wd, summary = repr_student
    out = tmp_path / "bench.json"
    p = _bench([f"--teacher={teacher_dir}", f"--student={wd}", "--batches=3", "--iters=2",
                "--warmup=1", f"--out={out}", f"--export_dir={tmp_path / 'exports'}"], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.load(open(out))
    got = {(r["model"], r["batch"], r["path"]) for r in res["rows"]}
    assert got == {(m, 3, k) for m in ("teacher", "student") for k in ("jitted", "exported")}
    assert all(np.isfinite([r["p50_ms"], r["p99_ms"], r["samples_per_s"]]).all() and
               r["p99_ms"] >= r["p50_ms"] > 0 for r in res["rows"])
    assert res["eval_ne"] == {"teacher": json.load(open(os.path.join(teacher_dir, "summary.json")))
                              ["eval_ne"], "student": summary["eval_ne"]}
    assert "| student | 3 | exported |" in p.stdout


def test_bench_serve_help_and_bad_flags(tmp_path):
    p = _bench(["--help"], tmp_path)       # absl's --help prints the usage and exits 1
    assert p.returncode in (0, 1) and "Traceback" not in p.stderr
    assert "Serving figures" in p.stdout and "--teacher" in p.stdout and "--batches" in p.stdout
    p = _bench([f"--teacher={tmp_path}", f"--student={tmp_path}"], tmp_path)
    assert p.returncode != 0 and "no config.json" in p.stderr
