"""How the programs end on a fault: a config error is its one line (no flag listing), and
a SIGTERM inside distill's training exits 128 + SIGTERM like experiments/train.py."""

import glob
import os
import signal
import subprocess
import sys
import time


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_config_error_is_one_line_without_the_flag_listing(tmp_path):
    r = subprocess.run([sys.executable, "-m", "experiments.train", "--config=tiny",
                        "--override=train.log_every=0", f"--workdir={tmp_path}/w"], cwd=ROOT,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1
    lines = (r.stdout + r.stderr).strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("[gemjax] error: ") and \
        "train.log_every must be >= 1, got 0" in lines[0], r.stdout + r.stderr
    assert not os.path.exists(tmp_path / "w")


def test_sigterm_inside_distill_exits_like_train(tmp_path):
    """SIGTERM once distill's teacher training has started (held at step 2 by the test
    hook; its log is silent, so its config.json says it started)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", GEMJAX_TEST_PAUSE="step:2")
    proc = subprocess.Popen(
        [sys.executable, "-m", "experiments.distill", f"--out={tmp_path}", "--seeds=0",
         "--teacher_steps=4", "--student_steps=2", "--rows=none", "--latency_batch=16",
         "--data_overrides=data.eval_batches=1,data.batch_size=32"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    while not glob.glob(str(tmp_path / "**" / "config.json"), recursive=True):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-3000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert "[distill] stopped by SIGTERM" in out and "Traceback" not in out, out[-3000:]
