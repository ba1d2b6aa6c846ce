"""experiments/distill.py end to end at a toy size: the offline teacher trained and read
back from its checkpoint, every row of the table including the hierarchical one, gains
recomputed from the per-run NEs, frozen shared tables unchanged, the FLOP column equal to
forward_flops; --dataset=frappe without the converted files says so and exits 0; a
SIGTERM in a student's training ends the command with one line and exit 143.
The commands (the table, --dataset=drift, a refused --dataset=drift, --teacher_mode=cotrain,
the absent Frappe files, then the stopped one) run one after another in one child process
(tests/script_commands.py), each with the flags of its own command line."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.distill_teacher import TEACHER   # experiments/distill.py's, cheaper to compile
from tests.script_commands import child_argv, said_of
from tests.test_distill_student_signals import lock_holder

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env():
    """The children's environment: the suite's (its XLA flags and compilation cache,
    tests/conftest.py) with one CPU device, so the offline teacher trains on the
    one-device mesh the students and the co-trained teacher run on (one teacher
    program for every command)."""
    return dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1")


DATA = "--data_overrides=data.eval_batches=1,data.batch_size=32"


DRIFT = "--data_overrides=data.drift_every=2,data.batch_size=32"
COMMANDS = {   # name -> the command's flags but --out
    # every row, the hierarchical one too; the latency batch is the data's (the students'
    # eval programs)
    "table": ["--seeds=0", "--teacher_steps=4", f"--teacher_override={TEACHER}",
              "--student_steps=2", "--share=frozen",
              "--rows=none,kd,kd+adapter,+repr,+share,all", "--adapter_refresh=1",
              "--latency_batch=32", DATA],
    # a plain student, the kd+adapter one (its final adapter scores the teacher) and the
    # hierarchical row's two runs
    "drift": ["--dataset=drift", "--seeds=0", "--teacher_steps=4", f"--teacher_override={TEACHER}",
              "--student_steps=2",
              "--rows=none,kd+adapter", "--latency_batch=0", "--adapter=features",
              "--adapter_features=dense,student", DRIFT],
    # refused before any model is built: 3 teacher steps are not whole windows of 2
    "drift_refused": ["--dataset=drift", "--teacher_steps=3", DRIFT],
    # one student: the KD row, whose loss reads the co-trained teacher's logits
    "cotrain": ["--seeds=0", "--teacher_steps=4", f"--teacher_override={TEACHER}",
                "--student_steps=2", "--teacher_mode=cotrain",
                "--rows=kd", "--latency_batch=0",
                "--data_overrides=data.eval_batches=1,data.batch_size=32"],
    "frappe": ["--dataset=frappe"],     # --frappe_dir: a directory that is not there
    # from the table's finished teacher run (copied), the table's kd student; stopped by
    # SIGTERM in its training (GEMJAX_TEST_PAUSE holds it after its first step until then)
    "stop": ["--seeds=0", "--teacher_steps=4", f"--teacher_override={TEACHER}",
             "--student_steps=2", "--rows=kd", "--nohierarchical", "--latency_batch=0", DATA],
}
STOPPED = os.path.join("synthetic", "students", "kd_s0")    # the stop command's student run

class Command:
    """One command of the shared child: its --out, its exit code (0 when it returned, else
    the child's), the child's stderr and the command's own stdout."""

    def __init__(self, out, returncode, stdout, stderr):
        self.out, self.returncode, self.stdout, self.stderr = out, returncode, stdout, stderr


@pytest.fixture(scope="module")
def commands(tmp_path_factory):
    """{name: Command} of COMMANDS, run in order in one child process; the last, "stop",
    gets SIGTERM once its student's run holds its workdir."""
    root = tmp_path_factory.mktemp("commands")
    outs = {name: str(root / name) for name in COMMANDS}
    extra = {"frappe": [f"--frappe_dir={root}/absent"]}
    teacher = os.path.join("synthetic", "teacher_s0")
    copy = {"stop": [os.path.join(outs["table"], teacher), os.path.join(outs["stop"], teacher)]}
    env = {"stop": {"GEMJAX_TEST_PAUSE": "step:1"}}
    spec = [[name, [f"--out={outs[name]}", *flags, *extra.get(name, [])],
             {"copy": copy.get(name), "env": env.get(name, {}), "go_on": name == "drift_refused"}]
            for name, flags in COMMANDS.items()]
    out, err = open(root / "stdout", "w+"), open(root / "stderr", "w+")
    p = subprocess.Popen(child_argv("distill", "run", spec), cwd=ROOT, env=_env(),
                         stdout=out, stderr=err, text=True)
    lock, deadline = os.path.join(outs["stop"], STOPPED, "train.lock"), time.time() + 900
    while lock_holder(lock) != p.pid and p.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    p.wait(timeout=300)
    stdout, stderr = (open(f.name).read() for f in (out, err))
    said = said_of(stdout)
    return {name: Command(outs[name], 0 if f"[test] finished {name}" in said.get(name, "")
                          else p.returncode, said.get(name, ""), stderr)
            for name in COMMANDS}


@pytest.fixture(scope="module")
def table_run(commands):
    """The table command: (its --out, the process)."""
    c = commands["table"]
    return c.out, c


@pytest.mark.slow
def test_distill_experiment_table(table_run, commands):
    root, p = table_run
    assert p.returncode == 0, p.stderr[-3000:]
    out = os.path.join(root, "synthetic")
    res = json.load(open(os.path.join(out, "results.json")))
    rows = ["none", "kd", "kd+adapter", "+repr", "+share", "all", "hier"]
    assert sorted({r["row"] for r in res["runs"]}) == sorted(rows)
    for row in rows:
        ne = {r["seed"]: r["ne"] for r in res["runs"] if r["row"] == row}
        base = {r["seed"]: r["ne"] for r in res["runs"] if r["row"] == "none"}
        assert res["summary"][row]["ne"] == [ne[0]]
        np.testing.assert_allclose(res["summary"][row]["gain"], [base[0] - ne[0]])
        assert all(np.isfinite(v) for v in ne.values())
    assert all(r["shared_tables_unchanged"] for r in res["runs"] if r["row"] in ("+share", "all"))
    assert len(res["summary"]["teacher_ne"]) == 1
    assert os.path.exists(os.path.join(out, "teacher_s0", "summary.json"))   # offline checkpoint
    # every student (the domain model too) is a run whose summary holds the table's NE
    for row, name in (("none", "none"), ("kd+adapter", "kd_adapter"), ("+repr", "repr"),
                      ("all", "all"), ("hier", "hier")):
        wd = os.path.join(out, "students", f"{name}_s0")
        for f in ("config.json", "metrics.jsonl", "summary.json", "student.json", "checkpoints"):
            assert os.path.exists(os.path.join(wd, f)), (row, f)
        got = json.load(open(os.path.join(wd, "summary.json")))["eval_ne"]
        assert got == next(r["ne"] for r in res["runs"] if r["row"] == row)
    assert os.path.exists(os.path.join(out, "students", "hier_domain_s0", "summary.json"))
    # the budget's FLOPs are the student's analytic count for its config
    from gemjax.config import apply_overrides, get_config
    from gemjax.models.student import forward_flops
    sys.path.insert(0, ROOT)
    from experiments import distill
    base_cfg = apply_overrides(get_config("tiny", distill.SYNTHETIC_DATA),
                               "data.eval_batches=1,data.batch_size=32")
    scfg = apply_overrides(base_cfg, distill.STUDENT)
    budget = {b["model"]: b for b in res["budget"]}
    assert budget["student"]["flops_per_sample"] == forward_flops(scfg)
    assert budget["student+share"]["own_table_bytes"] == 0
    assert all(b["latency_ms_b512"] > 0 for b in res["budget"])
    table = open(os.path.join(out, "table.md")).read()
    assert "| student all |" in table and "combined gain / KD gain" in table

    p = commands["frappe"]
    assert p.returncode == 0 and "no converted Frappe" in p.stdout


def test_distill_drift_evaluates_on_an_unseen_window(commands):
    """--dataset=drift (windows of 2 steps, the features Student Adapter): the teacher
    reads steps 0-3, every student (and the domain model) 4-5, and every row, the
    teacher included, is evaluated on window 3 (steps 6-7) only, as recorded by the
    source each model read; the Bayes NE it reports is that of window 3's planted
    model, recomputed here from the stream; steps that are not whole windows are
    refused naming the flag (app.UsageError: exit 1 from the command line)."""
    p = commands["drift"]
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.load(open(os.path.join(p.out, "drift", "results.json")))
    steps = res["drift_steps"]["0"]
    assert steps["eval_window"] == 3 and steps["eval"] == [6, 8]
    models = steps["models"]
    assert sorted(models) == sorted(["teacher", "none", "kd+adapter", "hier/domain", "hier",
                                     "teacher+adapter"])
    assert models["teacher"]["train"] == [0, 1, 2, 3]
    for name, used in models.items():
        assert used["eval"] == [6, 7], name
        assert not set(used["eval"]) & set(used["train"]), name
        if name not in ("teacher", "teacher+adapter"):
            assert used["train"] == [4, 5], name
    assert models["teacher+adapter"]["train"] == []     # the teacher's logits, scored only
    assert {r["row"] for r in res["runs"]} == {"none", "kd+adapter", "hier"}
    assert all(np.isfinite(r["ne"]) for r in res["runs"])
    assert np.isfinite(res["summary"]["teacher_adapter"][0]["ne"])   # the feature adapter's line

    # the Bayes NE of the eval window, from window 3's true probabilities
    sys.path.insert(0, ROOT)
    from experiments import distill
    from gemjax.data.drift import DriftingStream
    from gemjax.config import schema_of
    from gemjax.train.metrics import EvalAccumulator
    cfg = distill.base_config("drift", "", "data.drift_every=2,data.batch_size=32")
    stream = DriftingStream(cfg.data, 0)
    acc = EvalAccumulator(schema_of(cfg).num_surfaces, schema_of(cfg).num_tasks)
    for step in (6, 7):
        b, info = stream.shard_batch(step)
        acc.add(info.true_probs, b.labels, b.label_mask, b.surface, b.weights)
    np.testing.assert_allclose(res["summary"]["bayes_ne"], [acc.result()["ne"]], rtol=1e-6)

    p = commands["drift_refused"]
    assert "[test] exit 1" in p.stdout and "[test] finished" not in p.stdout, p.stdout
    assert "usage error: --dataset=drift: --teacher_steps=3 must be a positive multiple" in p.stdout
    assert not os.listdir(os.path.join(p.out, "drift"))          # refused before any run


def test_distill_cotrain_students_are_runs(commands):
    """--teacher_mode=cotrain: the (KD) student is a run whose co-trained teacher is a run
    inside it (WORKDIR/teacher, checkpointed at the student's steps); the table's teacher
    NE is the first row's teacher read back from there."""
    p = commands["cotrain"]
    assert p.returncode == 0, p.stderr[-3000:]
    out = os.path.join(p.out, "synthetic")
    res = json.load(open(os.path.join(out, "results.json")))
    assert {r["row"] for r in res["runs"]} == {"kd"}
    for name in ("kd",):
        wd = os.path.join(out, "students", f"{name}_s0")
        assert json.load(open(os.path.join(wd, "student.json")))["teacher"] == {"cotrained": "teacher"}
        assert os.listdir(os.path.join(wd, "teacher", "checkpoints")) == ["2"]
    sys.path.insert(0, ROOT)
    import jax
    from gemjax.distill.transfer import Teacher, evaluate
    from gemjax.train.step import default_mesh
    mesh = default_mesh(jax.devices()[:1])
    t = Teacher.from_workdir(os.path.join(out, "students", "kd_s0", "teacher"), mesh=mesh)
    step = t.trainer.make_eval_step()
    ne = evaluate(t.cfg, lambda b: step(t.state, b), mesh)["ne"]
    assert res["summary"]["teacher_ne"] == [ne]


def test_distill_stop_is_one_line_and_exit_143(commands):
    """SIGTERM once a student's run has started: the command ends with one line and exit
    143, no traceback, the student's run stopped mid-training (the exact resume:
    tests/test_distill_runs.py). The teacher is the table command's finished run (the
    same teacher flags: reused, not retrained)."""
    p = commands["stop"]
    assert p.returncode == 143, p.stderr[-3000:]
    assert "Traceback" not in p.stderr and "Traceback" not in p.stdout
    assert p.stdout.strip().splitlines()[-1].startswith("[distill] stopped by SIGTERM")
    wd = os.path.join(p.out, STOPPED)
    assert os.path.exists(os.path.join(wd, "config.json"))
    assert not os.path.exists(os.path.join(wd, "summary.json"))      # stopped mid-run
    assert not os.path.exists(os.path.join(p.out, "synthetic", "results.json"))
