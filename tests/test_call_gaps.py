"""experiments/call_gaps.py's trace arithmetic on synthetic perfetto events (its timing
needs a GPU): device busy time as a union of intervals, the gaps between them, and the
split of events into device kernels and host work."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "experiments"))

import call_gaps  # noqa: E402


def _ev(ts, dur, name):
    return dict(ts=ts, dur=dur, name=name)


def test_busy_is_the_union_and_gaps_lie_between():
    # a [0, 5) and b [3, 7) overlap: 7 us, not 9; c [10, 11) adds 1 after a 3 us gap
    busy, gaps = call_gaps.busy_and_gaps([_ev(0, 5, "a"), _ev(3, 4, "b"), _ev(10, 1, "c")])
    assert busy == pytest.approx(8.0)
    assert gaps == [(3.0, 7.0, "b", "c")]
    # a kernel inside another adds nothing; touching intervals leave no gap
    busy, gaps = call_gaps.busy_and_gaps([_ev(0, 10, "a"), _ev(2, 3, "b"), _ev(10, 2, "c")])
    assert busy == pytest.approx(12.0) and gaps == []
    assert call_gaps.busy_and_gaps([]) == (0.0, [])


def test_split_events_by_process():
    events = [
        dict(ph="M", name="process_name", pid=1, args=dict(name="/device:GPU:0")),
        dict(ph="M", name="process_name", pid=2, args=dict(name="/host:CPU")),
        dict(ph="M", name="thread_name", pid=1, tid=7, args=dict(name="Stream #14(Compute)")),
        dict(ph="M", name="thread_name", pid=2, tid=3, args=dict(name="python")),
        dict(ph="X", pid=1, tid=7, ts=20.0, dur=5.0, name="kernel_b"),
        dict(ph="X", pid=1, tid=7, ts=10.0, dur=5.0, name="kernel_a"),
        dict(ph="X", pid=2, tid=3, ts=0.0, dur=30.0, name="PjitFunction(f)"),
        dict(ph="i", pid=2, tid=3, ts=1.0, name="instant: not a span"),
    ]
    dev, host = call_gaps.split_events(events)
    assert [e["name"] for e in dev] == ["kernel_a", "kernel_b"]        # sorted by start
    assert dev[0]["thread"] == "Stream #14(Compute)"
    assert [(e["name"], e["thread"]) for e in host] == [("PjitFunction(f)", "python")]
