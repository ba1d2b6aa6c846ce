"""Where an attention op's device time goes: every kernel launch of one call, timed by
CUPTI (jax.experimental.mosaic.gpu.profiler), for forward and forward+backward on a
workload of attention_workloads.py. One GPU.

    python3 -m tools.kernel_times --workload=W1 \
        --variants=gdpa_mosaic,softmax_mosaic,softmax_mosaic[fused_dq=1]

A variant is an op and an engine, `gdpa_triton`, `gdpa_mosaic`, `softmax_triton`,
`softmax_mosaic` (forward and backward on that engine; `block_triton`: block_attention's
per-block kernels, for W4), optionally with Mosaic
backward knobs in brackets (MosaicConfig fields, knob=int joined by '+'). Each
launch is reported as the median over --iters calls, in launch order; kernels under
--min_us are left out of the printout (not of the JSON). Forward+backward returns the
output too, as bench_attention does, so the forward is never dropped.
"""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from benchmarks.attention_workloads import op_fn, pack_arrays, parse_variant, workload

FLAGS = flags.FLAGS
flags.DEFINE_string("workload", "W1", "workload of attention_workloads.py")
flags.DEFINE_list("variants", ["gdpa_triton", "gdpa_mosaic", "softmax_triton", "softmax_mosaic"],
                  "op_engine[knobs] entries (module docstring)")
flags.DEFINE_integer("iters", 5, "calls timed per variant and pass")
flags.DEFINE_float("min_us", 3.0, "launches shorter than this are not printed")
flags.DEFINE_string("out", "kernel_times.json", "JSON output path")


def launches(fn, args, iters):
    """[(kernel name, median ms)] of one call, in launch order."""
    from jax.experimental.mosaic.gpu import profiler
    jax.block_until_ready(fn(*args))
    _, per_call = profiler.measure(fn, aggregate=False, iterations=iters)(*args)
    n = min(len(c) for c in per_call)
    return [(per_call[0][i][0], float(np.median([c[i][1] for c in per_call]))) for i in range(n)]


def main(_):
    if jax.default_backend() != "gpu":
        sys.exit("kernel_times: no GPU (jax.default_backend() is "
                 f"{jax.default_backend()!r}); CUPTI timing needs one.")
    variants = [(spec, *parse_variant(spec)) for spec in FLAGS.variants]
    _, ql, kl = workload(FLAGS.workload)
    q, k, v, do, qo, ko = pack_arrays(ql, kl, 4, 128, jnp.bfloat16, np.random.default_rng(0))
    scale = 1.0 / int(kl.max())
    results = {}
    for spec, op, engine, knobs in variants:
        fn = op_fn(op, engine, knobs, qo, ko, scale)

        def train(q, k, v, do, fn=fn):
            o, vjp = jax.vjp(fn, q, k, v)
            return o, vjp(do)
        for tag, f, args in (("fwd", jax.jit(fn), (q, k, v)), ("fwd_bwd", jax.jit(train),
                                                               (q, k, v, do))):
            rows = launches(f, args, FLAGS.iters)
            results[f"{spec}/{tag}"] = rows
            print(f"{spec} {tag}: {sum(ms for _, ms in rows):.4f} ms device, {len(rows)} launches")
            for name, ms in rows:
                if ms * 1e3 >= FLAGS.min_us:
                    print(f"    {ms:8.4f} ms  {name[:80]}")
        with open(FLAGS.out, "w") as fh:   # after every variant: a cut-short run keeps its rows
            json.dump(dict(workload=FLAGS.workload, results=results), fh, indent=1)


if __name__ == "__main__":
    app.run(main)
