"""Where device time goes: a perfetto trace from jax.profiler, summed by op and by kind.

    python -m tools.profile_summary runs/sweep/profile/replica=2 --steps=3 --top=25

jax.profiler.trace(dir, create_perfetto_trace=True) writes
dir/plugins/profile/<run>/perfetto_trace.json.gz. On a GPU its device processes
("/device:GPU:<i>...") hold one complete ("X") event per kernel or collective.
This sums their durations per device, per op name and per kind (collective
kinds, Pallas / Triton kernels, sort, scatter, gather, copies, other fusions),
divided by --steps to give milliseconds per step. Host-only traces (CPU) have
no device process: the summary says so.

sweep_mesh.py --profile_steps=N traces N timed steps of every mesh and prints
this summary, so a 1-device and an N-device step can be compared op by op.

Idle device time: per device, the span from its first event to its last, the
part of it covered by some event (busy) and the rest (idle), per step, with the
largest gaps and the ops around them. A device that idles while the step is
not communicating waits for the host: e.g. a lax.switch around collectives,
which XLA:GPU runs as a host conditional (a MemcpyD2H of the branch index, then
the host waits for the device), stops the host from queuing the next step; on
2 H200s that showed as a 20-30 ms gap at every step boundary.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import sys

# (kind, pattern on the lower-cased event name), first match wins
KINDS = [
    ("all-to-all", r"all-to-all|all_to_all|alltoall|ragged-all-to-all"),
    ("all-reduce", r"all-reduce|all_reduce|allreduce"),
    ("all-gather", r"all-gather|all_gather|allgather"),
    ("reduce-scatter", r"reduce-scatter|reduce_scatter|reducescatter"),
    ("collective-permute", r"collective-permute|collective_permute|sendrecv|send|recv"),
    ("nccl other", r"nccl"),
    ("pallas/triton", r"triton|pallas|jagged_flash|block_attention|gdpa"),
    ("sort", r"sort"),
    ("scatter", r"scatter"),
    ("gather", r"gather"),
    ("copy/memset", r"copy|memcpy|memset|dynamic-update-slice|transpose"),
    ("gemm", r"gemm|cublas|cutlass|dot|matmul|sm90_xmma|nvjet"),
]


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, pat in KINDS:
        if re.search(pat, low):
            return kind
    return "other fusion/kernel"


def find_trace(path: str) -> str:
    """path: a perfetto_trace.json.gz, or a directory holding one (newest wins)."""
    if os.path.isfile(path):
        return path
    found = sorted(glob.glob(os.path.join(path, "**", "perfetto_trace.json.gz"), recursive=True),
                   key=os.path.getmtime)
    if not found:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {path!r} (trace with "
                                f"jax.profiler.trace(dir, create_perfetto_trace=True))")
    return found[-1]


def load_events(path: str) -> list[dict]:
    with gzip.open(find_trace(path), "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def summarize(events: list[dict], steps: int = 1) -> dict:
    """{device process name: {"total_ms", "by_kind": {kind: ms}, "by_name": {name: ms}}},
    milliseconds per step (event durations are microseconds)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    names = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    devices = {pid: n for pid, n in names.items() if n.startswith("/device:")}
    out: dict[str, dict] = {}
    spans: dict[str, list] = collections.defaultdict(list)
    for e in events:
        if e.get("ph") != "X" or e.get("pid") not in devices:
            continue
        d = out.setdefault(devices[e["pid"]], {"total_ms": 0.0, "by_kind": collections.Counter(),
                                               "by_name": collections.Counter()})
        ms = float(e.get("dur", 0.0)) / 1e3 / steps
        d["total_ms"] += ms
        d["by_kind"][kind_of(e.get("name", ""))] += ms
        d["by_name"][e.get("name", "")] += ms
        spans[devices[e["pid"]]].append((float(e.get("ts", 0.0)), float(e.get("dur", 0.0)),
                                         e.get("name", "")))
    for dev, evs in spans.items():
        out[dev].update(idle(evs, steps))
    return out


def idle(evs: list[tuple[float, float, str]], steps: int = 1, keep: int = 5) -> dict:
    """(start us, duration us, name) of one device -> {"span_ms", "busy_ms", "idle_ms"
    (per step), "gaps": the `keep` largest [(ms, name before, name after)]}."""
    evs = sorted(evs)
    start, end, last = evs[0][0], evs[0][0] + evs[0][1], evs[0][2]
    busy, run_start, gaps = 0.0, start, []
    for ts, dur, name in evs[1:]:
        if ts > end:                     # nothing ran between end and ts
            gaps.append(((ts - end) / 1e3, last, name))
            busy += end - run_start
            run_start = ts
        if ts + dur > end:
            end, last = ts + dur, name
    busy += end - run_start
    span = end - start
    return {"span_ms": span / 1e3 / steps, "busy_ms": busy / 1e3 / steps,
            "idle_ms": (span - busy) / 1e3 / steps, "gaps": sorted(gaps, reverse=True)[:keep]}


def format_summary(summary: dict, top: int = 15) -> str:
    if not summary:
        return "no device events in the trace (host-only backend?)"
    lines = []
    for dev in sorted(summary):
        d = summary[dev]
        lines.append(f"{dev}: {d['total_ms']:.2f} ms of device events per step (streams overlap: "
                     f"a sum, not wall time)")
        if "span_ms" in d:
            lines.append(f"  span {d['span_ms']:.2f} ms per step: busy {d['busy_ms']:.2f}, "
                         f"idle {d['idle_ms']:.2f}" + (", largest gaps:" if d["gaps"] else ""))
            for ms, before, after in d["gaps"][:3]:
                lines.append(f"    {ms:>9.3f} ms  after {before[:45]}  before {after[:45]}")
        for kind, ms in sorted(d["by_kind"].items(), key=lambda kv: -kv[1]):
            lines.append(f"  {kind:<22}{ms:>10.3f} ms")
        lines.append(f"  top {top} ops:")
        for name, ms in d["by_name"].most_common(top):
            lines.append(f"    {ms:>9.3f} ms  {name[:100]}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path", help="trace file or a directory holding one")
    ap.add_argument("--steps", type=int, default=1, help="steps the trace holds (per-step figures)")
    ap.add_argument("--top", type=int, default=15, help="ops listed per device")
    args = ap.parse_args(argv)
    print(format_summary(summarize(load_events(args.path), args.steps), args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
