"""Where a call's time goes beyond its kernels: N back-to-back calls of an attention op
traced with jax.profiler, the device's busy time and gaps per call, and the host events
running while the device idles. One GPU.

    python3 -m tools.call_gaps --variants=gdpa_mosaic,block_triton \
        --out=$OUT/call_gaps

Each variant is timed as bench_attention times it (`time_stream`: per call in a steady
stream, and per call of one round with its fixed cost) and then traced over --calls calls
issued back to back. Per variant and pass it prints both times, the device busy time per
call (the union of kernel events), the traced span and idle time per call, the kernels
per call and the largest gaps, and writes the trace's events around the middle
call (host and device, times relative to that call's first kernel) as JSON, so a gap
can be matched with the host work that filled it (e.g. the host waiting for the
device, or a launch that came late).

A variant is kernel_times.py's: op_engine[knobs], plus `xla_stream` (XLA moving the
bytes of the workload: the per-call gap of a plain fusion) and `tiny` (a one-element
add: the dispatch cost per call when the device has nothing to do).
"""

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from benchmarks.attention_workloads import (fwd_and_train, op_fn, pack_arrays,
                                            parse_variant, stream_same_bytes, stream_same_bytes_train,
                                            time_stream, workload)
from tools.profile_summary import idle, load_events

FLAGS = flags.FLAGS


def define_flags():
    """The script's flags (defined when run, so tests can import its functions beside
    other experiment scripts that define flags of the same names)."""
    flags.DEFINE_string("workload", "W1", "workload of attention_workloads.py")
    flags.DEFINE_list("variants", ["gdpa_mosaic", "softmax_mosaic", "xla_stream", "tiny"],
                      "op_engine[knobs] entries (kernel_times.py), xla_stream or tiny")
    flags.DEFINE_integer("calls", 12, "calls per traced round")
    flags.DEFINE_integer("iters", 20, "calls per short timed round (time_stream)")
    flags.DEFINE_string("out", "call_gaps", "directory for the traces and the JSON summary")


def trace_events(fn, args, calls, logdir):
    """Events of `calls` back-to-back calls of fn (one sync at the end)."""
    jax.block_until_ready(fn(*args))
    with jax.profiler.trace(logdir, create_perfetto_trace=True):
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
    return load_events(logdir)


def split_events(events):
    """(device kernel events, host events) as dicts with ts, dur (us), name, thread."""
    procs = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e.get("args", {}).get("name", "") for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    dev, host = [], []
    for e in events:
        if e.get("ph") != "X":
            continue
        rec = dict(ts=float(e["ts"]), dur=float(e.get("dur", 0.0)), name=e.get("name", ""),
                   thread=threads.get((e["pid"], e.get("tid")), str(e.get("tid"))))
        (dev if procs.get(e["pid"], "").startswith("/device:") else host).append(rec)
    return sorted(dev, key=lambda r: r["ts"]), sorted(host, key=lambda r: r["ts"])


def variant_fns(spec, qo, ko, scale):
    """(forward fn, forward+backward fn) of a variant, jitted; fn(q, k, v[, do])."""
    if spec == "tiny":
        return jax.jit(lambda q, k, v: q[0, 0, :1] + 1), jax.jit(lambda q, k, v, do: q[0, 0, :1] + 1)
    if spec == "xla_stream":
        return jax.jit(stream_same_bytes), jax.jit(stream_same_bytes_train)
    return fwd_and_train(op_fn(*parse_variant(spec), qo, ko, scale))


def main(_):
    if jax.default_backend() != "gpu":
        sys.exit("call_gaps: no GPU (jax.default_backend() is "
                 f"{jax.default_backend()!r}); the trace's device events need one.")
    os.makedirs(FLAGS.out, exist_ok=True)
    _, ql, kl = workload(FLAGS.workload)
    q, k, v, do, qo, ko = pack_arrays(ql, kl, 4, 128, jnp.bfloat16, np.random.default_rng(0))
    scale = 1.0 / int(kl.max())
    summary, lines = [], []
    for spec in FLAGS.variants:
        fwd, train = variant_fns(spec, qo, ko, scale)
        for tag, fn, args in (("fwd", fwd, (q, k, v)), ("fwd_bwd", train, (q, k, v, do))):
            per_call, per_round = (x * 1e6 for x in time_stream(fn, *args, iters=FLAGS.iters))
            logdir = os.path.join(FLAGS.out, f"{spec}_{tag}".replace("[", "_").replace("]", ""))
            dev, host = split_events(trace_events(fn, args, FLAGS.calls, logdir))
            if not dev:
                sys.exit(f"call_gaps: the trace of {spec} {tag} holds no device events")
            per = FLAGS.calls      # profile_summary.idle: ms per call, 3 largest gaps (ms)
            st = idle([(e["ts"], e["dur"], e["name"]) for e in dev], per, keep=3)
            us = {key: st[key + "_ms"] * 1e3 for key in ("busy", "span", "idle")}
            kernels = len(dev) / per
            mid = dev[len(dev) // 2]["ts"]
            window = [dict(r, ts=r["ts"] - mid, kind=kind) for kind, rs in (("device", dev),
                                                                            ("host", host))
                      for r in rs if -400 <= r["ts"] - mid <= 400]
            rec = dict(variant=spec, pass_=tag, per_call_us=per_call, round_us=per_round,
                       busy_us=us["busy"], span_us=us["span"], idle_us=us["idle"],
                       kernels_per_call=kernels,
                       gaps=[dict(us=ms * 1e3, before=b[:80], after=a[:80])
                             for ms, b, a in st["gaps"]],
                       host_names=sorted({h["name"][:80] for h in host})[:80],
                       window=sorted(window, key=lambda r: r["ts"]))
            summary.append(rec)
            lines.append(f"{spec:<28}{tag:<8}{per_call:>9.1f}{per_round:>9.1f}{us['busy']:>9.1f}"
                         f"{us['span']:>9.1f}{us['idle']:>9.1f}{kernels:>6.1f}  "
                         + ", ".join(f"{ms * 1e3:.1f}" for ms, *_ in st["gaps"]))
            with open(os.path.join(FLAGS.out, "call_gaps.json"), "w") as f:
                json.dump(summary, f, indent=1)
    print(f"\n{FLAGS.workload}: us per call (traced over {FLAGS.calls} calls)")
    print(f"{'variant':<28}{'pass':<8}{'steady':>9}{'round':>9}{'busy':>9}{'span':>9}{'idle':>9}"
          f"{'kern':>6}  largest gaps")
    print("\n".join(lines))


if __name__ == "__main__":
    define_flags()
    app.run(main)
