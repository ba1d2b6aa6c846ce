"""The experiment drivers that train in child processes (ranking, scaling) go through
experiments.child.run_process: a run stopped by a passed-on signal raises Stopped (the
driver exits 130, a rerun continues), a failed run RuntimeError with the end of its
train.log. The signal passing of one run: tests/test_sweep.py (run_process); of runs side
by side (run_processes): here."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from experiments import child, ranking, scaling
from gemjax.config import get_config


def _fake(code, calls):
    def run(argv, workdir, log_path, **kw):
        calls.append((list(argv), workdir, kw["cwd"]))
        with open(log_path, "a") as f:
            f.write("line one\nthe child's last words\n")
        return code
    return run


def _scaling_rung(runner):
    """One rung as experiments.scaling's main trains it, run by `runner` (run_process's
    signature): prepare_rung, its rung_process in the repository root, then rung_outcome
    of the exit code."""
    def run(cfg, workdir, log):
        assert scaling.prepare_rung(cfg, workdir, log) is None
        argv, wd, train_log = scaling.rung_process(workdir)
        return scaling.rung_outcome(wd, runner(argv, wd, train_log, cwd=scaling.REPO))
    return run


@pytest.mark.parametrize("driver", ["ranking", "scaling"])
def test_a_stopped_or_failed_child_run_is_reported(driver, tmp_path, monkeypatch):
    cfg = get_config("tiny")
    for code, err in ((128 + signal.SIGTERM, child.Stopped), (-signal.SIGINT, child.Stopped),
                      (1, RuntimeError)):
        calls = []
        if driver == "ranking":
            monkeypatch.setattr(ranking, "run_process", _fake(code, calls))
            run = ranking.train_one
        else:
            run = _scaling_rung(_fake(code, calls))
        wd = str(tmp_path / f"{driver}_{code}")
        with pytest.raises(err) as e:
            run(cfg, wd, log=lambda s: None)
        (argv, workdir, cwd), = calls
        assert os.path.abspath(workdir) == os.path.abspath(wd) and argv[1:3] == ["-m", f"experiments.{driver}"]
        assert cwd == os.path.dirname(os.path.dirname(os.path.abspath(child.__file__)))
        if err is child.Stopped:
            assert f"signal {abs(code) % 128}" in str(e.value)
        else:
            assert "the child's last words" in str(e.value) and "exit" in str(e.value)
            assert os.path.exists(os.path.join(wd, "train.log"))


# a run that waits for its partner run (index i ^ 1) to have started, then exits i; it
# counts the runs alive at its start (their live_* files)
PAIRED = """
import glob, os, sys, time
d, i = sys.argv[1], int(sys.argv[2])
open(os.path.join(d, f"start_{i}"), "w").close()
open(os.path.join(d, f"live_{i}"), "w").close()
print("alive", len(glob.glob(os.path.join(d, "live_*"))), flush=True)
for _ in range(600):
    if os.path.exists(os.path.join(d, f"start_{i ^ 1}")):
        break
    time.sleep(0.05)
else:
    sys.exit(99)
os.remove(os.path.join(d, f"live_{i}"))
sys.exit(i)
"""


def test_run_processes_runs_jobs_side_by_side_and_no_more(tmp_path):
    """Runs 0 and 1 (then 2 and 3) each wait for the other to start: one at a time, run 0
    would wait in vain (exit 99); never more than 2 alive at once."""
    runs = [([sys.executable, "-c", PAIRED, str(tmp_path), str(i)], str(tmp_path),
             str(tmp_path / f"run{i}.log")) for i in range(4)]
    ended = []
    codes = child.run_processes(runs, 2, done=lambda i, code: ended.append((i, code)))
    assert codes == [0, 1, 2, 3]
    assert sorted(ended) == [(i, i) for i in range(4)]
    alive = [int(n) for i in range(4)
             for n in re.findall(r"alive (\d+)", (tmp_path / f"run{i}.log").read_text())]
    assert len(alive) == 4 and max(alive) <= 2
    with pytest.raises(ValueError, match="jobs"):
        child.run_processes(runs, 0)


STOPPABLE = """
import os, signal, sys, time
got = []
for s in (signal.SIGINT, signal.SIGTERM):
    signal.signal(s, lambda n, f: (got.append(n), print("sig" + "nal", n, flush=True)))
open(sys.argv[1], "w").close()
for _ in range(600):
    time.sleep(0.05)
    if got:
        time.sleep(0.3)                  # a second signal would show up here
        sys.exit(128 + got[0])
"""


def test_a_signal_stops_every_run_in_progress_once_and_starts_no_other(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(child.__file__)))
    runs = [([sys.executable, "-c", STOPPABLE, str(tmp_path / f"up{i}")], str(tmp_path),
             str(tmp_path / f"run{i}.log")) for i in range(3)]
    driver = (f"import sys; sys.path.insert(0, {root!r}); from experiments import child; "
              f"print('codes', *child.run_processes({runs!r}, 2), flush=True)")
    proc = subprocess.Popen([sys.executable, "-c", driver], stdout=subprocess.PIPE, text=True,
                            process_group=0)
    for _ in range(600):
        if (tmp_path / "up0").exists() and (tmp_path / "up1").exists():
            break
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGTERM)       # the driver's group only: runs have their own
    out, _ = proc.communicate(timeout=60)
    assert out.split() == ["codes"] + [str(128 + signal.SIGTERM)] * 3
    for i in (0, 1):
        assert re.findall(r"\nsignal (\d+)\n", (tmp_path / f"run{i}.log").read_text()) == [
            str(int(signal.SIGTERM))]
    assert not (tmp_path / "run2.log").exists() and not (tmp_path / "up2").exists()
