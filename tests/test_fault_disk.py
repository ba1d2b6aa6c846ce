"""A filesystem that refuses writes: full (ENOSPC) during a checkpoint save, and a
read-only workdir. Each ends in one line naming the path and what was kept.

Real refusals need a small filesystem: each test mounts a 2 MiB tmpfs (skipped where
mounting is not permitted, e.g. without root) and fills it to leave less room than a
checkpoint needs.
"""

import errno
import logging
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from gemjax.train.checkpoint import CheckpointWriteFailed, Checkpointer, _QuietDiskErrors

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def small_fs(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {r.stderr.strip()}")
    yield str(mnt)
    subprocess.run(["umount", str(mnt)], check=True)


def _fill(mnt, leave):
    """Fill the filesystem of `mnt` until about `leave` bytes are free."""
    st = os.statvfs(mnt)
    with open(os.path.join(mnt, "filler"), "wb") as f:
        f.write(b"\0" * max(0, st.f_bavail * st.f_frsize - leave))


def _train(workdir, steps=2):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    return subprocess.run(
        [sys.executable, "-m", "experiments.train", "--config=tiny", f"--steps={steps}",
         "--override=train.checkpoint_every=2,train.log_every=2,train.eval_every=2,"
         "data.eval_batches=1,train.tensorboard=false,train.baselines=false",
         f"--workdir={workdir}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


# When one of orbax's writes fails, asyncio.run cancels the others and closes its loop;
# a tensorstore write finishing in that moment calls back into the closed loop, and
# tensorstore prints that RuntimeError itself (not through sys.excepthook, so gemjax
# cannot hold it back). It is timing-dependent, says nothing about the save, and is
# the one traceback this test tolerates: exactly these lines, nothing else.
_CLOSED_LOOP = re.compile(
    r"Traceback \(most recent call last\):\n"
    r'  File "[^"]*/asyncio/base_events\.py", line \d+, in call_soon_threadsafe\n'
    r"    self\._check_closed\(\)\n"
    r'  File "[^"]*/asyncio/base_events\.py", line \d+, in _check_closed\n'
    r"    raise RuntimeError\('Event loop is closed'\)\n"
    r"RuntimeError: Event loop is closed\n")


def _without_the_closed_loop_race(out: str) -> str:
    return _CLOSED_LOOP.sub("", out)


def test_closed_loop_race_filter_removes_only_that_traceback():
    race = ("Traceback (most recent call last):\n"
            '  File "/x/asyncio/base_events.py", line 837, in call_soon_threadsafe\n'
            "    self._check_closed()\n"
            '  File "/x/asyncio/base_events.py", line 539, in _check_closed\n'
            "    raise RuntimeError('Event loop is closed')\n"
            "RuntimeError: Event loop is closed\n")
    assert _without_the_closed_loop_race("a\n" + race + "b\n") == "a\nb\n"
    other = race.replace("Event loop is closed\n", "something else\n")
    assert "Traceback" in _without_the_closed_loop_race(other)


def test_quiet_filter_drops_only_refused_writes_and_writers_into_deleted_directories():
    """orbax logs a writer thread's exception with its traceback: after a refusal
    Checkpointer deletes the step's temporary directory, and a writer still running fails
    on a path under it (NOT_FOUND), later than the refusal's own one line."""
    quiet = _QuietDiskErrors()

    def record(exc, path="/x/site-packages/orbax/checkpoint/_src/futures/future.py",
               level=logging.ERROR):
        return logging.LogRecord("absl", level, path, 1, "raised", None, (type(exc), exc, None))

    gone = "/w/checkpoints/2.orbax-checkpoint-tmp"
    late = ValueError(f'NOT_FOUND: Error writing "a/0" at local file "{gone}/state/ocdbt/"')
    assert quiet.filter(record(late))                                # nothing deleted yet
    assert not quiet.filter(record(OSError(errno.ENOSPC, "No space left on device")))
    quiet.gone.add(gone)
    assert not quiet.filter(record(late))
    assert quiet.filter(record(ValueError('NOT_FOUND: at local file "/w/checkpoints/4/x"')))
    assert quiet.filter(record(late, path="/x/gemjax/train/loop.py"))          # not orbax's
    assert quiet.filter(record(late, level=logging.WARNING))


def test_disk_full_during_a_save_is_one_line(small_fs):
    workdir = os.path.join(small_fs, "run")
    os.makedirs(workdir)
    _fill(small_fs, 96 << 10)                   # a checkpoint of the tiny run: ~410 KB
    r = _train(workdir)
    out = _without_the_closed_loop_race(r.stdout + r.stderr)
    assert r.returncode == 1, out[-3000:]
    assert "Traceback" not in out and len(out.splitlines()) < 12, out[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("[gemjax] stopped: ") and "checkpoint step 2 was not written to " \
        f"{workdir}/checkpoints: No space left on device" in last and \
        "kept: no finished checkpoint" in last, last
    assert os.listdir(os.path.join(workdir, "checkpoints")) == []   # partial files deleted


def test_read_only_workdir_is_one_line(small_fs):
    workdir = os.path.join(small_fs, "run")
    os.makedirs(workdir)
    subprocess.run(["mount", "-o", "remount,ro", small_fs], check=True)
    r = _train(workdir)
    out = r.stdout + r.stderr
    assert r.returncode == 1 and "Traceback" not in out, out[-3000:]
    assert r.stderr.strip().splitlines()[-1] == \
        f"[gemjax] stopped: [Errno 30] Read-only file system: '{workdir}/train.lock'"


def test_checkpointer_reports_a_refused_write_once_and_keeps_the_older_steps(small_fs, caplog):
    directory = os.path.join(small_fs, "checkpoints")
    small = {"w": np.arange(1000, dtype=np.float32)}
    with Checkpointer(directory, keep=3) as ckpt:
        ckpt.save(1, small)
        ckpt.wait()
        _fill(small_fs, 64 << 10)
        ckpt.save(2, {"w": np.ones(1000, np.float32) * 2})        # fits
        ckpt.wait()
        with pytest.raises(CheckpointWriteFailed) as e:
            ckpt.save(3, {"w": np.ones(1 << 20, np.float32)})      # 4 MiB: does not fit
            ckpt.wait()
    # close() above did not raise it again
    msg = str(e.value)
    assert e.value.errno == 28 and "\n" not in msg
    assert f"checkpoint step 3 was not written to {directory}: No space left on device" in msg
    assert "kept: checkpoint steps [1, 2]" in msg
    assert not [r for r in caplog.records if "orbax" in r.pathname and r.levelname == "ERROR"]
    assert sorted(os.listdir(directory)) == ["1", "2"]
    with Checkpointer(directory, read_only=True) as ckpt:
        step, got, _ = ckpt.restore({"w": np.zeros(1000, np.float32)})
    assert step == 2 and np.array_equal(np.asarray(got["w"]), np.full(1000, 2, np.float32))
    assert jax.devices()   # the process is still usable
