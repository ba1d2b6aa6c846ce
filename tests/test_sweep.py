"""experiments/sweep.py: space parsing, Optuna's samplers, resume, refusal, one test read.

Most tests replace the trial runner with tests/sweep_fake.py (a known objective
written as summary.json), so they train nothing; the last one runs two real
tiny trials through experiments.train.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import types

import pytest

optuna = pytest.importorskip("optuna")

from experiments import sweep  # noqa: E402
from gemjax.config import get_config  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import sweep_fake  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LR = "train.dense_lr=loguniform(1e-4,1e-1)"


def flags_ns(workdir, **kw):
    d = dict(config="tiny", workdir=str(workdir), override="", features="", space=LR, trials=4,
             seeds=["0"], metric="", sampler="tpe", seed=0, top=10, train_flags="",
             python=sys.executable)
    d.update(kw)
    return types.SimpleNamespace(**d)


def run(workdir, runner=sweep_fake.run, **kw):
    f = flags_ns(workdir, **kw)
    sw, params, spec = sweep.build(f)
    return sweep.run_sweep(sw, params, spec, f.trials, f.top, runner=runner)


def calls(path):
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        return [json.loads(line) for line in fh]


@pytest.fixture
def call_log(tmp_path, monkeypatch):
    path = str(tmp_path / "calls.jsonl")
    monkeypatch.setenv("SWEEP_FAKE_CALLS", path)
    return path


# ----------------------------------------------------------------------------- parsing

def test_space_parses_each_kind_into_optuna_distributions():
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
    params = sweep.parse_space("train.dense_lr=loguniform(1e-4, 3e-2); model.dim=choice(8,16,32);"
                               "model.wukong_layers=int(1,4);train.sparse_lr=uniform(0.05,0.5);"
                               "model.fm_rank=int(2,8,2);data.batch_size=logint(32,256);"
                               "model.head_mlp=choice(16,16:16)", get_config("tiny"))
    d = {p.name: p.distribution() for p in params}
    assert d["train.dense_lr"] == FloatDistribution(1e-4, 3e-2, log=True)
    assert d["model.dim"] == CategoricalDistribution(("8", "16", "32"))
    assert d["model.wukong_layers"] == IntDistribution(1, 4)
    assert d["train.sparse_lr"] == FloatDistribution(0.05, 0.5)
    assert d["model.fm_rank"] == IntDistribution(2, 8, step=2)
    assert d["data.batch_size"] == IntDistribution(32, 256, log=True)
    assert params[-1].choices == ("16", "16:16")
    assert params[4].grid() == [2, 4, 6, 8]


@pytest.mark.parametrize("text, names", [
    ("", "--space is empty"),
    ("model.dim", "'model.dim': expected section.field=kind(args)"),
    ("model.dim=normal(1,2)", "unknown kind 'normal'"),
    ("model.dim=choice(16,abc)", "'model.dim=choice(16,abc)': override model.dim='abc'"),
    ("model.nope=int(1,2)", "model has no field 'nope'"),
    ("train.dense_lr=loguniform(0,1)", "a log scale needs lo > 0"),
    ("model.dim=int(32,16)", "needs finite lo < hi"),
    ("model.dim=int(8,16,3)", "step must be >= 1 and divide hi - lo"),
    ("model.dim=int(8.5,16)", "int() takes int arguments"),
    ("model.dim=uniform(1)", "uniform() takes 2 arguments, got 1"),
    ("model.dim=choice(8,8)", "repeated choice"),
    ("model.dim=choice(8,,16)", "empty argument"),
    ("model.dim=choice(8);model.dim=choice(16)", "'model.dim=choice(16)': model.dim appears twice"),
    ("train.seed=int(0,3)", "train.seed is set by the sweep itself"),
    ("data.eval_path=choice(a,b)", "data.eval_path is set by the sweep itself"),
])
def test_space_errors_name_the_entry(text, names):
    with pytest.raises(sweep.SweepError) as e:
        sweep.parse_space(text, get_config("tiny"))
    assert names in str(e.value)


def test_grid_refuses_continuous_entries():
    (p,) = sweep.parse_space(LR)
    with pytest.raises(sweep.SweepError, match="train.dense_lr: --sampler=grid takes choice"):
        p.grid()


def test_direction_follows_the_metric():
    assert [sweep.direction(m) for m in ("ne", "loss", "log_loss", "task1/ne", "auc", "hr@10", "mrr")] \
        == ["minimize"] * 4 + ["maximize"] * 3


def test_build_refuses_bad_flags(tmp_path):
    with pytest.raises(sweep.SweepError, match="--seeds"):
        sweep.build(flags_ns(tmp_path, seeds=["0", "0"]))
    with pytest.raises(sweep.SweepError, match="set by the sweep itself"):
        sweep.build(flags_ns(tmp_path, override="train.seed=3"))
    with pytest.raises(sweep.SweepError, match="--trials"):
        sweep.build(flags_ns(tmp_path, trials=0))


def test_trial_runs_leave_the_test_rows_unread(tmp_path):
    sw, _, _ = sweep.build(flags_ns(tmp_path, override="train.steps=8", metric="auc",
                                    train_flags="--cpu_devices=1"))
    argv = sw.train_argv(3, 2, {"train.dense_lr": 0.001, "model.dim": "16"})
    assert argv[1:4] == ["-m", "experiments.train", "--config=tiny"]
    assert f"--workdir={tmp_path}/trials/0003/seed_2" in argv and argv[-1] == "--cpu_devices=1"
    over = sweep_fake.parse(sweep_fake.flag(argv, "override"))
    assert over == {"train.baselines": "false", "train.steps": "8", "data.valid_path": "synthetic",
                    "train.dense_lr": "0.001", "model.dim": "16", "train.select_metric": "auc",
                    "train.seed": "2", "data.eval_path": ""}
    ev = sw.eval_argv(3, 2)
    assert "--mode=eval" in ev and "--override=data.eval_path=" in ev


# ----------------------------------------------------------------------------- search

def replay(sampler, dists, n, objective):
    """The same search driven by Optuna directly: the reference for the sweep's params."""
    study = optuna.create_study(sampler=sampler, direction="minimize")
    out = []
    for _ in range(n):
        t = study.ask(dists)
        over = {k: repr(v) if isinstance(v, float) else str(v) for k, v in t.params.items()}
        study.tell(t, objective(over))
        out.append(t.params)
    return out


@pytest.mark.parametrize("name, make", [("tpe", lambda: optuna.samplers.TPESampler(seed=3)),
                                        ("random", lambda: optuna.samplers.RandomSampler(seed=3))])
def test_sampler_is_optunas_and_finds_the_known_best(tmp_path, call_log, name, make):
    out = run(tmp_path, space=LR + ";model.dim=choice(16,64)", trials=24, sampler=name, seed=3)
    got = [r["params"] for r in sorted(out["trials"], key=lambda r: r["number"])]
    dists = {p.name: p.distribution() for p in sweep.parse_space(LR + ";model.dim=choice(16,64)")}
    assert got == replay(make(), dists, 24, sweep_fake.objective)
    # the known objective: minimum 0 at lr 10^-2.5, dim 64
    assert out["chosen"]["mean"] == min(sweep_fake.objective(sweep.param_overrides(p)) for p in got)
    assert out["chosen"]["params"]["model.dim"] == "64"
    assert abs(math.log10(out["chosen"]["params"]["train.dense_lr"]) + 2.5) < 0.4
    assert out["chosen"]["mean"] < 0.1


def test_grid_runs_every_combination_once(tmp_path, call_log, capsys):
    out = run(tmp_path, space="model.dim=choice(16,64,32);model.wukong_layers=int(1,2)", trials=50,
              sampler="grid")
    combos = sorted((r["params"]["model.dim"], r["params"]["model.wukong_layers"]) for r in out["trials"])
    assert combos == sorted((d, n) for d in ("16", "32", "64") for n in (1, 2))
    assert "6 combinations, so 6 trials" in capsys.readouterr().out


def test_seeds_mean_and_table(tmp_path, call_log):
    out = run(tmp_path, seeds=["0", "1", "2"], trials=3, sampler="random")
    for r in out["trials"]:
        base = sweep_fake.objective(sweep.param_overrides(r["params"]))
        assert r["values"] == pytest.approx([base, base + 0.01, base + 0.02])
        assert r["mean"] == pytest.approx(base + 0.01) and r["std"] == pytest.approx(0.01)
    means = [r["mean"] for r in out["trials"]]
    assert means == sorted(means)                     # ne: lower first
    table = (tmp_path / "table.md").read_text()
    assert sum(ln.startswith("| ") for ln in table.splitlines()) == 4     # header + 3 trials
    assert f"chosen: trial {out['chosen']['number']}" in table
    assert json.loads((tmp_path / "sweep.json").read_text())["test"] == out["test"]


def test_a_failed_trial_is_reported_and_counted(tmp_path, call_log):
    out = run(tmp_path, space="model.fm_rank=choice(3,4)", trials=2, sampler="grid")
    failed = [r for r in out["trials"] if "error" in r]
    assert len(out["trials"]) == 2 and [r["params"]["model.fm_rank"] for r in failed] == ["3"]
    assert "exit 1" in failed[0]["error"] and out["chosen"]["params"]["model.fm_rank"] == "4"


# ----------------------------------------------------------------------------- test read

def test_test_is_read_once_for_the_chosen_setting_only(tmp_path, call_log):
    out = run(tmp_path, seeds=["0", "1"], trials=5, sampler="random",
              override="data.eval_path=/data/test.parquet")
    evals = [c for c in calls(call_log) if c["mode"] == "eval"]
    best = out["chosen"]["number"]
    assert sorted(c["workdir"] for c in evals) == [f"{tmp_path}/trials/{best:04d}/seed_{s}" for s in (0, 1)]
    assert {c["override"]["data.eval_path"] for c in evals} == {"/data/test.parquet"}
    trains = [c for c in calls(call_log) if c["mode"] == "train"]
    assert len(trains) == 10 and {c["override"]["data.eval_path"] for c in trains} == {""}
    shift = sweep_fake.TEST_SHIFT
    assert out["test"]["values"] == pytest.approx([v + shift for v in out["chosen"]["values"]])
    # a rerun of the finished sweep trains nothing and reads no test again
    again = run(tmp_path, seeds=["0", "1"], trials=5, sampler="random",
                override="data.eval_path=/data/test.parquet")
    assert len(calls(call_log)) == 12 and again["test"] == out["test"]


# ----------------------------------------------------------------------------- resume

def test_rerun_with_other_settings_is_refused(tmp_path, call_log):
    run(tmp_path, trials=2)
    for kw, key in [(dict(space=LR + ";model.dim=choice(8,16)"), "space"),
                    (dict(seeds=["0", "1"]), "seeds"), (dict(override="train.steps=5"), "override"),
                    (dict(metric="auc"), "metric"), (dict(sampler="random"), "sampler")]:
        with pytest.raises(sweep.SweepError, match=f"other settings \\({key}: was"):
            run(tmp_path, trials=2, **kw)
    out = run(tmp_path, trials=3)            # a larger budget extends the sweep
    assert len(out["trials"]) == 3 and len([c for c in calls(call_log) if c["mode"] == "train"]) == 3


def test_a_stopped_trial_resumes_its_unfinished_seeds(tmp_path, call_log):
    def stopping(argv, workdir, log):
        if workdir.endswith("trials/0002/seed_1"):
            return 128 + signal.SIGTERM        # the run saved and stopped
        return sweep_fake.run(argv, workdir, log)

    with pytest.raises(sweep.Stopped, match="trial 2 seed 1"):
        run(tmp_path, seeds=["0", "1"], trials=4, sampler="random", runner=stopping)
    out = run(tmp_path, seeds=["0", "1"], trials=4, sampler="random")
    dirs = [c["workdir"] for c in calls(call_log) if c["mode"] == "train"]
    assert len(dirs) == len(set(dirs)) == 8       # no seed run twice
    assert sorted(r["number"] for r in out["trials"]) == [0, 1, 2, 3]
    got = [r["params"] for r in sorted(out["trials"], key=lambda r: r["number"])]
    ref = replay(optuna.samplers.RandomSampler(seed=0), {p.name: p.distribution()
                                                         for p in sweep.parse_space(LR)}, 3,
                 lambda o: sweep_fake.objective(o) + 0.005)
    assert got[:3] == ref                          # trial 2 kept its params
    assert got[3] not in got[:3]                   # the resumed sampler draws anew


def test_a_partial_journal_record_is_dropped_and_the_sweep_continues(tmp_path, call_log, capsys):
    run(tmp_path, trials=2, sampler="random")
    with open(tmp_path / "study.journal", "ab") as fh:
        fh.write(b'{"op_code": 5, "worker_id": "x", "trial_id"')      # a write cut short
    out = run(tmp_path, trials=3, sampler="random")
    assert "dropping a partial last record" in capsys.readouterr().out
    assert sorted(r["number"] for r in out["trials"]) == [0, 1, 2]
    assert (tmp_path / "study.journal").read_bytes().endswith(b"\n")


LAUNCHER = """
import sys
sys.path[:0] = [{repo!r}, {tests!r}]
from absl import app
from experiments import sweep
import sweep_fake
sweep.RUNNER = sweep_fake.run
sweep.trainer_selects = lambda: True
sweep.define_flags()
app.run(sweep.main)
"""


def test_a_killed_sweep_continues_where_it_stopped(tmp_path):
    launcher = tmp_path / "launch.py"
    launcher.write_text(LAUNCHER.format(repo=REPO, tests=os.path.dirname(__file__)))
    work = tmp_path / "sw"
    env = {**os.environ, "SWEEP_FAKE_CALLS": str(tmp_path / "calls.jsonl"), "SWEEP_FAKE_SLEEP": "0.15"}
    argv = [sys.executable, str(launcher), "--config=tiny", f"--workdir={work}", f"--space={LR}",
            "--trials=8", "--seeds=0,1", "--sampler=random"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    first = []
    deadline = time.monotonic() + 60
    while len(first) < 3 and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("[sweep] trial"):
            first.append(line)
    time.sleep(0.2)                  # into the next trial's first seed
    proc.kill()
    proc.wait()
    assert len(first) == 3
    before = [c["workdir"] for c in calls(env["SWEEP_FAKE_CALLS"]) if c["mode"] == "train"]
    assert len(before) < 16
    res = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "[sweep] resuming trial" in res.stdout      # the trial the kill cut short
    done_again = [ln for ln in res.stdout.splitlines() if ln.startswith("[sweep] trial")]
    numbers = [int(ln.split()[2]) for ln in first + done_again]
    assert sorted(numbers) == list(range(8))          # every trial finished once, none rerun
    trains = [c["workdir"] for c in calls(env["SWEEP_FAKE_CALLS"]) if c["mode"] == "train"]
    assert len(trains) == len(set(trains)) == 16      # no finished seed run ran again
    out = json.loads((work / "sweep.json").read_text())
    assert len(out["trials"]) == 8 and all("error" not in r for r in out["trials"])
    lrs = [r["params"]["train.dense_lr"] for r in out["trials"]]
    assert len(set(lrs)) == 8                         # no point drawn twice across the kill
    assert "chosen: trial" in res.stdout.splitlines()[-1]


# ----------------------------------------------------------------------------- real trainer

@pytest.mark.slow
def test_two_tiny_trials_through_the_trainer(tmp_path):
    if not sweep.trainer_selects():
        pytest.skip("gemjax.config.TrainConfig has no select_metric yet (validation selection "
                    "lands with the trainer's validation contract)")
    # data.eval_batches changes the validation figures, not the compiled programs: the
    # second trial and the test read load the first one's from the compilation cache.
    # The trials train the logistic-regression baseline without sequence features (the
    # cheapest model of the trainer to compile): the sweep runs the same trainer, selection
    # and test read whatever model.kind it searches
    argv = [sys.executable, "-m", "experiments.sweep", "--config=tiny", f"--workdir={tmp_path}",
            "--override=train.steps=4,train.eval_every=2,train.log_every=2,train.checkpoint_every=2,"
            "model.kind=lr,model.use_sequences=false",
            "--space=data.eval_batches=choice(1,2)", "--trials=2", "--seeds=0", "--sampler=grid"]
    res = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = json.loads((tmp_path / "sweep.json").read_text())
    assert len(out["trials"]) == 2 and out["metric"] == "ne"
    for r in out["trials"]:
        run_dir = tmp_path / "trials" / f"{r['number']:04d}" / "seed_0"
        summary = json.loads((run_dir / "summary.json").read_text())
        assert r["values"] == [summary["selection"]["best_value"]]
        cfg = json.loads((run_dir / "config.json").read_text())
        assert (cfg["data"]["eval_path"], cfg["data"]["valid_path"], cfg["train"]["select_metric"]) \
            == ("", "synthetic", "ne")
    chosen = out["chosen"]
    assert chosen["mean"] == min(r["mean"] for r in out["trials"])
    best_step = json.loads((tmp_path / "trials" / f"{chosen['number']:04d}" / "seed_0" / "summary.json")
                           .read_text())["selection"]["best_step"]
    assert out["test"]["rows"]["0"]["step"] == best_step            # the best checkpoint's test figures
    assert out["test"]["values"] == [out["test"]["rows"]["0"]["ne"]]
    assert res.stdout.splitlines()[-1].startswith(f"chosen: trial {chosen['number']}")


# ----------------------------------------------------------------------------- the process runner

CHILD = """
import os, signal, sys, time
got = []
for s in (signal.SIGINT, signal.SIGTERM):
    signal.signal(s, lambda n, f: (got.append(n), print("sig" + "nal", n, flush=True)))
print(f"child {os.getpid()} group {os.getpgrp()}", flush=True)
for _ in range(600):
    time.sleep(0.05)
    if got:
        time.sleep(0.5)                  # a second signal would show up here
        print("sa" + "ved", flush=True)
        sys.exit(128 + got[0])
"""


def start_parent(tmp_path, child=CHILD):
    """A sweep-like process in its own process group running CHILD through run_process
    (it prints the exit code); returns (parent, log path, child pid, child group)."""
    log = tmp_path / "run.log"
    parent = (f"import sys; sys.path.insert(0, {REPO!r}); from experiments import sweep; "
              f"print('code', sweep.run_process([sys.executable, '-c', {child!r}], {str(tmp_path)!r}, "
              f"{str(log)!r}), flush=True)")
    proc = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True,
                            process_group=0)
    deadline, found = time.monotonic() + 30, None
    while found is None and time.monotonic() < deadline:
        time.sleep(0.05)
        found = re.search(r"child (\d+) group (\d+)", log.read_text() if log.exists() else "")
    return proc, log, int(found.group(1)), int(found.group(2))


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_run_process_passes_a_stop_signal_on_once(tmp_path, signum):
    proc, log, child, group = start_parent(tmp_path)
    assert group == child                        # its own group, apart from the sweep's
    os.killpg(proc.pid, signum)                  # as a terminal's Ctrl-C: the sweep's whole group
    out, _ = proc.communicate(timeout=30)
    assert out.split() == ["code", str(128 + signum)]   # the run saved and stopped; the sweep lives on
    assert re.findall(r"\nsignal (\d+)\n", log.read_text()) == [str(int(signum))]
    assert "\nsaved\n" in log.read_text()


def test_a_run_ended_by_a_passed_on_signal_is_a_stop(tmp_path):
    bare = 'import os, time; print(f"child {os.getpid()} group {os.getpgrp()}", flush=True); time.sleep(60)'
    proc, log, child, group = start_parent(tmp_path, bare)   # no handler: dies of the SIGINT
    os.killpg(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
    assert out.split() == ["code", str(128 + signal.SIGINT)]
    assert 128 + signal.SIGINT in sweep.STOP_CODES


def test_a_signal_while_the_run_starts_is_passed_on(tmp_path):
    """SIGINT reaches the driver inside Popen, before the run exists, in a driver that
    started with SIGINT ignored (as a test worker): the run still gets it once it
    exists, and the driver reports the stop."""
    bare = "import time; time.sleep(60)"
    parent = (f"import os, signal, subprocess, sys; sys.path.insert(0, {REPO!r}); "
              f"signal.signal(signal.SIGINT, signal.SIG_IGN); from experiments import child; "
              f"real = subprocess.Popen\n"
              f"def early(*a, **k):\n    os.kill(os.getpid(), signal.SIGINT)\n    return real(*a, **k)\n"
              f"subprocess.Popen = early\n"
              f"print('code', child.run_process([sys.executable, '-c', {bare!r}], {str(tmp_path)!r}, "
              f"{str(tmp_path / 'run.log')!r}), flush=True)")
    out = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, timeout=30)
    assert out.stdout.split() == ["code", str(128 + signal.SIGINT)], out.stderr[-2000:]


def test_a_run_gets_sigterm_when_its_sweep_is_killed(tmp_path):
    proc, log, child, _ = start_parent(tmp_path)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 30
    while "\nsaved\n" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "\nsaved\n" in log.read_text()
    with pytest.raises(ProcessLookupError):
        for _ in range(100):
            os.kill(child, 0)
            time.sleep(0.05)
