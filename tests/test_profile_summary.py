"""tools/profile_summary.py: device events summed per step by name and kind from a
perfetto trace; host events ignored; files found under a directory."""

import gzip
import json

import pytest
from tools import profile_summary as P



def _trace():
    meta = lambda pid, name: {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}}
    x = lambda pid, name, dur: {"ph": "X", "pid": pid, "tid": 1, "name": name, "ts": 0, "dur": dur}
    return [meta(1, "/host:CPU"), meta(2, "/device:GPU:0 (pid 2)"), meta(3, "/device:GPU:1 (pid 3)"),
            x(1, "PjitFunction(step)", 9000.0),                 # host: ignored
            x(2, "all-to-all.3", 1500.0), x(2, "all-to-all.3", 500.0),
            x(2, "jagged_flash_fwd_gdpa", 3000.0), x(2, "sort.12", 400.0),
            x(2, "loop_multiply_fusion", 100.0), x(3, "all-reduce-start.1", 200.0)]


def test_summarize_by_kind_and_name_per_step():
    s = P.summarize(_trace(), steps=2)
    assert set(s) == {"/device:GPU:0 (pid 2)", "/device:GPU:1 (pid 3)"}
    g0 = s["/device:GPU:0 (pid 2)"]
    assert g0["total_ms"] == pytest.approx((1500 + 500 + 3000 + 400 + 100) / 1e3 / 2)
    assert g0["by_kind"] == pytest.approx({"all-to-all": 1.0, "pallas/triton": 1.5, "sort": 0.2,
                                           "other fusion/kernel": 0.05})
    assert g0["by_name"]["all-to-all.3"] == pytest.approx(1.0)
    assert s["/device:GPU:1 (pid 3)"]["by_kind"] == pytest.approx({"all-reduce": 0.1})
    text = P.format_summary(s, top=2)
    assert "all-to-all" in text and "jagged_flash_fwd_gdpa" in text and "loop_multiply" not in text
    with pytest.raises(ValueError, match="steps"):
        P.summarize(_trace(), steps=0)


def test_trace_found_under_a_directory_and_host_only_said(tmp_path):
    d = tmp_path / "plugins" / "profile" / "run1"
    d.mkdir(parents=True)
    with gzip.open(d / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": _trace()[:4]}, f)
    events = P.load_events(str(tmp_path))
    assert len(events) == 4
    assert P.format_summary(P.summarize(events)).startswith("no device events")
    with pytest.raises(FileNotFoundError, match="perfetto_trace"):
        P.load_events(str(tmp_path / "nothing"))


def test_idle_time_and_gaps_per_device():
    """Busy = the union of the events (overlapping streams count once), idle = the rest of
    the span, the largest gap named by the ops around it."""
    evs = [(0.0, 1000.0, "a"), (500.0, 1000.0, "b"),      # overlap: busy 0-1500
           (4500.0, 500.0, "c"),                          # gap 3000 us after b
           (5100.0, 100.0, "d"), (5150.0, 10.0, "e")]     # gap 100 us after c; e inside d
    r = P.idle(evs, steps=2)
    assert r["span_ms"] == pytest.approx(5.2 / 2)
    assert r["busy_ms"] == pytest.approx((1.5 + 0.5 + 0.1) / 2)
    assert r["idle_ms"] == pytest.approx((3.0 + 0.1) / 2)
    assert r["gaps"][0] == pytest.approx((3.0, "b", "c")) or r["gaps"][0][1:] == ("b", "c")
    assert [g[1:] for g in r["gaps"]] == [("b", "c"), ("c", "d")]
    s = P.summarize(_trace(), steps=1)["/device:GPU:0 (pid 2)"]
    assert s["idle_ms"] == 0.0 and s["busy_ms"] == pytest.approx(3.0)   # all events start at 0
    assert "idle 0.00" in P.format_summary(P.summarize(_trace()))
