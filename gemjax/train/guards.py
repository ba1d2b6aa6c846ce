"""What guards a training run: the workdir lock, stop signals, resume compatibility.

    with lock_workdir(workdir), StopSignals() as stop:   # one run per workdir
        ...
        if stop.agreed(at_log_point):                     # SIGINT / SIGTERM seen
            save; raise Interrupted(stop.signum, step)
    check_resume(meta, cfg, step)                         # ResumeMismatch if not

Workdir lock: `fcntl.flock` on WORKDIR/train.lock, held for the life of the
run; the kernel drops it when the process ends in any way (kill -9 included),
so a stale lock file never blocks a later run. The file records its holder
(pid, host, start time), which a refused second run names (WorkdirBusy).

Stop signals: the first SIGINT or SIGTERM only records the signal; the loop
checks it at every step boundary (with several processes: at log points, where
the processes agree by an all-gather, so all stop after the same step), saves
the state it holds and raises Interrupted (a KeyboardInterrupt whose `signum`
and `step` say why and where). A second signal raises KeyboardInterrupt at once.

Resume compatibility: a checkpoint's meta["run"] (`run_fields`) holds the config
fields a resumed run must share with it (every data field but eval_batches,
host_workers and accept_changed_files; every model field but norm_impl, which picks
an implementation of the same function; and train.seed): with any of them changed
the stream, the tables' vocabularies, the batch or the model's function differ (a
flag such as model.rope changes no parameter shape, so the restore alone would not
notice), and the resumed run would silently be another run. So is a checkpoint whose meta["features"] (the feature schema it was trained
on) differs from the run's in what the state means (gemjax.features.differences:
tables' vocab / dim / pooling, features, sequences, surfaces, tasks). Fewer
train.steps than the checkpoint's step is refused too (extending a
run with more steps is how a finished run continues). Mesh shape, device count,
learning rates and intervals may change.

Test hook (`pause_for_test`): GEMJAX_TEST_PAUSE=POINT:STEP, POINT one of "step"
(after train step STEP returned), "eval" (before its eval), "save" (after its
checkpoint save started), makes the loop print "[gemjax] test pause at POINT STEP"
and wait there (up to 120 s) until a stop signal arrives, so tests can signal a
real run at a known place ("commit": gemjax.train.checkpoint).
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import signal
import socket
import sys
import threading
import time
from typing import Callable

from gemjax.config import ALIASES, field_paths, schema_of
from gemjax.features import FeatureSchema, differences

LOCK_FILE = "train.lock"
# DataConfig fields a resumed run may change (they change neither the stream nor the state;
# paths below data.)
FREE_DATA_FIELDS = ("eval_batches", "host_workers", "accept_changed_files")
# model fields that choose an implementation of the same function (free on resume; paths
# below model.)
FREE_MODEL_FIELDS = ("norm_impl",)


class RunRefused(Exception):
    """A run that cannot start as asked (the message says why and what to do)."""


class WorkdirBusy(RunRefused):
    """Another live run holds the workdir."""


class ResumeMismatch(RunRefused, ValueError):
    """A resume whose config does not fit the checkpoint."""


class Interrupted(KeyboardInterrupt):
    """The run stopped on a signal after saving `step` (None: nothing new saved)."""

    def __init__(self, signum: int, step: int | None, message: str):
        super().__init__(message)
        self.signum, self.step, self.message = signum, step, message

    def __str__(self) -> str:
        return self.message


class lock_workdir:
    """Context manager: hold WORKDIR/train.lock (fcntl.flock) or raise WorkdirBusy."""

    def __init__(self, workdir: str, enabled: bool = True):
        self.path = os.path.join(workdir, LOCK_FILE)
        self.enabled = enabled
        self._fd: int | None = None

    def __enter__(self) -> "lock_workdir":
        if not self.enabled:
            return self
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
            os.close(fd)
            try:
                h = json.loads(holder)
                who = f"pid {h['pid']} on host {h['host']}, started {h['started']}"
            except (ValueError, KeyError, TypeError):
                who = "holder not recorded yet"
            raise WorkdirBusy(f"workdir {os.path.dirname(self.path)} is in use by another run "
                              f"({who}; lock {self.path}): wait for it to end or stop it, "
                              f"or use another --workdir") from None
        os.ftruncate(fd, 0)
        started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                  "started": started}).encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            os.close(self._fd)          # releases the lock; the file stays (no unlink race)
            self._fd = None


class StopSignals:
    """Context manager: SIGINT / SIGTERM recorded in `signum` (first), raised (second).

    Installs handlers only in the main thread; elsewhere it records nothing and
    the default handlers stay.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.signum: int | None = None
        self._old: dict = {}

    def _handle(self, signum, frame):
        if self.signum is not None:
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}: stopping at once")
        self.signum = signum
        # os.write, not print: a handler may run inside a print of the main thread
        os.write(2, f"[gemjax] {signal.Signals(signum).name}: stopping after this step with a "
                    f"checkpoint (send it again to stop at once)\n".encode())

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old = {}

    def agreed(self, at_log_point: bool) -> bool:
        """Whether to stop now: every step with one process; with several, at log
        points only, when any process has seen a signal (every process agrees)."""
        import jax
        if jax.process_count() == 1:
            return self.signum is not None
        if not at_log_point:
            return False
        import numpy as np
        from jax.experimental import multihost_utils
        seen = multihost_utils.process_allgather(np.int32(self.signum or 0))
        if self.signum is None and np.any(seen):
            self.signum = int(np.max(seen))
        return bool(np.any(seen))

    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else "signal"


def pause_for_test(point: str, step: int, stop: StopSignals, log: Callable[[str], None]) -> None:
    """The GEMJAX_TEST_PAUSE hook (module docstring); a no-op unless it names point:step."""
    want = os.environ.get("GEMJAX_TEST_PAUSE")
    if want != f"{point}:{step}":
        return
    log(f"[gemjax] test pause at {point} {step}")
    sys.stdout.flush()
    deadline = time.monotonic() + 120
    while stop.signum is None and time.monotonic() < deadline:
        time.sleep(0.01)


def run_fields(cfg) -> dict:
    """{"data.<path>": value, "model.<path>": value, "train.seed": seed} over the leaf
    fields of data and model (gemjax.config.field_paths): what a resume must keep (JSON
    values)."""
    free = {f"data.{k}" for k in FREE_DATA_FIELDS} | {f"model.{k}" for k in FREE_MODEL_FIELDS}
    out = {k: v for k, v in {**field_paths(cfg.data, "data."),
                             **field_paths(cfg.model, "model.")}.items() if k not in free}
    out["train.seed"] = cfg.train.seed
    return json.loads(json.dumps(out))


def check_resume(meta: dict, cfg, step: int, where: str) -> None:
    """Refuse (ResumeMismatch) a resume of the checkpoint `step` (meta) with `cfg`
    when a run field differs or cfg.train.steps < step; names each field and both values."""
    problems = []
    if cfg.train.steps < step:
        problems.append(f"train.steps (--steps) is {cfg.train.steps}, below the checkpoint's "
                        f"step {step} (pass --steps >= {step}; more steps extend the run)")
    # a checkpoint of the flat config names its fields by their old paths (ALIASES)
    saved = {ALIASES.get(k, k): v for k, v in (meta.get("run") or {}).items()}
    for field, value in run_fields(cfg).items():
        if field in saved and saved[field] != value:
            problems.append(f"{field} is {value!r}, the checkpoint's is {saved[field]!r}")
    if meta.get("features") is not None:        # the feature schema (gemjax.features)
        problems += differences(FeatureSchema.from_dict(meta["features"]), schema_of(cfg))
    if problems:
        raise ResumeMismatch(f"cannot resume {where} at step {step}: " + "; ".join(problems)
                             + ". Rerun with the checkpoint's values, or use a new --workdir")
