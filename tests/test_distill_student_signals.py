"""Students of experiments/distill.py as runs, end to end through the command: on the
drifting stream (a +repr student, its teacher folded into the export) and on Frappe-
style converted files (a tiny stand-in written here; a kd+adapter student). An
uninterrupted command runs first; its finished student is exported and reloaded in a
fresh process (load_exported, before that process builds anything else), whose
predictions on the eval rows, built there without the run's source (drift:
DriftingStream steps T + S on), equal load_student's to 1e-6 and give the run's eval NE
to 1e-6. A second command from the same finished teacher run (copied: not retrained)
is stopped by a real SIGTERM in the student's training (exit 143, one line, no
traceback), then, on the drift stream, by SIGINT in the resumed training (exit 130),
then rerun to the end: the student's checkpointed params and its eval rows equal those
of the uninterrupted command's. The commands run in child processes (tests/script_commands), each
with the flags of its own command line: one process runs both scenarios' uninterrupted
and stopped commands one after another (the module fixture; each signal sent once the
student's run of that command holds its workdir), then one fresh process per scenario
reloads its export and reruns the stopped command to the end.
make_source's drifting stream is checked step by step against DriftingStream."""

import json
import os
import signal
import subprocess
import time

import jax
import numpy as np
import pytest

from gemjax.config import apply_overrides, get_config
from suite_cache import with_suite_cache   # tests/suite_cache.py
from tests.distill_teacher import TEACHER   # experiments/distill.py's, cheaper to compile
from tests.script_commands import child_argv, said_of

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DRIFT = "data.drift_every=2,data.batch_size=32"


def test_make_source_reads_the_drifting_stream_from_drift_start():
    from gemjax.data.drift import DriftingStream
    from gemjax.data.source import make_source
    cfg = get_config("tiny", f"{DRIFT},data.drift_strength=0.5,data.drift_start=4,"
                             f"train.steps=2,data.eval_batches=2")
    ref = DriftingStream(cfg.data, cfg.train.seed)
    for stream, steps in (("train", (4, 5)), ("eval", (6, 7))):
        src = make_source(cfg, stream)
        for i, step in enumerate(steps):
            got, want = src.shard_batch(i, 1, 2)[0], ref.shard_batch(step, 1, 2)[0]
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
                np.testing.assert_array_equal(a, b)
    # drift_start moves the samples (the check can fail)
    first = make_source(apply_overrides(cfg, "data.drift_start=0"), "train").shard_batch(0, 1, 2)[0]
    assert not np.array_equal(first.dense, make_source(cfg, "train").shard_batch(0, 1, 2)[0].dense)
    with pytest.raises(ValueError, match="new_id_rate"):
        make_source(apply_overrides(cfg, "data.new_id_rate=0.1"), "train")
    with pytest.raises(ValueError, match="data.drift.start must be >= 0"):
        get_config("tiny", "data.drift_start=-1")


def _child(commands, prelude=""):
    """The command line of a child running experiments/distill.py's `commands` ([name,
    argv] or [name, argv, opts]: tests/script_commands) one after another, after
    `prelude`."""
    return child_argv("distill", "run", commands, prelude=prelude)


def _env():
    # the suite's XLA flags (tests/conftest.py), compilation cache and CPU device count: the
    # children share programs with each other and with this process (the cache keys a
    # program by the device count too)
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(len(jax.devices("cpu"))))
    env.pop("GEMJAX_TEST_PAUSE", None)
    return with_suite_cache(env)


def lock_holder(lock):
    """The pid WORKDIR/train.lock names (None while absent or half written)."""
    try:
        with open(lock) as f:
            return json.load(f).get("pid")
    except (OSError, ValueError):
        return None


def _mtime(path):
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


def _stopped(commands, stops):
    """Run the child of `commands`, send each signal of `stops` [(student workdir, signal)] in
    turn once a student run holds that workdir (its train.lock names this process, written
    after the previous signal to that workdir: a run that took the lock since); returns
    (rc, stdout, stderr)."""
    p = subprocess.Popen(_child(commands), cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    deadline, seen = time.time() + 500, {}
    for wd, sig in stops:
        lock = os.path.join(wd, "train.lock")
        while ((lock_holder(lock) != p.pid or _mtime(lock) == seen.get(lock)) and
               p.poll() is None and time.time() < deadline):
            time.sleep(0.05)
        seen[lock] = _mtime(lock)
        p.send_signal(sig)
    out, err = p.communicate(timeout=500)
    return p.returncode, out, err


def _params(wd):
    from gemjax.serve.restore import restore
    run = restore(wd, log=lambda s: None)
    return run.step, [np.asarray(x) for x in jax.tree.leaves(jax.device_get(run.state["params"]))]


def _eval_rows(wd):
    """The eval rows of metrics.jsonl without the throughput (wall-clock) figure."""
    with open(os.path.join(wd, "metrics.jsonl")) as f:
        return [{k: v for k, v in r.items() if k != "samples_per_sec"}
                for r in map(json.loads, f) if r["kind"] == "eval"]


# the export reloaded first in a fresh child, before anything else is built there: its
# predictions saved to PREDS, its NE printed ("export NE ...")
_RELOAD = """
import numpy as np
from gemjax.config import schema_of
from gemjax.serve.export import load_exported
from gemjax.train.metrics import EvalAccumulator
sys.path.insert(0, {root!r} + "/tests")
from test_distill_student_signals import eval_batches
model = load_exported({export!r})
cfg = model.config
acc = EvalAccumulator(schema_of(cfg).num_surfaces, schema_of(cfg).num_tasks)
preds = []
for b in eval_batches(cfg):
    p = np.asarray(model(b))
    preds.append(p)
    acc.add(p, b.labels, b.label_mask, b.surface, b.weights)
np.save({preds!r}, np.concatenate(preds))
print("export NE", repr(acc.result()["ne"]), flush=True)
"""


def eval_batches(cfg):
    """The eval rows of a student's run, one-shard batches: drift, DriftingStream steps
    from data.drift_start + train.steps (data.eval_batches of them); else every batch of
    the eval files (make_source, OneEpoch)."""
    if cfg.data.drift.every:
        from gemjax.data.drift import DriftingStream
        stream, start = DriftingStream(cfg.data, cfg.train.seed), cfg.data.drift.start + cfg.train.steps
        return [stream.shard_batch(start + i)[0] for i in range(cfg.data.eval_batches)]
    from gemjax.data.source import eval_steps, make_source
    src = make_source(cfg, "eval")
    return [src.shard_batch(i, 0, 1)[0] for i in range(eval_steps(src, cfg))]


SCENARIOS = {   # name -> (the command's flags but --out, the student's run, its stops)
    "drift": (["--dataset=drift", "--seeds=0", "--teacher_steps=4",
               f"--teacher_override={TEACHER}", "--student_steps=12", "--rows=+repr",
               "--nohierarchical", "--latency_batch=0", "--adapter_refresh=5",
               "--repr_norm=standardize", f"--data_overrides={DRIFT}"],
              "repr_s0", [(signal.SIGTERM, 143), (signal.SIGINT, 130)]),
    # --frappe_dir: the converted stand-in of the fixture
    "frappe": (["--dataset=frappe", "--seeds=0", "--teacher_steps=4",
                f"--teacher_override={TEACHER}", "--student_steps=12", "--rows=kd+adapter",
                "--nohierarchical", "--latency_batch=0", "--data_overrides=data.batch_size=16"],
               "kd_adapter_s0", [(signal.SIGTERM, 143)]),
}


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """Every scenario's uninterrupted command and stopped commands (module docstring) run
    one after another in one child: {"root", "rc", "said": {command name: its stdout},
    "stderr"}; a scenario's command NAME runs in ROOT/NAME/whole, its stopped ones
    ("NAME stop I", the I-th signal) in ROOT/NAME/part from a copy of the whole one's
    teacher run. The Frappe files: a converted stand-in (tests/test_converters.write_frappe,
    a few hundred rows) in place of /work/shared's, ROOT/frappe_files."""
    from experiments import convert_frappe
    from tests.test_converters import write_frappe
    root = tmp_path_factory.mktemp("signals")
    raw = root / "raw"
    raw.mkdir()
    write_frappe(raw, n_valid=300, n_test=120)
    convert_frappe.convert(str(raw), str(root / "frappe_files"))
    commands, stops = [], []
    for name, (args, student, signals) in SCENARIOS.items():
        args = _args(root, name)
        whole, part = root / name / "whole", root / name / "part"
        commands.append([name, [*args, f"--out={whole}"]])
        copy = [str(whole / name / "teacher_s0"), str(part / name / "teacher_s0")]
        commands += [[f"{name} stop {i}", [*args, f"--out={part}"],
                      {"go_on": True, **({"copy": copy} if i == 0 else {})}]
                     for i in range(len(signals))]
        stops += [(str(part / name / "students" / student), sig) for sig, _ in signals]
    rc, stdout, stderr = _stopped(commands, stops)
    return {"root": root, "rc": rc, "said": said_of(stdout), "stderr": stderr}


def _args(root, name):
    """The flags of scenario `name`'s command but --out."""
    args = SCENARIOS[name][0]
    return [*args, f"--frappe_dir={root / 'frappe_files'}"] if name == "frappe" else args


def _check(stopped, name, tmp_path):
    """The scenario of the module docstring for SCENARIOS[name]; returns the stopped
    student's run."""
    from gemjax.distill.runs import export_student, load_student
    _, student, signals = SCENARIOS[name]
    root, said = stopped["root"], stopped["said"]
    whole, part = str(root / name / "whole"), str(root / name / "part")
    wd = os.path.join(part, name, "students", student)
    ref = os.path.join(whole, name, "students", student)
    exported, saved = str(tmp_path / "export"), str(tmp_path / "preds.npy")
    assert stopped["rc"] == 0, stopped["stderr"][-3000:]
    assert "Traceback" not in stopped["stderr"] + "".join(said.values())
    assert os.path.exists(os.path.join(whole, name, "results.json")), said.get(name)
    # the stopped command ends with one line and 128 + signal; stopped in training, it is
    # resumed by the next one
    for i, (sig, rc) in enumerate(signals):
        lines = said.get(f"{name} stop {i}", "").strip().splitlines()
        assert lines[-1:] == [f"[test] exit {rc}"], said
        assert lines[-2].startswith(f"[distill] stopped by {signal.Signals(sig).name}"), said
    assert not os.path.exists(os.path.join(wd, "summary.json"))     # stopped mid-run
    export_student(ref, exported, log=lambda s: None)
    # one fresh process reloads the export (its predictions and NE: checked below), nothing
    # else built there yet; then it reruns the stopped command to the end
    command = [*_args(root, name), f"--out={part}"]
    reload = _RELOAD.format(root=ROOT, export=exported, preds=saved)
    p = subprocess.run(_child([["rerun", command]], prelude=reload), cwd=ROOT, env=_env(), capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Traceback" not in p.stderr + p.stdout
    export_ne = float(next(line for line in p.stdout.splitlines()
                           if line.startswith("export NE ")).split()[-1])
    (step, got), (ref_step, want) = _params(wd), _params(ref)
    assert step == ref_step and len(got) == len(want)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    assert _eval_rows(wd) == _eval_rows(ref)
    res = [json.load(open(os.path.join(o, name, "results.json")))["runs"] for o in (part, whole)]
    assert [r["ne"] for r in res[0]] == [r["ne"] for r in res[1]]

    # the export reloaded in the fresh process: its predictions and NE are the runs'
    for run in (wd, ref):
        summary = json.load(open(os.path.join(run, "summary.json")))
        assert abs(export_ne - summary["eval_ne"]) <= 1e-6, run
    pred = load_student(wd)
    mine = np.concatenate([np.asarray(pred(b)) for b in eval_batches(pred.cfg)])
    np.testing.assert_allclose(np.load(saved), mine, atol=1e-6, rtol=0)
    return wd


@pytest.mark.slow
def test_drift_student_resumes_after_signals_and_exports(stopped, tmp_path):
    wd = _check(stopped, "drift", tmp_path)
    cfg = json.load(open(os.path.join(wd, "config.json")))
    assert cfg["data"]["drift"]["start"] == 4 and cfg["data"]["eval_batches"] == 2
    manifest = json.load(open(os.path.join(tmp_path, "export", "manifest.json")))
    assert any(k.startswith("teacher/") for k in manifest["inputs"]["tables"])


@pytest.mark.slow
def test_frappe_style_student_resumes_after_sigterm_and_exports(stopped, tmp_path):
    """A converted Frappe stand-in (the fixture's) in place of /work/shared's."""
    _check(stopped, "frappe", tmp_path)
