"""What a run records besides its checkpoints: metrics rows, TensorBoard scalars, run facts.

    runlog = RunLog(workdir, start_step=start, tensorboard=cfg.train.tensorboard)
    runlog.append({"step": 10, "kind": "train", "loss": 0.52, "ne": 0.91})
    facts = run_facts(mesh)        # devices, mesh, versions, git revision
    rows, torn = read_metrics(path)      # metrics.jsonl, a torn last row dropped
    check_train_files(cfg, workdir, resuming)   # WORKDIR/train_files.json: refuse changed files
    timer = CompileTimer()         # seconds JAX spends tracing and compiling from here on
    with Heartbeat("the first step (compiling)", 60):   # a line a minute while it lasts
        state, m = train_step(state, batch)
    window = ProfileWindow((5, 8), os.path.join(workdir, "profile"), start, end)  # steps 5..7

`RunLog` owns WORKDIR/metrics.jsonl (one JSON object per row, appended) and, when
TensorBoard logging is on, writes every row's numbers as scalars under
WORKDIR/tensorboard through a `tensorboardX.SummaryWriter`: tag "<kind>/<key>"
("train/loss", "eval/ne", "eval/task1/auc", "eval/hr@10", kept as written), at the
row's "step", as TensorBoard's float32 scalar values, one event per row. The
writer's thread writes each row to the event file as it comes and flushes it
within a second (flush_secs=1); `close()`, dropping the RunLog and the
interpreter's exit write the rest, so a killed run's event file lacks at most its last second of rows, which
metrics.jsonl holds. A resumed run (start_step > 0) opens a new event file with
purge_step = start_step + 1: TensorBoard drops the older files' points at that
step and later, as the loop drops those rows from metrics.jsonl, so a resume
shows no doubled curve; when there are no older files (the run so far had
TensorBoard off), the new file starts with the rows metrics.jsonl holds. A fresh
run (start_step = 0) deletes the workdir's old event files.

TensorBoard logging needs the `tensorboardX` package (a gemjax dependency). With
tensorboard=False, or when tensorboardX does not import, only metrics.jsonl is
written, one log line says so, and `RunLog.tensorboard_dir` is None (the loop
records it in summary.json).
"""

from __future__ import annotations

import contextlib
import datetime
import glob
import importlib.metadata
import json
import math
import os
import platform
import subprocess
import threading
import time
import weakref
from typing import Callable

import jax

TENSORBOARD_SUBDIR = "tensorboard"
EVENT_FILE_GLOB = "events.out.tfevents.*"


def _scalars(row: dict) -> dict[str, float]:
    """The row's numbers (ints, floats; not bools, strings or None) keyed by tag."""
    kind = row.get("kind", "metrics")
    return {f"{kind}/{k}": float(v) for k, v in row.items()
            if k not in ("step", "kind") and isinstance(v, (int, float)) and not isinstance(v, bool)}


class RunLog:
    """Appends metrics rows to WORKDIR/metrics.jsonl and to TensorBoard (see module doc).

    enabled: False on every process but the writing one (then nothing is written).
    start_step: the step the run resumes from (0 for a fresh run); rows the caller
      kept in metrics.jsonl are not rewritten here.
    tensorboard: write TensorBoard scalars too (when tensorboardX imports).
    """

    def __init__(self, workdir: str, *, start_step: int = 0, tensorboard: bool = True,
                 enabled: bool = True, log: Callable[[str], None] = print):
        self.metrics_path = os.path.join(workdir, "metrics.jsonl")
        self.enabled = enabled
        self.tensorboard_dir: str | None = None
        self._writer = None
        if not (enabled and tensorboard):
            return
        try:
            from tensorboardX import SummaryWriter
            from tensorboardX.proto.summary_pb2 import Summary
        except ImportError as e:
            log(f"[gemjax] TensorBoard logging off: tensorboardX does not import ({e}); "
                f"metrics.jsonl only (pip install tensorboardX, or set train.tensorboard=false)")
            return
        self._Summary = Summary
        self.tensorboard_dir = os.path.join(workdir, TENSORBOARD_SUBDIR)
        os.makedirs(self.tensorboard_dir, exist_ok=True)
        older = glob.glob(os.path.join(self.tensorboard_dir, EVENT_FILE_GLOB))
        if start_step == 0:
            for old in older:
                os.remove(old)
        # file names sort in creation order (TensorBoard reads them in name order):
        # events.out.tfevents.<unix seconds>.<host>.<nanoseconds within the second>
        self._writer = SummaryWriter(self.tensorboard_dir,
                                     purge_step=start_step + 1 if start_step > 0 and older else None,
                                     flush_secs=1, filename_suffix=f".{time.time_ns() % 10**9:09d}")
        self._closer = weakref.finalize(self, self._writer.close)   # a run log dropped unclosed
        if start_step > 0 and not older and os.path.exists(self.metrics_path):
            with open(self.metrics_path) as f:
                for line in f:
                    if line.strip():
                        self._write_event(json.loads(line))

    def append(self, row: dict) -> None:
        """Append one row (a JSON object with "step" and "kind") to metrics.jsonl (flushed
        before this returns) and, when on, its numbers to TensorBoard (written by the
        writer's thread, flushed within a second)."""
        if not self.enabled:
            return
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self._writer is not None:
            self._write_event(row)

    def _write_event(self, row: dict) -> None:
        # one Summary per row; FileWriter.add_summary keeps the tags as written
        # (SummaryWriter.add_scalar would rewrite "hr@10" to "hr_10")
        values = [self._Summary.Value(tag=tag, simple_value=v) for tag, v in _scalars(row).items()]
        self._writer.file_writer.add_summary(self._Summary(value=values), int(row["step"]),
                                             time.time())

    def close(self) -> None:
        """Write every pending row and close the event file."""
        if self._writer is not None:
            self._closer()
            self._writer = None


def read_metrics(path: str, log: Callable[[str], None] = print) -> tuple[list[dict], int]:
    """(rows, torn) of a metrics.jsonl: its JSON objects in order, and 1 when its last
    line is torn (a crash or a full disk mid-append left a partial row that does not
    parse: dropped, logged naming the file and its bytes), else 0. A line before the
    last that does not parse is a ValueError naming the file and line. No file: ([], 0)."""
    if not os.path.exists(path):
        return [], 0
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    numbered = [(n, line) for n, line in enumerate(lines, 1) if line.strip()]
    rows, torn = [], 0
    for i, (n, line) in enumerate(numbered):
        try:
            row = json.loads(line)
            if not isinstance(row, dict):
                raise ValueError(f"a JSON {type(row).__name__}, not an object")
        except ValueError as e:          # JSONDecodeError, UnicodeDecodeError, not an object
            if i < len(numbered) - 1:
                raise ValueError(f"{path} line {n} is not a metrics row ({e}); the rows after "
                                 f"it are whole, so this is not a torn append: repair or move "
                                 f"the file") from None
            torn = 1
            log(f"[gemjax] {path} line {n} is a torn row ({len(line)} bytes: {line[:60]!r}...): "
                f"dropped (counted metrics_lines_torn)")
            continue
        rows.append(row)
    return rows, torn


TRAIN_FILES = "train_files.json"


def check_train_files(cfg, workdir: str, resuming: bool, *, lead: bool = True,
                      log: Callable[[str], None] = print) -> None:
    """WORKDIR/train_files.json: the Parquet train files (path, bytes, rows, mtime:
    `gemjax.data.files.file_facts`) a run reads, recorded when it starts; a resume
    whose files differ (added, removed, other bytes or rows) is refused
    (guards.ResumeMismatch naming each file), since every epoch's shuffle spans the
    whole file list and a changed one re-reads or skips rows, unless
    data.accept_changed_files: then the changes are logged and appended to the
    record's "accepted" list with the new file list. Nothing for other sources.
    lead: this process writes the record (every process checks it)."""
    if cfg.data.source != "parquet":
        return
    from gemjax.data.files import file_changes, file_facts
    from gemjax.train.guards import ResumeMismatch

    path = os.path.join(workdir, TRAIN_FILES)
    now = file_facts(cfg.data.train_path)
    record = {"train_path": cfg.data.train_path, "files": now, "accepted": []}
    if resuming and os.path.exists(path):
        try:
            with open(path) as f:
                before = json.load(f)
            changes = file_changes(before["files"], now)
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: not a train file record ({e}); move it away to record "
                             f"the current files") from None
        if not changes:
            return
        shown = "; ".join(changes[:8]) + (f"; and {len(changes) - 8} more" if len(changes) > 8 else "")
        if not cfg.data.accept_changed_files:
            raise ResumeMismatch(
                f"the train files (data.train_path={cfg.data.train_path}) differ from those the "
                f"run started with ({path}): {shown}. Every epoch's shuffle spans the whole file "
                f"list, so resuming would re-read or skip rows: restore the files, start a new "
                f"workdir, or accept the change with data.accept_changed_files=true")
        log(f"[gemjax] train files changed since {path}: {shown}; accepted "
            f"(data.accept_changed_files): the shuffle from here on covers the new file list")
        record["accepted"] = before.get("accepted", []) + [
            {"time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
             "changes": changes}]
    elif resuming:
        log(f"[gemjax] no {path} (a run started before train files were recorded): "
            f"recording the current {len(now)} files")
    if lead:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(record, f, indent=1)
        os.replace(tmp, path)


class CompileTimer:
    """Seconds JAX spends tracing, lowering and compiling programs (or loading them from
    the persistent compilation cache) from construction on, in any thread, as reported
    through jax.monitoring. `seconds` is read at any time; `stop()` (or garbage
    collection) unregisters the listener."""

    EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
              "/jax/core/compile/jaxpr_to_mlir_module_duration",
              "/jax/core/compile/backend_compile_duration")

    def __init__(self):
        total = self._total = [0.0]
        events = set(self.EVENTS)

        def listener(event, duration, **_):
            if event in events:
                total[0] += duration

        jax.monitoring.register_event_duration_secs_listener(listener)
        self._finalize = weakref.finalize(self, _unregister, listener)

    @property
    def seconds(self) -> float:
        return self._total[0]

    def stop(self) -> float:
        self._finalize()
        return self._total[0]


class Heartbeat:
    """A context manager that logs "[gemjax] <what>: N s so far" every `every` seconds while
    its block runs (from a daemon thread), so a long silent call (a train step compiling for
    minutes) shows it is alive. Nothing is logged for a block shorter than `every`; every
    <= 0 logs nothing."""

    def __init__(self, what: str, every: float, log: Callable[[str], None] = print):
        self.what, self.every, self.log = what, every, log
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def _beat(self, t0: float) -> None:
        while not self._done.wait(self.every):
            self.log(f"[gemjax] {self.what}: {time.perf_counter() - t0:.0f} s so far")

    def __enter__(self) -> Heartbeat:
        if self.every > 0:
            self._thread = threading.Thread(target=self._beat, args=(time.perf_counter(),),
                                            name="gemjax-heartbeat", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()


def _unregister(listener) -> None:
    try:
        jax.monitoring.unregister_event_duration_listener(listener)
    except (AssertionError, ValueError):   # already gone (jax.monitoring.clear_event_listeners)
        pass


def timing(meter, batch_size: int, wall_time_s: float, compile_s: float) -> dict:
    """summary.json's timing figures from the loop's Throughput meter (updated once per
    log interval, opened just before the first step):

    wall_time_s: the whole train() call (setup, compile, steps, eval, checkpoints).
    compile_s: JAX tracing + compiling (or cache loading) during it (CompileTimer).
    first_interval_s / first_interval_steps: the first log interval, which holds the
      train step's compilation (eval and checkpoint time excluded, as everywhere here).
    step_time_s: steady seconds per step, over the intervals after the first.
    warmup_s: first_interval_s - first_interval_steps * step_time_s, the first
      interval's time beyond that of as many steady steps.
    samples_per_sec / tokens_per_sec: steady rates, after the first interval.
    samples_per_sec_incl_compile: over every interval, the first one included.
    A figure that needs more log intervals than the run had is None.
    """
    steady = meter.steady_samples_per_sec
    first_s, first_samples = meter.first_interval
    step_s = batch_size / steady if steady and math.isfinite(steady) else None
    first_steps = first_samples // batch_size if first_s is not None else None

    def num(x):
        return x if x is not None and math.isfinite(x) else None

    return {"wall_time_s": wall_time_s, "compile_s": compile_s,
            "first_interval_s": first_s, "first_interval_steps": first_steps,
            "step_time_s": step_s,
            "warmup_s": first_s - first_steps * step_s if first_s is not None and step_s else None,
            "samples_per_sec": num(steady), "tokens_per_sec": num(meter.steady_tokens_per_sec),
            "samples_per_sec_incl_compile": num(meter.total_samples_per_sec)}


class HostWait:
    """Seconds the train loop spends blocked on its input (waiting for the Feeder's next
    step), and the steady share of it.

    `timed(items)` wraps the feeder's iterator and adds the time each `next` blocks;
    `log_point(done)` marks the total at a log point. The steady figures run from the
    first log point (whose interval holds the compile) to the last, as
    timing()'s steady step time does."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.seconds, self._clock = 0.0, clock
        self._first: tuple[int, float] | None = None
        self._last: tuple[int, float] | None = None

    def timed(self, items):
        it = iter(items)
        while True:
            t = self._clock()
            try:
                item = next(it)
            except StopIteration:
                return
            self.seconds += self._clock() - t
            yield item

    def log_point(self, done: int) -> None:
        if self._first is None:
            self._first = (done, self.seconds)
        self._last = (done, self.seconds)

    @property
    def steady_per_step(self) -> float | None:
        """Seconds blocked per step between the first and the last log point (None with
        fewer than two log points)."""
        if self._first is None or self._last[0] <= self._first[0]:
            return None
        return (self._last[1] - self._first[1]) / (self._last[0] - self._first[0])


def peak_memory_bytes(devices) -> int | None:
    """Largest peak_bytes_in_use of `devices`' memory_stats() (None where the backend
    keeps no such statistic, e.g. CPU)."""
    peaks = []
    for d in devices:
        try:
            stats = d.memory_stats()
        except Exception:  # noqa: BLE001 - a backend without memory statistics
            stats = None
        if stats and "peak_bytes_in_use" in stats:
            peaks.append(int(stats["peak_bytes_in_use"]))
    return max(peaks) if peaks else None


def efficiency(step_time_s: float | None, model_flops_per_step: float | None,
               peak_flops_per_device: float | None, num_devices: int,
               host_wait_s: float | None, peak_memory: int | None) -> dict:
    """summary.json's efficiency figures:

    model_flops_per_step: analytic model FLOPs of one step, all devices
      (gemjax.perf.model_flops; None for models it does not count).
    peak_flops_per_device: the spec peak of the device kind in the model's dtype
      (gemjax.perf.mfu.PEAK_FLOPS; None on CPU and unknown kinds).
    e2e_mfu: model_flops_per_step / step_time_s / (peak_flops_per_device x devices),
      the steady step with its host feed (None where a factor is None).
    host_wait_s / host_wait_share: steady seconds per step blocked on the feed
      (HostWait), and their share of step_time_s.
    peak_memory_bytes: peak_memory_bytes() of the run's devices.
    """
    ok = step_time_s and model_flops_per_step and peak_flops_per_device
    return {"model_flops_per_step": model_flops_per_step,
            "peak_flops_per_device": peak_flops_per_device,
            "e2e_mfu": (model_flops_per_step / step_time_s / (peak_flops_per_device * num_devices)
                        if ok else None),
            "host_wait_s": host_wait_s,
            "host_wait_share": host_wait_s / step_time_s if host_wait_s is not None and step_time_s
            else None,
            "peak_memory_bytes": peak_memory}


def run_efficiency(cfg, mesh, stream, step_time_s: float | None, waits: HostWait,
                   peak_flops: float | None) -> dict:
    """efficiency()'s figures of a run on `mesh` (every device one batch shard). Model
    FLOPs per step: the analytic count (gemjax.perf.model_flops; the teacher on the
    synthetic stream, whose batches are a pure function of the step) averaged over the
    stream's first two steps, every shard; None otherwise. Peak: `peak_flops`, else the
    device kind's spec peak in the model's dtype (bf16; tf32 for float32 matmuls)."""
    import numpy as np

    from gemjax.perf import mfu
    from gemjax.perf.model_flops import shard_seq_lengths, teacher_step_flops

    devices = list(mesh.devices.flat)
    n = len(devices)
    flops = None
    if cfg.model.kind == "teacher" and cfg.data.source == "synthetic":
        try:
            per = [sum(teacher_step_flops(cfg, lens) for i in range(n)
                       for lens in shard_seq_lengths(stream.shard_batch(step, i, n)[0], 1))
                   for step in range(min(2, max(cfg.train.steps, 1)))]
            flops = float(np.mean(per))
        except ValueError:           # a schema the count does not cover
            flops = None
    try:
        peak = mfu.peak_flops(devices[0].device_kind,
                              "bf16" if cfg.model.dtype == "bfloat16" else "tf32", peak_flops)
    except ValueError:               # CPU and unknown device kinds
        peak = None
    local = [d for d in devices if d.process_index == jax.process_index()]
    return efficiency(step_time_s, flops, peak, n, waits.steady_per_step, peak_memory_bytes(local))


def git_revision(path: str | None = None) -> tuple[str | None, bool | None]:
    """(commit, dirty) of the git checkout holding the gemjax package (or `path`);
    (None, None) when the code is not in a git checkout or git is missing."""
    pkg = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    where = path or pkg

    def git(*args):
        return subprocess.run(["git", "-C", where, *args], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()

    try:
        top = git("rev-parse", "--show-toplevel")
        if path is None and os.path.realpath(top) != os.path.realpath(pkg):
            return None, None      # gemjax installed inside some other repository's tree
        rev = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
        return rev, dirty
    except (OSError, subprocess.SubprocessError):
        return None, None


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def run_facts(mesh) -> dict:
    """Where and with what a run ran, for summary.json:

    {"devices": {"count", "kind", "platform", "processes"} of the mesh's devices,
     "mesh": {axis: size}, "versions": {"python", "jax", "jaxlib", "gemjax"} (gemjax
     None when not installed), "git_revision": commit or None, "git_dirty": bool or
     None (`git_revision`), "host": this host's name, "finished_at": UTC ISO time}.
    """
    import jaxlib
    devs = list(mesh.devices.flat)
    rev, dirty = git_revision()
    return {
        "devices": {"count": len(devs), "kind": devs[0].device_kind, "platform": devs[0].platform,
                    "processes": len({d.process_index for d in devs})},
        "mesh": {str(k): int(v) for k, v in dict(mesh.shape).items()},
        "versions": {"python": platform.python_version(), "jax": jax.__version__,
                     "jaxlib": jaxlib.__version__, "gemjax": _version("gemjax")},
        "git_revision": rev, "git_dirty": dirty, "host": platform.node(),
        "finished_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


@contextlib.contextmanager
def idle_pause(paused: Callable[[], contextlib.AbstractContextManager], state):
    """`paused()` (e.g. Throughput.paused) entered once `state` is ready: the steps
    dispatched before it (asynchronous dispatch runs a step or two ahead) finish on the
    clock, so the pause leaves out only the work inside it, not theirs."""
    jax.block_until_ready(state)
    with paused():
        yield


class ProfileWindow:
    """A jax.profiler trace of train steps a..b-1 (0-based; the steps that take the done
    count from a to b, with the logging, eval and checkpointing that follow them) into
    logdir: logdir/plugins/profile/<time>/<host>.xplane.pb, for xprof or TensorBoard's
    profile tab, and perfetto_trace.json.gz beside it, which `python -m
    tools.profile_summary logdir --steps=b-a` sums per op (device time per step).

    The trace starts at construction when a == first (else once `step_done(a, state)`
    is called) and stops at `step_done(b, state)`, after `state` is ready, so it holds
    whole steps. steps: (a, b) or None (no trace). first / end: the steps this run
    covers (a resumed run starts later); a window outside them is skipped with a log
    line. enabled: False on every process but the one that traces. paused: a context
    manager factory (e.g. Throughput.paused) around starting and stopping the trace,
    whose export takes seconds, so throughput figures leave it out; both wait for
    `state` first (idle_pause), so no step's device time falls inside the pause.
    """

    def __init__(self, steps: tuple[int, int] | None, logdir: str, first: int, end: int,
                 log: Callable[[str], None] = print, enabled: bool = True,
                 paused: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext):
        self.logdir, self.log, self.active, self.paused = logdir, log, False, paused
        self.steps = steps if enabled else None
        if self.steps is not None and not first <= steps[0] < steps[1] <= end:
            log(f"[gemjax] profile window {steps[0]}:{steps[1]} is not within this run's "
                f"steps {first}:{end}: no trace")
            self.steps = None
        if self.steps is not None and self.steps[0] == first:
            self._start()

    def _start(self) -> None:
        with self.paused():
            jax.profiler.start_trace(self.logdir, create_perfetto_trace=True)
        self.active = True

    def step_done(self, done: int, state) -> None:
        """Call after each step (done = steps completed so far, state = its output)."""
        if self.steps is None:
            return
        if done == self.steps[0] and not self.active:
            jax.block_until_ready(state)
            self._start()
        elif done == self.steps[1] and self.active:
            with idle_pause(self.paused, state):
                jax.profiler.stop_trace()
            self.active = False
            self.log(f"[gemjax] profile of steps {self.steps[0]}:{self.steps[1]} in {self.logdir}")
