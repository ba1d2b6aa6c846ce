"""Faults injected into real runs: signals, kill -9 mid-save, damaged checkpoints, a NaN
state, a second run on the workdir, resumes that do not fit, bad config values.

The signal tests drive `experiments/train.py` subprocesses (tiny preset). Those of the
synthetic stream have this process's CPU device count (JAX_NUM_CPU_DEVICES,
`Run(..., devices=DEVICES)`), so a child and this process build the same programs on the
default layout over every device, and the suite's compilation cache serves each of them
to both (the cache keys a program by the device count of its process too); the Parquet
test's children keep one device. GEMJAX_TEST_PAUSE (gemjax.train.guards,
gemjax.train.checkpoint) holds a run at a known point and prints a line, and the test
signals it once that line appears. The reference for "nothing lost" is an uninterrupted
run of the same command (for the synthetic stream: train() in this process with the
command's layout, `train_here`, which also finishes the interrupted runs there): the
resumed run's final checkpoint must equal it array for array, its eval rows digit for digit.
"""

import dataclasses
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from gemjax.config import apply_overrides, get_config
from gemjax.train.checkpoint import CheckpointDamaged, CheckpointMismatch, Checkpointer
from gemjax.train.guards import ResumeMismatch, WorkdirBusy, check_resume
from gemjax.train import layout
from gemjax.train.loop import _resume, restore_train_state, train
from gemjax.train.step import Trainer
from script_commands import child_argv      # tests/script_commands.py
from suite_cache import with_suite_cache   # tests/suite_cache.py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OVERRIDES = "train.log_every=2,train.eval_every=4,train.checkpoint_every=3,data.eval_batches=1"
ARGS = ["--config=tiny", "--steps=8", f"--override={OVERRIDES}"]
CFG = apply_overrides(get_config("tiny"), OVERRIDES + ",train.steps=8")
DEVICES = jax.device_count()      # the children's CPU devices: this process's (module docstring)


class Run:
    """`python -m module` (experiments/train.py by default) on `workdir` in a subprocess;
    its output collected by a thread. It shares the suite's compilation cache, every program
    stored: the later runs of a test (resumes, references) read back the first one's.
    then: more workdirs the same experiments/train.py command runs on after `workdir`, one
    after another in the same process (an uninterrupted reference after the last resume:
    the imports and the programs already built are not paid again); an item
    (workdir, args) runs that workdir with its own args instead, (workdir, args, pause)
    with GEMJAX_TEST_PAUSE=pause too. A command with a pause other than the last one is
    the one a test signals: its exit code (main's sys.exit, 128 + signal) is printed as
    "[test] exit CODE" and the next command runs in the same process; any other command
    that exits ends the process with its code (the last one's is the process's).
    devices: the child's CPU device count (JAX_NUM_CPU_DEVICES; None: JAX's default, one).
    cmd: the child's whole command line instead (workdir, args, module and then unused)."""

    def __init__(self, workdir, pause=None, args=ARGS, module="experiments.train", then=(),
                 devices=None, cmd=None):
        env = with_suite_cache(dict(os.environ, PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu"))
        given = cmd
        env.pop("GEMJAX_TEST_PAUSE", None)
        env.pop("JAX_NUM_CPU_DEVICES", None)
        if devices:
            env["JAX_NUM_CPU_DEVICES"] = str(devices)
        if pause:
            env["GEMJAX_TEST_PAUSE"] = pause
        cmd = [sys.executable, "-m", module, *args, f"--workdir={workdir}"]
        if then:
            assert module == "experiments.train", module
            runs = [(wd, args) if isinstance(wd, str) else wd for wd in (workdir, *then)]
            runs = [(*r, None) if len(r) == 2 else r for r in runs]
            runs[0] = (*runs[0][:2], pause)
            env.pop("GEMJAX_TEST_PAUSE", None)      # set per command by the child
            cmd = child_argv("train", "run", [
                [wd, [*a, f"--workdir={wd}"], {"env": {"GEMJAX_TEST_PAUSE": p} if p else {},
                                               "go_on": bool(p) and i < len(runs) - 1}]
                for i, (wd, a, p) in enumerate(runs)])
        self.proc = subprocess.Popen(cmd if given is None else given, cwd=ROOT, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def out(self) -> str:
        return "".join(self.lines)

    def wait_for(self, text, timeout=300):
        deadline = time.monotonic() + timeout
        while not any(text in line for line in list(self.lines)):
            assert self.proc.poll() is None and time.monotonic() < deadline, \
                f"no {text!r} (exit {self.proc.poll()}):\n{self.out[-3000:]}"
            time.sleep(0.02)

    def finish(self, timeout=300) -> int:
        rc = self.proc.wait(timeout)
        self._reader.join(30)
        return rc


def train_here(cfg, workdir, log=lambda s: None) -> dict:
    """train() of cfg in this process as experiments/train.py runs it in a child of
    `Run(..., devices=DEVICES)`: the layout of cfg.parallel (gemjax.train.layout.build)
    over every device. The same programs as those children's and this process's other
    runs of CFG: each is compiled once for the file."""
    mesh, trainer_kw = layout.build(cfg)
    return train(cfg, workdir, log=log, mesh=mesh, trainer_kw=trainer_kw)


def run_trainer(cfg=CFG):
    """The Trainer of cfg on the layout train_here and the children train on."""
    mesh, trainer_kw = layout.build(cfg)
    return Trainer.create(cfg, mesh, **trainer_kw)


def restored(trainer, checkpoints, step=None):
    """(step, state, meta) of checkpoint `step` (None: the newest) restored onto trainer's
    abstract state (its tree of shapes and shardings: nothing drawn)."""
    with Checkpointer(checkpoints) as ckpt:
        return restore_train_state(ckpt, trainer.coll, trainer.abstract_state(), step)


def host(state):
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(state))]


def rows(workdir, kind):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        out = [json.loads(line) for line in f]
    drop = ("samples_per_sec", "tokens_per_sec", "checkpoints_damaged")
    return [{k: v for k, v in r.items() if k not in drop} for r in out if r["kind"] == kind]


def steps_in(checkpoints):
    return sorted(int(n) for n in os.listdir(checkpoints) if n.isdigit())


def kill_once_saved(run: Run, checkpoints: str, step: int) -> None:
    """kill -9 `run` as soon as checkpoint `step` is committed under `checkpoints` (saves
    are asynchronous: the run may be paused past that step while it is written)."""
    deadline = time.monotonic() + 120
    while step not in steps_in(checkpoints):
        assert time.monotonic() < deadline, run.out[-3000:]
        time.sleep(0.02)
    run.proc.kill()
    assert run.finish() == -signal.SIGKILL


def sigterm_at_pause(run: Run, step: int, resumed_from: int, goes_on: bool = False) -> None:
    """`run` (resumed from checkpoint `resumed_from`, paused after `step`) gets SIGTERM:
    it must stop with exit 128 + SIGTERM after saving checkpoint `step`. goes_on: the
    child prints that exit code ("[test] exit CODE") and runs its next commands (Run's
    `then`); the caller finishes it."""
    run.wait_for(f"test pause at step {step}")
    run.proc.send_signal(signal.SIGTERM)
    if goes_on:
        run.wait_for("[test] exit ")
        assert f"[test] exit {128 + signal.SIGTERM}\n" in run.lines, run.out[-3000:]
    else:
        assert run.finish() == 128 + signal.SIGTERM, run.out[-3000:]
    assert f"resumed from step {resumed_from}" in run.out
    assert f"stopped by SIGTERM after step {step}: checkpoint step {step} saved" in run.out


def assert_same_checkpoint(trainer, checkpoints: str, reference: str, step: int) -> dict:
    """Checkpoint `step` under `checkpoints` holds the arrays (bit for bit) and step of the
    uninterrupted run in `reference`; returns its data position (restored's third item)."""
    got = restored(trainer, checkpoints, step)
    want = restored(trainer, os.path.join(reference, "checkpoints"), step)
    assert got[0] == want[0] == step
    for a, b in zip(host(got[1]), host(want[1])):
        np.testing.assert_array_equal(a, b)
    return got[2]


def damage_chunk(step_dir):
    """Random bytes over the middle of the largest array data chunk of a step."""
    chunks = [p for p in glob.glob(os.path.join(step_dir, "state", "**", "d", "*"), recursive=True)]
    path = max(chunks, key=os.path.getsize)
    data = bytearray(open(path, "rb").read())
    mid = len(data) // 2
    data[mid:mid + 16] = np.random.default_rng(0).integers(0, 256, 16, np.uint8).tobytes()
    open(path, "wb").write(bytes(data))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run of ARGS' config (train_here): its workdir (checkpoints 3, 6, 8)."""
    workdir = str(tmp_path_factory.mktemp("reference"))
    train_here(CFG, workdir)
    assert steps_in(os.path.join(workdir, "checkpoints")) == [3, 6, 8]
    return workdir


def test_signals_kill_and_a_damaged_checkpoint_resume_exactly(reference, tmp_path):
    """SIGINT during an eval, SIGTERM after a step, kill -9 inside a save, then random bytes
    in the newest checkpoint: the run ends equal to the uninterrupted one."""
    workdir = str(tmp_path / "run")
    checkpoints = os.path.join(workdir, "checkpoints")

    # 1. SIGINT while step 4's eval is pending (after the step ran): the checkpoint is
    #    labelled with the step the state holds (4; not a regular save point). The
    #    command ends with exit 128 + SIGINT (sys.exit's code, printed by Run's child,
    #    whose next command is step 2's resume: one process for both signals)
    run = Run(workdir, pause="eval:4", devices=DEVICES, then=[(workdir, ARGS, "step:5")])
    run.wait_for("test pause at eval 4")
    with pytest.raises(WorkdirBusy, match=rf"in use by another run \(pid {run.proc.pid} on host "):
        train(CFG, workdir, log=lambda s: None)           # a second run on the workdir
    run.proc.send_signal(signal.SIGINT)
    run.wait_for("[test] exit ")
    assert f"[test] exit {128 + signal.SIGINT}\n" in run.lines, run.out[-3000:]
    assert "stopped by SIGINT after step 4: checkpoint step 4 saved" in run.out
    assert steps_in(checkpoints) == [3, 4]          # the next command saves nothing before 5
    trainer = run_trainer()
    step, state, meta = restored(trainer, checkpoints)
    assert step == meta["data_step"] == int(state["step"]) == 4

    # 2. SIGTERM right after step 5 (neither a log nor a save point): saved, not lost; the
    #    process exits with 128 + SIGTERM
    sigterm_at_pause(run, 5, 4)
    assert steps_in(checkpoints) == [3, 4, 5]
    assert [r["step"] for r in rows(workdir, "train")][-1] == 5       # its window logged

    # 3. kill -9 while step 6 is being saved (written, not yet committed)
    run = Run(workdir, pause="commit:6", devices=DEVICES)
    run.wait_for("test pause at commit 6")
    run.proc.kill()
    assert run.finish() == -signal.SIGKILL
    assert glob.glob(os.path.join(checkpoints, "6.orbax-checkpoint-tmp*"))
    assert steps_in(checkpoints) == [3, 4, 5]

    # 4. random bytes in a data chunk of the newest checkpoint (5): found by its
    #    checksums, set aside, the run (train_here) resumes from 4 and finishes
    damage_chunk(os.path.join(checkpoints, "5"))
    logged = []
    train_here(CFG, workdir, log=logged.append)
    out = "\n".join(logged)
    assert "checkpoint step 5 is damaged (file state/" in out
    assert "does not match its checksum" in out and "resumed from step 4" in out
    assert os.path.isdir(os.path.join(workdir, "checkpoints-damaged", "5"))
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        last_train = [r for r in map(json.loads, f) if r["kind"] == "train"][-1]
    assert (last_train["step"], last_train["checkpoints_damaged"]) == (8, 1)

    assert rows(workdir, "eval") == rows(reference, "eval")           # every digit
    assert rows(workdir, "train") == rows(reference, "train")
    for key in ("eval_ne", "eval_auc", "eval_calibration", "steps"):
        assert json.load(open(os.path.join(workdir, "summary.json")))[key] == \
            json.load(open(os.path.join(reference, "summary.json")))[key]
    assert_same_checkpoint(trainer, checkpoints, reference, 8)


def test_kill_and_sigterm_on_a_parquet_source_resume_exactly(tmp_path):
    """A shuffled Parquet source (200 rows, 32 a step: step 7 reads epoch 1's permutation)
    trained by experiments/train.py: kill -9 after checkpoint 4 is on disk and step 5
    ran, resume, SIGTERM after step 7 (not a save point), resume to the end. The eval
    rows, the train rows up to the kill and the final checkpoint equal an uninterrupted
    run's (the same command, run after the last resume in its process). These children
    keep JAX's one CPU device: no run in this process shares their programs, which
    compile for one device at less cost than for eight."""
    from test_own_data import SCHEMA, _write_log
    data = tmp_path / "data"
    data.mkdir()
    _write_log(data / "train.parquet", 200, 0, bad_ids=3)
    _write_log(data / "eval.parquet", 70, 1)
    (data / "schema.json").write_text(json.dumps(SCHEMA.to_dict()))
    over = (f"data.source=parquet,data.train_path={data}/train.parquet,"
            f"data.eval_path={data}/eval.parquet,data.order=shuffle,data.shuffle_window=16,"
            "data.batch_size=32,data.eval_batches=0,train.log_every=2,train.eval_every=4,"
            "train.checkpoint_every=2,train.tensorboard=false")
    args = ["--config=tiny", "--steps=8", f"--features={data}/schema.json", f"--override={over}"]
    cfg = apply_overrides(dataclasses.replace(get_config("tiny"), features=SCHEMA),
                          over + ",train.steps=8")
    reference, workdir = str(tmp_path / "whole"), str(tmp_path / "cut")
    checkpoints = os.path.join(workdir, "checkpoints")
    run = Run(workdir, pause="step:5", args=args)
    run.wait_for("test pause at step 5")
    kill_once_saved(run, checkpoints, 4)
    assert steps_in(checkpoints) == [2, 4]

    # SIGTERM, then the resume and the reference in the same process (Run's child prints
    # the SIGTERM'd command's exit code and goes on)
    run = Run(workdir, pause="step:7", args=args, then=[(workdir, args), reference])
    sigterm_at_pause(run, 7, 4, goes_on=True)
    assert run.finish() == 0, run.out[-3000:]
    assert "resumed from step 7" in run.out
    assert [r["step"] for r in rows(reference, "eval")] == [4, 8]
    assert rows(workdir, "eval") == rows(reference, "eval")           # every digit
    # train rows average the steps since the last row: after the SIGTERM the run logged
    # a row at step 7 (step 7 alone) and one at step 8 (step 8 alone)
    upto_6 = [r for r in rows(reference, "train") if r["step"] <= 6]
    assert [r for r in rows(workdir, "train") if r["step"] <= 6] == upto_6
    assert upto_6[-1]["ids_clamped"] >= 3                             # the source's counters too
    trainer = Trainer.create(cfg, Mesh(np.array(jax.devices()[:1]), ("batch",)))
    assert assert_same_checkpoint(trainer, checkpoints, reference, 8)["data_step"] == 8


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _garbage(path):
    with open(path, "w") as f:
        f.write("{not json")


def _empty(step_dir):
    shutil.rmtree(step_dir)
    os.mkdir(step_dir)


def _largest_chunk(step_dir):
    return max(glob.glob(os.path.join(step_dir, "state", "**", "d", "*"), recursive=True),
               key=os.path.getsize)


# (damage to step 8, what the log must say); checksums.sha256 removed = a step
# without checksums: not trusted (train.trust_unverified_checkpoints=false), whatever it holds
UNTRUSTED = "8/checksums.sha256 is missing, so its files cannot be verified (not trusted"
DAMAGE = {
    "truncated_data": (lambda d: _truncate(_largest_chunk(d)), "does not match its checksum"),
    "missing_manifest": (lambda d: os.remove(os.path.join(d, "state", "manifest.ocdbt")),
                         "file state/manifest.ocdbt is missing"),
    "garbage_metadata": (lambda d: _garbage(os.path.join(d, "meta", "metadata")),
                         "file meta/metadata does not match its checksum"),
    "empty_step_dir": (_empty, "empty step directory"),
    "random_bytes": (damage_chunk, "does not match its checksum"),
    "no_checksums_truncated": (lambda d: (os.remove(os.path.join(d, "checksums.sha256")),
                                          _truncate(_largest_chunk(d))), UNTRUSTED),
    "no_checksums_random_bytes": (lambda d: (os.remove(os.path.join(d, "checksums.sha256")),
                                             damage_chunk(d)), UNTRUSTED),
    "no_checksums_garbage_metadata": (lambda d: (os.remove(os.path.join(d, "checksums.sha256")),
                                                 _garbage(os.path.join(d, "meta", "metadata"))),
                                      UNTRUSTED),
}


def test_damaged_newest_checkpoint_falls_back_to_the_newest_intact(reference, tmp_path):
    trainer = run_trainer()
    target = trainer.abstract_state()      # the restore target of every _resume below
    want6 = host(restored(trainer, os.path.join(reference, "checkpoints"), 6)[1])
    for name, (damage, says) in DAMAGE.items():
        checkpoints = str(tmp_path / name / "checkpoints")
        shutil.copytree(os.path.join(reference, "checkpoints"), checkpoints)
        damage(os.path.join(checkpoints, "8"))
        logged = []
        ckpt = Checkpointer(checkpoints)
        step, state, damaged = _resume(ckpt, trainer.coll, target, CFG, True,
                                       logged.append)
        ckpt.close()
        assert (step, damaged) == (6, 1), (name, logged)
        assert any(f"checkpoint step 8 is damaged (" in s and says in s for s in logged), \
            (name, logged)
        assert os.path.isdir(str(tmp_path / name / "checkpoints-damaged" / "8")), name
        assert Checkpointer(checkpoints).all_steps() == [3, 6], name
        for a, b in zip(host(state), want6):
            np.testing.assert_array_equal(a, b, err_msg=name)

    # a step without checksums is used when trusted (train.trust_unverified_checkpoints):
    # only a failing read shows its damage
    checkpoints = str(tmp_path / "unverified" / "checkpoints")
    shutil.copytree(os.path.join(reference, "checkpoints"), checkpoints)
    os.remove(os.path.join(checkpoints, "8", "checksums.sha256"))
    logged = []
    step, _, damaged = _resume(Checkpointer(checkpoints, trust_unverified=True), trainer.coll,
                               target, CFG, True, logged.append)
    assert (step, damaged) == (8, 0) and "8/checksums.sha256 is missing; trusted" in logged[0]
    _truncate(_largest_chunk(os.path.join(checkpoints, "8")))
    logged = []
    step, _, damaged = _resume(Checkpointer(checkpoints, trust_unverified=True), trainer.coll,
                               target, CFG, True, logged.append)
    assert (step, damaged) == (6, 1) and any("step 8 is damaged (unreadable: " in s for s in logged)

    # no verified step left: refused, naming the step and the missing file
    checkpoints = str(tmp_path / "none_verified" / "checkpoints")
    shutil.copytree(os.path.join(reference, "checkpoints"), checkpoints)
    for s in (3, 6, 8):
        os.remove(os.path.join(checkpoints, str(s), "checksums.sha256"))
    with pytest.raises(CheckpointDamaged, match=r"no intact checkpoint in .*: step 8: .*/8/"
                                                r"checksums.sha256 is missing.*; step 3: "):
        _resume(Checkpointer(checkpoints), trainer.coll, target, CFG, True,
                lambda s: None)
    assert steps_in(checkpoints) == [3, 6, 8]

    # nothing intact: a clear error, nothing moved
    checkpoints = str(tmp_path / "all" / "checkpoints")
    shutil.copytree(os.path.join(reference, "checkpoints"), checkpoints)
    for s in (3, 6, 8):
        _empty(os.path.join(checkpoints, str(s)))
    with pytest.raises(CheckpointDamaged, match=r"no intact checkpoint in .*: step 8: empty step "
                                                r"directory; step 6: .*; step 3: "):
        _resume(Checkpointer(checkpoints), trainer.coll, target, CFG, True,
                lambda s: None)
    assert steps_in(checkpoints) == [3, 6, 8]

    # a checkpoint whose label is not the step its state holds is refused
    checkpoints = str(tmp_path / "label" / "checkpoints")
    shutil.copytree(os.path.join(reference, "checkpoints"), checkpoints)
    os.rename(os.path.join(checkpoints, "8"), os.path.join(checkpoints, "9"))
    with pytest.raises(CheckpointMismatch, match=r"checkpoint step 9 in .* holds a train state "
                                                 r"at step 8 \(state\['step'\]\)"):
        _resume(Checkpointer(checkpoints), trainer.coll, target,
                dataclasses.replace(CFG, train=dataclasses.replace(CFG.train, steps=9)), True,
                lambda s: None)


def test_resume_that_does_not_fit_is_refused(reference):
    before = {n: open(os.path.join(reference, n)).read() for n in ("config.json", "metrics.jsonl")}
    cfg = apply_overrides(CFG, "data.vocab_user=2000,data.batch_size=32,train.steps=4")
    with pytest.raises(ResumeMismatch) as e:
        train(cfg, reference, log=lambda s: None)
    msg = str(e.value)
    assert msg.startswith(f"cannot resume {reference} at step 8: ")
    for part in ("train.steps (--steps) is 4, below the checkpoint's step 8",
                 "data.batch_size is 32, the checkpoint's is 64",
                 "data.synthetic.vocab_user is 2000, the checkpoint's is 1000"):
        assert part in msg, msg
    assert {n: open(os.path.join(reference, n)).read() for n in before} == before
    # what may change: more steps (extends the run), eval batches, learning rates
    with Checkpointer(os.path.join(reference, "checkpoints")) as ckpt:
        _, meta = ckpt.metadata(8)
        check_resume(meta, apply_overrides(CFG, "train.steps=20,data.eval_batches=3,"
                                                "train.dense_lr=0.01,model.norm_impl=auto"), 8, "w")
        # a model flag that changes no parameter shape still changes the function
        flipped = str(not CFG.model.rope).lower()
        with pytest.raises(ResumeMismatch, match=f"model.rope is {not CFG.model.rope!r}, "
                                                 f"the checkpoint's is {CFG.model.rope!r}"):
            check_resume(meta, apply_overrides(CFG, f"model.rope={flipped}"), 8, "w")
        # restoring tables of another vocabulary is refused below the loop too
        other = run_trainer(apply_overrides(CFG, "data.vocab_item=500"))
        with pytest.raises(CheckpointMismatch, match=r"another vocabulary \(item: checkpoint "
                                                     r"400, this model 500\)"):
            restore_train_state(ckpt, other.coll, other.init_state(0))


def test_nan_state_is_never_saved(tmp_path, monkeypatch):
    """Params turn NaN after step 5; saving every 2 steps with keep=2 would otherwise rotate
    the finite checkpoints out (the loss is only looked at every 8 steps)."""
    cfg = apply_overrides(get_config("tiny"), "train.steps=8,train.log_every=8,train.eval_every=8,"
                                              "train.checkpoint_every=2,train.keep_checkpoints=2,"
                                              "data.eval_batches=1")
    make = Trainer.make_train_step

    def poisoned(self):
        step = make(self)

        def run(state, batch, next_batch=None):
            state, m = step(state, batch, next_batch=next_batch)
            if int(state["step"]) == 5:
                state = {**state, "params": jax.tree.map(lambda x: x * np.nan, state["params"])}
            return state, m
        return run

    monkeypatch.setattr(Trainer, "make_train_step", poisoned)
    workdir = str(tmp_path / "nan")
    with pytest.raises(FloatingPointError, match=r"train state at step 6 holds NaN or inf in "
                                                 r"\d+ arrays \(\[.*\]\): not saved; "
                                                 r"the checkpoints kept \(\[2, 4\]\)"):
        train_here(cfg, workdir)
    assert steps_in(os.path.join(workdir, "checkpoints")) == [2, 4]
    trainer = run_trainer(cfg)
    _, state, _ = restored(trainer, os.path.join(workdir, "checkpoints"))
    assert all(np.isfinite(x).all() for x in host(state) if x.dtype.kind == "f")


def test_keyboard_interrupt_inside_an_eval_saves_the_step_the_state_holds(tmp_path, monkeypatch):
    """A KeyboardInterrupt raised at once (a second Ctrl-C, or train() off the main thread,
    where no handler is installed) while step 4's eval runs: the state holds step 4, so the
    checkpoint is step 4 (not 3, the step the loop had finished before)."""
    from gemjax.train.loop import Evaluator
    call = Evaluator.__call__

    def interrupted(self, state):
        if int(state["step"]) == 4:
            raise KeyboardInterrupt
        return call(self, state)

    monkeypatch.setattr(Evaluator, "__call__", interrupted)
    workdir = str(tmp_path / "ki")
    logged = []
    with pytest.raises(KeyboardInterrupt):
        train_here(CFG, workdir, log=logged.append)
    assert "[gemjax] interrupted: saved step 4" in logged
    checkpoints = os.path.join(workdir, "checkpoints")
    assert steps_in(checkpoints) == [3, 4]
    step, state, meta = restored(run_trainer(), checkpoints)
    assert step == meta["data_step"] == int(state["step"]) == 4


def test_bad_config_values_are_named_before_anything_runs(tmp_path):
    for override, says in [("train.checkpoint_every=0", "train.checkpoint_every must be >= 1, got 0"),
                           ("train.log_every=0", "train.log_every must be >= 1, got 0"),
                           ("train.eval_every=-1", "train.eval_every must be >= 1, got -1"),
                           ("train.dense_lr=nan", "optim.dense.lr must be a finite number in "
                                                  "[0, 100], got nan"),
                           ("train.sparse_lr=1e30", "optim.sparse.lr must be a finite number in "
                                                    "[0, 100], got 1e+30"),
                           ("train.dense_lr=-0.1", "optim.dense.lr must be a finite number"),
                           ("train.keep_checkpoints=0", "train.keep_checkpoints must be >= 1")]:
        with pytest.raises(ValueError, match=f"config 'tiny': {__import__('re').escape(says)}"):
            get_config("tiny", override)
    # a Config built without apply_overrides is checked by train() itself
    bad = dataclasses.replace(CFG, train=dataclasses.replace(CFG.train, log_every=0))
    with pytest.raises(ValueError, match="train.log_every must be >= 1, got 0"):
        train(bad, str(tmp_path / "w"), log=lambda s: None)
    assert not os.path.exists(tmp_path / "w")
