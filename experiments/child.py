"""A training run in a child process, as the experiment drivers (sweep, ranking, scaling)
start it: its output appended to a log file, a SIGINT / SIGTERM to the driver passed on
once (the run saves its state and exits 128 + signal; the driver waits for that save),
the child sent SIGTERM when the driver dies (kill -9), and a run still saving after an
earlier driver's stop waited for (its workdir's training lock)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shlex
import signal
import subprocess
import time
from typing import Callable, Sequence

# the repository root: the drivers' children run there, with it first on PYTHONPATH
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# a run that saved and stopped on a signal (128 + signum), or died of one before its handler
STOP_CODES = (128 + signal.SIGINT, 128 + signal.SIGTERM, -signal.SIGINT, -signal.SIGTERM)


class Stopped(Exception):
    """A child run stopped on a signal after saving; rerunning the driver continues it."""


def check_stopped(code: int, what: str) -> None:
    """Raise Stopped ("<what> stopped by signal N") when exit code `code` is a stop."""
    if code in STOP_CODES:
        raise Stopped(f"{what} stopped by signal {abs(code) % 128}")


def pdeathsig() -> None:      # in the child before exec: SIGTERM when the driver dies (kill -9)
    with contextlib.suppress(Exception):
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG


def wait_unlocked(workdir: str, timeout: float = 600.0) -> None:
    """Wait until no process holds WORKDIR's training lock (a run of an earlier driver
    process still saving after a stop); RuntimeError after `timeout` seconds."""
    from gemjax.train.guards import LOCK_FILE      # no jax import
    path = os.path.join(workdir, LOCK_FILE)
    if not os.path.exists(path):
        return
    deadline, said = time.monotonic() + timeout, False
    with open(path, "a") as fh:
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(fh, fcntl.LOCK_UN)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{workdir} is still held by another run after {timeout:.0f} s")
                if not said:
                    print(f"[gemjax] waiting for the run still holding {path}", flush=True)
                    said = True
                time.sleep(1.0)


def run_process(argv: Sequence[str], workdir: str, log_path: str, *, cwd: str | None = None,
                env: dict | None = None) -> int:
    """Run `argv` with stdout and stderr appended to `log_path`; its exit code. A
    SIGINT / SIGTERM to this process is passed on (the run saves and exits 128 + signal;
    128 + signal is returned whenever a passed-on signal ended it); the run gets SIGTERM
    if this process dies."""
    return run_processes([(argv, workdir, log_path)], 1, cwd=cwd, env=env)[0]


def run_processes(runs: Sequence[tuple[Sequence[str], str, str]], jobs: int = 1, *,
                  cwd: str | None = None, env: dict | None = None,
                  done: Callable[[int, int], None] | None = None) -> list[int]:
    """Run each (argv, workdir, log_path) of `runs` as run_process runs one, up to `jobs`
    side by side (one GPU holds several small runs); their exit codes, in order.

    A SIGINT / SIGTERM to this process is passed on once to every run in progress, and no
    further run starts: a run the signal ended, or one never started, gets 128 + signal.
    done(i, code) is called in this process as run i ends (never for a run not started); it
    must not raise, since the other runs go on."""
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    passed: list[int] = []      # the signals this process got, in order
    running: dict[int, list] = {}   # run index -> [child, signals sent to it, its log]
    codes: list[int | None] = [None] * len(runs)

    def pass_on() -> None:
        for state in list(running.values()):
            while state[0] is not None and state[1] < len(passed):
                state[1] += 1
                state[0].send_signal(passed[state[1] - 1])

    def forward(signum, _frame):
        passed.append(signum)
        pass_on()

    # the handlers go in before a child starts: a signal that arrives while it starts is
    # passed on once it exists (never lost), and the child starts with the default actions
    # (a caught signal is reset at exec, where an ignored one would stay ignored)
    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        nxt = 0
        while nxt < len(runs) or running:
            while not passed and nxt < len(runs) and len(running) < jobs:
                argv, workdir, log_path = runs[nxt]
                wait_unlocked(workdir)
                log = open(log_path, "ab")
                log.write(f"\n$ {shlex.join(argv)}\n".encode())
                log.flush()
                running[nxt] = [None, 0, log]
                # its own process group: a terminal's Ctrl-C reaches the driver, which passes
                # it on once (a second signal would stop the run without its save)
                running[nxt][0] = subprocess.Popen(
                    list(argv), stdout=log, stderr=subprocess.STDOUT, cwd=cwd, env=env,
                    stdin=subprocess.DEVNULL, preexec_fn=pdeathsig, process_group=0)
                nxt += 1
                pass_on()
            if passed:
                for i in range(nxt, len(runs)):
                    codes[i] = 128 + passed[0]
                nxt = len(runs)
            for i, (proc, _, log) in list(running.items()):
                code = proc.poll() if len(running) > 1 or nxt < len(runs) else proc.wait()
                if code is None:
                    continue
                del running[i]
                log.close()
                codes[i] = 128 + passed[0] if passed and code != 0 else code
                if done is not None:
                    done(i, codes[i])
            if running:
                time.sleep(0.05)
        return codes
    finally:
        for state in running.values():
            state[2].close()
        for s, h in old.items():
            signal.signal(s, h)


def repo_env() -> dict:
    """This process's environment with REPO first on PYTHONPATH (a child's env)."""
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join([REPO] + rest)}


def log_tail(log_path: str, chars: int = 3000) -> str:
    """The last `chars` characters of a run's log ('' when it has none)."""
    try:
        with open(log_path, errors="replace") as f:
            return f.read()[-chars:]
    except FileNotFoundError:
        return ""


def train_here(cfg, workdir: str, who: str) -> None:
    """The child's side: train(cfg) in workdir, its log lines on stdout; a stop by SIGINT /
    SIGTERM (after its checkpoint) ends in one line and exit 128 + signal."""
    import sys

    from gemjax.train.checkpoint import join_background_threads
    from gemjax.train.guards import Interrupted
    from gemjax.train.loop import train
    try:
        train(cfg, workdir, log=lambda s: print(s, flush=True))
    except Interrupted as e:
        print(f"[{who}] {e}", flush=True)
        join_background_threads()      # Orbax writes still in flight end before the exit
        sys.exit(128 + e.signum)
