"""The experiment drivers that train in child processes (ranking, scaling) go through
experiments.child.run_process: a run stopped by a passed-on signal raises Stopped (the
driver exits 130, a rerun continues), a failed run RuntimeError with the end of its
train.log. The signal passing itself: tests/test_sweep.py (run_process)."""

import os
import signal

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


@pytest.mark.parametrize("driver", ["ranking", "scaling"])
def test_a_stopped_or_failed_child_run_is_reported(driver, tmp_path, monkeypatch):
    mod = {"ranking": ranking, "scaling": scaling}[driver]
    run = {"ranking": ranking.train_one, "scaling": scaling.run_rung}[driver]
    cfg = get_config("tiny")
    for code, err in ((128 + signal.SIGTERM, child.Stopped), (-signal.SIGINT, child.Stopped),
                      (1, RuntimeError)):
        calls = []
        monkeypatch.setattr(mod, "run_process", _fake(code, calls))
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
