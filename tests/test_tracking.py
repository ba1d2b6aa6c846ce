"""Experiment tracking: TensorBoard scalars equal metrics.jsonl (across a resume), summary.json's
run facts and timing, plot_metrics' PNG, --profile_steps' trace and its flag errors."""

import contextlib
import functools
import glob
import importlib.metadata
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import time

import jax
import jaxlib
import numpy as np
import pytest
from jax.sharding import Mesh

from experiments import plot_metrics
from tools import profile_summary
from gemjax.config import apply_overrides, get_config
from gemjax.train import tracking
from gemjax.train.loop import train
from gemjax.train.throughput import Throughput

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the same programs as test_train.py's TINY (compiled once in the persistent cache)
TINY = apply_overrides(get_config("tiny"), "train.steps=8,train.log_every=2,train.eval_every=4,"
                                           "train.checkpoint_every=2")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny run that "crashes" after writing step 6's rows but before its checkpoint
    (stop at 6, then delete checkpoint 6), and resumes from step 4 to 8 with a profile
    of steps 5..6. Returns (workdir, summary of the resumed run, rows before the crash,
    log lines of the first run, whose compile heartbeat beats every 0.02 s)."""
    wd = str(tmp_path_factory.mktemp("tracking") / "run")
    mesh = Mesh(np.array(jax.devices()[:1]), ("batch",))
    go = functools.partial(train, TINY, wd, mesh=mesh)
    first_log = []
    from gemjax.train import loop
    with pytest.MonkeyPatch.context() as mp:      # the first step traces for longer than this
        mp.setattr(loop, "COMPILE_HEARTBEAT_S", 0.02)
        go(stop_after=6, log=first_log.append)
    with open(os.path.join(wd, "metrics.jsonl")) as f:
        before = [json.loads(line) for line in f]
    shutil.rmtree(os.path.join(wd, "checkpoints", "6"))
    summary = go(profile_steps=(5, 7), log=lambda s: None)
    return wd, summary, before, first_log


def _rows(wd):
    with open(os.path.join(wd, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _masked_crc(data: bytes) -> int:
    from tensorboardX.crc32c import crc32c
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _events(path):
    """The Event records of one TFRecord file, their length and data CRCs checked."""
    from tensorboardX.proto.event_pb2 import Event
    with open(path, "rb") as f:
        data = f.read()
    pos, out = 0, []
    while pos < len(data):
        header = data[pos:pos + 8]
        (n,) = struct.unpack("<Q", header)
        assert struct.unpack("<I", data[pos + 8:pos + 12])[0] == _masked_crc(header), path
        record = data[pos + 12:pos + 12 + n]
        assert struct.unpack("<I", data[pos + 12 + n:pos + 16 + n])[0] == _masked_crc(record), path
        out.append(Event.FromString(record))
        pos += 16 + n
    return out


def _tensorboard_view(logdir):
    """{(tag, step): value} as TensorBoard shows it: files in name order, and a
    SessionLog START at step s drops the points seen so far at steps >= s."""
    from tensorboardX.proto.event_pb2 import SessionLog
    points = {}
    for path in sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*"))):
        for ev in _events(path):
            if ev.HasField("session_log") and ev.session_log.status == SessionLog.START:
                points = {k: v for k, v in points.items() if k[1] < ev.step}
            for v in ev.summary.value:
                points[(v.tag, ev.step)] = v.simple_value
    return points


def test_tensorboard_scalars_equal_metrics_rows_across_a_resume(run):
    wd, summary, before, _ = run
    rows = _rows(wd)
    assert [r["step"] for r in before if r["kind"] == "train"] == [2, 4, 6]
    assert [(r["step"], r["kind"]) for r in rows] == [(2, "train"), (4, "train"), (4, "eval"),
                                                      (6, "train"), (8, "train"), (8, "eval")]
    expected = {}
    for r in rows:
        for k, v in r.items():
            if k not in ("step", "kind") and type(v) in (int, float):
                expected[(f"{r['kind']}/{k}", r["step"])] = float(np.float32(v))
    assert ("eval/task1/auc", 8) in expected and ("train/ids_out_of_range", 2) in expected
    assert summary["tensorboard_dir"] == os.path.join(wd, "tensorboard")
    got = _tensorboard_view(summary["tensorboard_dir"])
    assert got.keys() == expected.keys()
    bad = [k for k in expected if not (got[k] == expected[k] or math.isnan(got[k]) and math.isnan(expected[k]))]
    assert not bad, [(k, got[k], expected[k]) for k in bad[:5]]
    # the crashed run's step-6 points are still in its file; the resumed file purges them
    files = sorted(glob.glob(os.path.join(summary["tensorboard_dir"], "events.out.tfevents.*")))
    assert len(files) == 2
    assert any(ev.step == 6 and ev.summary.value for ev in _events(files[0]))
    first = [ev for ev in _events(files[1]) if not ev.file_version][0]
    assert first.session_log.status == first.session_log.START and first.step == 5


def test_summary_records_timing_devices_versions_and_git(run):
    wd, summary, _, _ = run
    with open(os.path.join(wd, "summary.json")) as f:
        on_disk = json.load(f)
    assert on_disk == json.loads(json.dumps(summary))
    assert summary["wall_time_s"] > 0 and summary["compile_s"] > 0
    assert summary["first_interval_s"] > 0 and summary["first_interval_steps"] == 2
    assert summary["samples_per_sec"] > 0 and summary["samples_per_sec_incl_compile"] > 0
    assert summary["step_time_s"] * summary["samples_per_sec"] == pytest.approx(TINY.data.batch_size)
    assert summary["warmup_s"] == pytest.approx(summary["first_interval_s"] - 2 * summary["step_time_s"])
    dev = jax.devices()[0]
    assert summary["devices"] == {"count": 1, "kind": dev.device_kind, "platform": "cpu", "processes": 1}
    assert summary["mesh"] == {"batch": 1}
    try:
        gemjax_version = importlib.metadata.version("gemjax")
    except importlib.metadata.PackageNotFoundError:
        gemjax_version = None
    assert summary["versions"] == {"python": ".".join(map(str, sys.version_info[:3])),
                                   "jax": jax.__version__, "jaxlib": jaxlib.__version__,
                                   "gemjax": gemjax_version}
    head = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:
        assert summary["git_revision"] == head.stdout.strip()
        assert isinstance(summary["git_dirty"], bool)
    else:
        assert summary["git_revision"] is None and summary["git_dirty"] is None


def test_git_revision_outside_a_checkout_or_without_git(tmp_path, monkeypatch):
    assert tracking.git_revision(str(tmp_path)) == (None, None)
    monkeypatch.setenv("PATH", str(tmp_path))           # no git executable
    assert tracking.git_revision() == (None, None)


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_steady_rates_exclude_the_first_interval_and_pauses():
    clock = FakeClock()
    meter = Throughput(window=2, clock=clock)
    meter.update(0)                                      # opens the clock
    clock.t += 30                                        # the first interval: compile + 2 steps
    meter.update(samples=128, tokens=1280)
    assert math.isnan(meter.steady_samples_per_sec)      # one interval: no steady figure yet
    for _ in range(3):                                   # steady: 2 steps of 64 in 4 s
        clock.t += 4
        meter.update(samples=128, tokens=1280)
        with meter.paused():
            clock.t += 100                               # eval
    assert meter.first_interval == (30, 128)
    assert meter.steady_samples_per_sec == pytest.approx(3 * 128 / 12)
    assert meter.steady_tokens_per_sec == pytest.approx(3 * 1280 / 12)
    t = tracking.timing(meter, 64, wall_time_s=500.0, compile_s=25.0)
    assert t["step_time_s"] == pytest.approx(2.0) and t["first_interval_steps"] == 2
    assert t["warmup_s"] == pytest.approx(30 - 2 * 2.0)
    assert t["samples_per_sec_incl_compile"] == pytest.approx(4 * 128 / 42)
    short = Throughput(clock=clock)
    short.update(0)
    clock.t += 5
    short.update(64)
    t = tracking.timing(short, 64, wall_time_s=6.0, compile_s=4.0)
    assert t["samples_per_sec"] is None and t["step_time_s"] is None and t["warmup_s"] is None
    assert t["first_interval_s"] == 5 and t["samples_per_sec_incl_compile"] == pytest.approx(64 / 5)


def test_without_tensorboardx_the_run_log_says_so_and_writes_jsonl(tmp_path, monkeypatch):
    for mod in ("tensorboardX", "tensorboardX.event_file_writer", "tensorboardX.proto.event_pb2"):
        monkeypatch.setitem(sys.modules, mod, None)
    lines = []
    runlog = tracking.RunLog(str(tmp_path), log=lines.append)
    runlog.append({"step": 1, "kind": "train", "loss": 0.5})
    assert runlog.tensorboard_dir is None and not os.path.exists(tmp_path / "tensorboard")
    assert len(lines) == 1 and "TensorBoard logging off: tensorboardX does not import" in lines[0]
    assert _rows(str(tmp_path)) == [{"step": 1, "kind": "train", "loss": 0.5}]
    off = tmp_path / "other"
    off.mkdir()
    tracking.RunLog(str(off), enabled=False).append({"step": 1, "kind": "train"})
    assert os.listdir(off) == []


def test_a_resume_after_a_run_without_tensorboard_backfills_its_rows(tmp_path):
    rows = [{"step": 2, "kind": "train", "loss": 0.7, "ids_overflow": 3, "auc": None},
            {"step": 2, "kind": "eval", "ne": 0.9, "task0/auc": 0.6}]
    off = tracking.RunLog(str(tmp_path), tensorboard=False)
    for r in rows:
        off.append(r)
    assert not os.path.exists(tmp_path / "tensorboard")
    on = tracking.RunLog(str(tmp_path), start_step=2)
    on.append({"step": 4, "kind": "train", "loss": 0.6})
    on.close()
    assert _tensorboard_view(on.tensorboard_dir) == {
        ("train/loss", 2): np.float32(0.7), ("train/ids_overflow", 2): 3.0, ("eval/ne", 2): np.float32(0.9),
        ("eval/task0/auc", 2): np.float32(0.6), ("train/loss", 4): np.float32(0.6)}


def test_profile_steps_write_an_xplane_and_a_perfetto_trace(run):
    wd, _, _, _ = run
    traces = glob.glob(os.path.join(wd, "profile", "plugins", "profile", "*", "*.xplane.pb"))
    assert len(traces) == 1 and os.path.getsize(traces[0]) > 0
    # the file tools/profile_summary.py reads (host-only on CPU: it says so)
    assert profile_summary.find_trace(os.path.join(wd, "profile")).endswith("perfetto_trace.json.gz")


@pytest.mark.parametrize("value,message", [
    ("5", "--profile_steps='5': expected A:B, integers with 0 <= A < B"),
    ("7:3", "--profile_steps='7:3': expected A:B"),
    ("2:30", "--profile_steps='2:30': the run has 20 steps"),
])
def test_profile_steps_flag_errors(value, message, tmp_path):
    r = subprocess.run([sys.executable, "-m", "experiments.train", "--config=tiny",
                        f"--workdir={tmp_path}", f"--profile_steps={value}"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode != 0 and message in r.stderr + r.stdout, r.stderr[-2000:]
    assert not os.listdir(tmp_path)                       # refused before anything ran


def test_plot_metrics_reads_rows_and_draws_a_png(run, tmp_path):
    wd, _, _, _ = run
    P = plot_metrics
    curves = P.read_curves(wd)
    rows = _rows(wd)
    for name, (kind, key) in P.CURVES.items():
        steps, values = curves[name]
        want = [(r["step"], r[key]) for r in rows if r["kind"] == kind]
        assert steps.tolist() == [s for s, _ in want] and values.tolist() == [v for _, v in want], name
    out = tmp_path / "curves.png"
    r = subprocess.run([sys.executable, "-m", "experiments.plot_metrics",
                        f"--workdirs={wd},{wd}", "--labels=a,b", f"--out={out}", "--size=640x480"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    png = out.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR"
    assert struct.unpack(">II", png[16:24]) == (640, 480)


def test_plot_metrics_names_bad_input(tmp_path):
    P = plot_metrics
    with pytest.raises(ValueError, match=r"metrics.jsonl: no such file"):
        P.read_curves(str(tmp_path))
    (tmp_path / "metrics.jsonl").write_text('{"step": 2, "kind": "train", "loss": 0.5}\n\n'
                                            '{"step": 4, "kind": "train", "loss": 0.4\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:3: not a metrics row"):
        P.read_curves(str(tmp_path))
    with pytest.raises(ValueError, match="WIDTHxHEIGHT"):
        P.parse_size("640")


def test_pauses_begin_once_the_dispatched_steps_are_done(monkeypatch, tmp_path):
    # asynchronous dispatch runs steps ahead; a pause entered before they finish would
    # hide their device time from the step-time figures
    events = []

    class State:            # a step's output still running on the device
        def block_until_ready(self):
            events.append("ready")
            return self

    @contextlib.contextmanager
    def paused():
        events.append("pause")
        yield
        events.append("resume")

    monkeypatch.setattr(jax.profiler, "start_trace", lambda *a, **k: events.append("start"))
    monkeypatch.setattr(jax.profiler, "stop_trace", lambda: events.append("stop"))
    window = tracking.ProfileWindow((2, 4), str(tmp_path), 0, 5, log=lambda s: None, paused=paused)
    for done in range(1, 6):
        window.step_done(done, State())
    assert events == ["ready", "pause", "start", "resume", "ready", "pause", "stop", "resume"]
    events.clear()
    with tracking.idle_pause(paused, State()):
        events.append("save")
    assert events == ["ready", "pause", "save", "resume"]


def test_heartbeat_logs_while_its_block_runs_and_stops_after():
    lines = []
    t0 = time.perf_counter()
    with tracking.Heartbeat("the thing", 0.05, lines.append):
        time.sleep(0.32)
    n = len(lines)
    assert 1 <= n <= (time.perf_counter() - t0) / 0.05 + 1, lines
    assert all(line.startswith("[gemjax] the thing: ") and line.endswith(" s so far") for line in lines)
    time.sleep(0.15)
    assert len(lines) == n                        # the thread ended with the block
    quick, off = [], []
    with tracking.Heartbeat("quick", 5.0, quick.append):
        pass
    with tracking.Heartbeat("off", 0, off.append):
        time.sleep(0.1)
    assert quick == [] and off == []


def test_the_first_step_of_a_run_has_a_heartbeat(run):
    lines = run[3]                 # the fixture's first run, from an empty workdir
    beats = [line for line in lines if line.startswith("[gemjax] the first step (compiling): ")]
    assert beats, lines


def test_a_resumed_run_log_purges_the_later_points_and_keeps_tags_as_written(tmp_path):
    first = tracking.RunLog(str(tmp_path))
    for step in (2, 4, 6):
        first.append({"step": step, "kind": "eval", "hr@10": step / 10, "ok": True})
    first.close()
    resumed = tracking.RunLog(str(tmp_path), start_step=4)   # step 6 was never checkpointed
    resumed.append({"step": 6, "kind": "eval", "hr@10": 0.25})
    resumed.close()
    files = sorted(glob.glob(os.path.join(tmp_path, "tensorboard", "events.out.tfevents.*")))
    assert len(files) == 2
    purge = [ev for ev in _events(files[1]) if not ev.file_version][0]
    assert purge.session_log.status == purge.session_log.START and purge.step == 5
    assert _tensorboard_view(resumed.tensorboard_dir) == {
        ("eval/hr@10", 2): np.float32(0.2), ("eval/hr@10", 4): np.float32(0.4),
        ("eval/hr@10", 6): np.float32(0.25)}
    fresh = tracking.RunLog(str(tmp_path))                   # a fresh run starts over
    fresh.close()
    assert _tensorboard_view(fresh.tensorboard_dir) == {}


def test_a_run_log_dropped_unclosed_writes_its_rows(tmp_path):
    import gc
    runlog = tracking.RunLog(str(tmp_path))
    runlog.append({"step": 2, "kind": "train", "loss": 0.5})
    logdir = runlog.tensorboard_dir
    del runlog
    gc.collect()
    assert _tensorboard_view(logdir) == {("train/loss", 2): 0.5}
