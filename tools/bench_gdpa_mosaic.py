"""GDPA (or softmax) forward on W1: the Mosaic GPU kernel (kernels/mosaic/forward.py) vs our
Triton one.

W1 (benchmarks/attention_workloads.py): bf16, 4 heads, head dim 128, 64 samples of
log-normal lengths (median 512), packed jagged tokens, self-attention, silu,
scale 1 / max length (as bench_attention.py). One GPU.

    python3 -m tools.bench_gdpa_mosaic --out /tmp/bench_gdpa_mosaic.json
    python3 -m tools.bench_gdpa_mosaic --sweep --sweep_deadline_s=90
    python3 -m tools.bench_gdpa_mosaic --mode=softmax --sweep

Rows: Triton forward (kernels.gdpa.gdpa(impl="pallas"), or jagged_attention's with
--mode=softmax; layout included), Mosaic forward (gdpa_mosaic_forward or
softmax_mosaic_forward, layout included), Mosaic kernel alone (layout
precomputed), and with --sweep one row per tuning config. Each row: ms per call
(FLAGS.iters calls back to back, one sync, median of 3 rounds), useful TFLOP/s
(4 H D valid_pairs / time), the relative difference to the Triton output (a fast
but wrong config shows here), and the kernel's CUPTI device time where available.
A config that fails to compile (e.g. over the shared-memory budget) is recorded
with its error and skipped. Exits with a message, no traceback, without a GPU.
"""

import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from benchmarks.attention_workloads import (pack_arrays, parse_mosaic_knobs, time_calls,
                                            valid_pairs, workload)

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "bench_gdpa_mosaic.json", "JSON output path")
flags.DEFINE_string("workload", "W1", "workload of attention_workloads.py (self / cross)")
flags.DEFINE_integer("iters", 20, "calls per short timing round (attention_workloads.time_calls); "
                     "0: each row's first call timed, its compile included (--interpret smoke "
                     "tests, where times mean nothing)")
flags.DEFINE_integer("heads", 4, "heads")
flags.DEFINE_integer("head_dim", 128, "head dim")
flags.DEFINE_string("activation", "silu", "GDPA activation")
flags.DEFINE_enum("mode", "gdpa", ["gdpa", "softmax"], "the kernel's mode: GDPA (--activation, "
                  "scale 1 / max length) or online softmax (scale 1 / sqrt(D))")
flags.DEFINE_integer("max_samples", 0, "keep only the first N samples; 0 = all")
flags.DEFINE_integer("max_len", 0, "clip every sample's query and key lengths to N (interpret "
                     "smoke tests: the interpreter's time grows with the tiles); 0 = as drawn")
flags.DEFINE_bool("sweep", False, "also time the tuning configs of --configs")
flags.DEFINE_list("configs", None, "sweep configs, each knob=value joined by '+', e.g. "
                  "block_kv=64+num_stages=4 (default: SWEEP below)")
flags.DEFINE_float("sweep_deadline_s", 120.0, "start no sweep config after this many seconds")
flags.DEFINE_bool("cupti", True, "also report CUPTI device time (mosaic.gpu.profiler)")
flags.DEFINE_float("target_tflops", 450.0, "issue target for the W1 GDPA forward (gdpa mode)")
flags.DEFINE_bool("interpret", False, "CPU smoke test of this script: Mosaic in its interpreter, "
                  "Triton in interpret mode (use tiny --max_samples / --heads; times meaningless)")

# Ordered by promise: the default, deeper / shallower rings, then A/B switches of one
# feature each (ping-pong off, mask on every tile, in-order launch).
SWEEP = [
    "block_kv=128+num_stages=2",
    "block_kv=128+num_stages=3",
    "block_kv=64+num_stages=4",
    "block_kv=64+num_stages=2",
    "schedule_barrier=0",
    "interior=0",
    "heavy_first=0",
    "consumer_registers=240+producer_registers=24",
]
# Not in the default sweep (a capacity that is not a multiple of the tile costs a padding
# copy inside the timed call): block_kv=192.
_START = time.perf_counter()


def timeit(fn, *args):
    """Seconds per call in a steady stream (attention_workloads.time_calls, --iters)."""
    return time_calls(fn, *args, iters=FLAGS.iters)


def cupti_ms(fn, *args):
    """Device time of one call (sum of its kernels) through CUPTI, or None."""
    if not FLAGS.cupti or FLAGS.interpret:
        return None
    try:
        from jax.experimental.mosaic.gpu import profiler
        _, t = profiler.measure(fn, iterations=5)(*args)
        return float(np.median(t)) if t else None
    except Exception as e:  # noqa: BLE001 -- optional column
        print(f"[bench] CUPTI timing unavailable: {type(e).__name__}: {str(e)[:120]}")
        FLAGS.cupti = False
        return None


def rel_diff(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def row(name, fn, args, flops, want, knobs=None):
    r = dict(impl=name)
    if knobs is not None:
        r["knobs"] = knobs
    t0 = time.perf_counter()
    try:
        out = jax.block_until_ready(fn(*args))
    except Exception as e:  # noqa: BLE001 -- compile errors of a config are results
        r["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(f"{name:<44} error: {r['error'][:150]}")
        return r
    t = time.perf_counter() - t0 if FLAGS.iters == 0 else timeit(fn, *args)
    r.update(ms=t * 1e3, tflops=flops / t / 1e12)
    if want is not None:
        r["rel_diff_vs_triton"] = rel_diff(out, want)
    dev = cupti_ms(fn, *args)
    if dev is not None:
        r.update(device_ms=dev, device_tflops=flops / dev / 1e9)
    print(f"{name:<44} {r['ms']:8.3f} ms {r['tflops']:7.1f} TF/s"
          + (f"   device {dev:7.3f} ms {r['device_tflops']:6.1f} TF/s" if dev else "")
          + (f"   rel diff {r['rel_diff_vs_triton']:.1e}" if want is not None else ""))
    return r


def main(_):
    if jax.default_backend() != "gpu" and not FLAGS.interpret:
        sys.exit("bench_gdpa_mosaic: no GPU (jax.default_backend() is "
                 f"{jax.default_backend()!r}); the Mosaic GPU kernel runs on an H100/H200 only.")
    from kernels.gdpa import gdpa
    from kernels.jagged_attention import jagged_attention
    from kernels.mosaic import (build_layout, gdpa_mosaic_forward, mosaic_config, run_kernel,
                                softmax_mosaic_forward)

    kind, ql, kl = workload(FLAGS.workload)
    if FLAGS.max_samples:
        ql, kl = ql[:FLAGS.max_samples], kl[:FLAGS.max_samples]
    if FLAGS.max_len:
        ql, kl = np.minimum(ql, FLAGS.max_len), np.minimum(kl, FLAGS.max_len)
    h, d, act = FLAGS.heads, FLAGS.head_dim, FLAGS.activation
    q, k, v, _, qo, ko = pack_arrays(ql, kl, h, d, jnp.bfloat16, np.random.default_rng(0))
    pairs = valid_pairs(kind, ql, kl)
    flops = 4.0 * h * d * pairs
    softmax = FLAGS.mode == "softmax"
    scale = d ** -0.5 if softmax else 1.0 / int(kl.max())
    tag = FLAGS.mode
    dev = jax.devices()[0]
    meta = dict(workload=FLAGS.workload, kind=kind, samples=len(ql), q_tokens=int(ql.sum()),
                kv_tokens=int(kl.sum()), capacity_q=q.shape[0], capacity_kv=k.shape[0],
                heads=h, head_dim=d, mode=FLAGS.mode, activation=None if softmax else act,
                scale=scale, valid_pairs=pairs,
                fwd_gflop=flops / 1e9, device=getattr(dev, "device_kind", str(dev)),
                jax=jax.__version__, target_tflops=FLAGS.target_tflops)
    print(f"{FLAGS.workload}: {len(ql)} samples, {meta['q_tokens']} tokens, H={h} D={d}, "
          f"{pairs / 1e6:.1f} M valid pairs, {flops / 1e9:.1f} GFLOP fwd, on {meta['device']}")
    rows = []

    def save():  # after every row: a run cut short keeps what it measured
        with open(FLAGS.out, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)

    if softmax:
        triton = jax.jit(lambda q, k, v, qo, ko: jagged_attention(q, k, v, qo, ko, sm_scale=scale,
                                                                  impl="pallas"))
    else:
        triton = jax.jit(lambda q, k, v, qo, ko: gdpa(q, k, v, qo, ko, activation=act,
                                                      scale=scale, impl="pallas"))
    want = jax.block_until_ready(triton(q, k, v, qo, ko))
    args = (q, k, v, qo, ko)
    rows.append(row(f"triton_{tag}_fwd", triton, args, flops, None))
    save()

    def mosaic(knobs):
        if softmax:
            return jax.jit(lambda q, k, v, qo, ko: softmax_mosaic_forward(
                q, k, v, qo, ko, sm_scale=scale, interpret=FLAGS.interpret, **knobs)[0])
        return jax.jit(lambda q, k, v, qo, ko: gdpa_mosaic_forward(
            q, k, v, qo, ko, activation=act, scale=scale, interpret=FLAGS.interpret, **knobs))
    rows.append(row(f"mosaic_{tag}_fwd", mosaic({}), args, flops, want, {}))
    save()

    cfg = mosaic_config(d, q.dtype, mode=FLAGS.mode, activation=act, scale=scale)
    layout = jax.block_until_ready(jax.jit(
        lambda qo, ko: build_layout(cfg, qo, ko, q.shape[0], tk=k.shape[0]))(qo, ko))
    out_of = (lambda r: r[0]) if softmax else (lambda r: r)   # softmax: (out, lse)
    kern = jax.jit(lambda q, k, v, layout: out_of(run_kernel(cfg, layout, q, k, v,
                                                             FLAGS.interpret)))
    rows.append(row(f"mosaic_{tag}_fwd_kernel_only", kern, (q, k, v, layout), flops, want, {}))
    save()

    if FLAGS.sweep:
        for spec in FLAGS.configs or SWEEP:
            if time.perf_counter() - _START > FLAGS.sweep_deadline_s:
                print(f"[bench] sweep deadline ({FLAGS.sweep_deadline_s:.0f} s): skipping {spec}")
                rows.append(dict(impl=f"mosaic[{spec}]", skipped="deadline"))
                continue
            try:
                knobs = parse_mosaic_knobs(spec)
            except ValueError as e:
                print(f"[bench] bad config {spec!r} (knob=int joined by '+'): {e}")
                rows.append(dict(impl=f"mosaic[{spec}]", error=f"bad spec: {e}"))
                continue
            rows.append(row(f"mosaic[{spec}]", mosaic(knobs), args, flops, want, knobs))
            save()

    timed = [r for r in rows if r["impl"].startswith("mosaic") and "ms" in r
             and r.get("rel_diff_vs_triton", 1.0) < 2e-2]
    base = rows[0].get("ms")
    if timed and base:
        best = min(timed, key=lambda r: r["ms"])
        meta["best_mosaic"] = best["impl"]
        meta["best_mosaic_tflops"] = best["tflops"]
        meta["speedup_vs_triton"] = base / best["ms"]
        met = "met" if best["tflops"] >= FLAGS.target_tflops else "missed"
        target = "" if softmax else f"; target {FLAGS.target_tflops:.0f} TF/s {met}"
        print(f"best correct Mosaic: {best['impl']} {best['ms']:.3f} ms {best['tflops']:.1f} "
              f"TF/s = {base / best['ms']:.2f}x Triton ({rows[0]['tflops']:.1f} TF/s){target}")
    elif not timed:
        print("no Mosaic row both ran and matched the Triton output (rel diff < 2e-2)")
    save()
    print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
    app.run(main)
