"""Interleaved A/B timing of attention variants on one workload (one GPU).

    python3 -m tools.ab_attention --workload=W1 --rounds=6 \\
        --variants='gdpa_mosaic,gdpa_mosaic[schedule_barrier=0],gdpa_mosaic[fused_dq=1]'

The H200's sustained clock drifts by a few percent as it warms under its power cap
(docs/kernels.md), more than the knobs we compare gain. So each
round times every variant once (attention_workloads.time_stream: --warm_s of calls,
then the slope between rounds of --iters and 2 --iters calls), in an order rotated
by one each round, and the table gives per variant and pass the mean, min and max
over rounds and in how many rounds it beat the first variant (the baseline) on the
same round. A variant that fails to compile or run is reported and left out (the
first that runs is then the baseline). Variants use attention_workloads.parse_variant's
syntax: op_engine[knobs], op gdpa (SiLU) / softmax / block, engine triton / mosaic,
MosaicConfig knobs joined by '+'. Useful TFLOP/s counts valid pairs only (4 H D
sum(Lq Lk) forward, 3.5x that for forward+backward). --out writes every round's
figures as JSON.
"""

import json

import jax
import numpy as np
from absl import app, flags

from benchmarks.attention_workloads import (fwd_and_train, op_fn, pack_arrays, parse_variant,
                                            runnable, time_stream, valid_pairs, workload)

FLAGS = flags.FLAGS
flags.DEFINE_string("workload", "W1", "W1-W4 (attention_workloads)")
flags.DEFINE_list("variants", ["gdpa_mosaic", "gdpa_mosaic[schedule_barrier=0]"],
                  "parse_variant specs; the first is the baseline of the win counts")
flags.DEFINE_list("passes", ["fwd", "fwd_bwd"], "fwd and / or fwd_bwd")
flags.DEFINE_integer("rounds", 4, "rounds; each times every variant once")
flags.DEFINE_integer("iters", 50, "calls per short timing round (time_stream)")
flags.DEFINE_float("warm_s", 0.3, "seconds of back-to-back calls before each timing")
flags.DEFINE_float("scale", 0.0, "GDPA scale (0: 1 / the longest K/V length, as bench_attention)")
flags.DEFINE_integer("max_samples", 0, "keep only the first N samples (smoke tests); 0 = all")
flags.DEFINE_string("out", "", "JSON output path (empty: none)")


def summarize(times, names, flops):
    """times[variant][pass] = [seconds per round] -> table rows (dicts)."""
    rows = []
    for p in FLAGS.passes:
        base = np.asarray(times[names[0]][p])
        for name in names:
            t = np.asarray(times[name][p])
            fl = flops * (3.5 if p == "fwd_bwd" else 1.0)
            rows.append(dict(variant=name, pass_=p, mean_ms=t.mean() * 1e3, min_ms=t.min() * 1e3,
                             max_ms=t.max() * 1e3, tflops=fl / t.mean() / 1e12,
                             wins=int(np.sum(t < base)), ties=int(np.sum(t == base)),
                             rounds=len(t)))
    return rows


def main(argv):
    del argv
    if FLAGS.rounds < 1 or not FLAGS.variants:
        raise app.UsageError("--rounds must be >= 1 and --variants non-empty")
    if set(FLAGS.passes) - {"fwd", "fwd_bwd"}:
        raise app.UsageError(f"--passes: fwd and / or fwd_bwd, got {FLAGS.passes}")
    kind, ql, kl = workload(FLAGS.workload)
    if FLAGS.max_samples:
        ql, kl = ql[:FLAGS.max_samples], kl[:FLAGS.max_samples]
    scale = FLAGS.scale or 1.0 / int(kl.max())
    q, k, v, do, qo, ko = pack_arrays(ql, kl, 4, 128, jax.numpy.bfloat16,
                                      np.random.default_rng(0))
    flops = 4 * 4 * 128 * valid_pairs(kind, ql, kl)
    fns = {}
    for spec in FLAGS.variants:
        op, engine, knobs = parse_variant(spec)
        fwd, train = fwd_and_train(op_fn(op, engine, knobs, qo, ko, scale))
        fns[spec] = {"fwd": (fwd, (q, k, v)), "fwd_bwd": (train, (q, k, v, do))}
    fns, errors = runnable(fns, FLAGS.passes)
    names = list(fns)
    if not names:
        raise SystemExit("ab_attention: no variant ran")
    times = {n: {p: [] for p in FLAGS.passes} for n in names}
    for r in range(FLAGS.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for p in FLAGS.passes:
            for name in order:
                f, args = fns[name][p]
                times[name][p].append(time_stream(f, *args, iters=FLAGS.iters,
                                                  warm_s=FLAGS.warm_s)[0])
        print(f"round {r + 1}/{FLAGS.rounds}: " + ", ".join(
            f"{n} {p} {times[n][p][-1] * 1e3:.3f}" for p in FLAGS.passes for n in names),
            flush=True)
    rows = summarize(times, names, flops)
    if FLAGS.out:
        with open(FLAGS.out, "w") as fh:
            json.dump(dict(workload=FLAGS.workload, flops_fwd=flops, device=str(jax.devices()[0]),
                           times_s=times, rows=rows, errors=errors), fh, indent=1)
    print(f"\n{FLAGS.workload}, {FLAGS.rounds} interleaved rounds, ms per call (sustained)")
    print(f"{'variant':<44} {'pass':<8} {'mean':>7} {'min':>7} {'max':>7} {'TF/s':>6} "
          f"{'wins vs first':>13}")
    for row in rows:
        print(f"{row['variant']:<44} {row['pass_']:<8} {row['mean_ms']:7.3f} {row['min_ms']:7.3f} "
              f"{row['max_ms']:7.3f} {row['tflops']:6.0f} {row['wins']:>6}/{row['rounds']}")
    for name, err in errors.items():
        print(f"{name:<44} failed: {err[:120]}")


if __name__ == "__main__":
    app.run(main)
