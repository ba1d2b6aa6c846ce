"""Sorted segment sum: XLA's segment_sum (the sparse path's reference) vs the Pallas kernel.

    python -m benchmarks.bench_segment_sum --out=$OUT/bench_segment_sum.json     (GPU)
    python -m benchmarks.bench_segment_sum --smoke                                (CPU, interpret)

The duplicate sum of gemjax.sparse.routing.sum_duplicates (sort residual) at the gem1b
shape: N positions, per-position grads g [N + 1, D] (the last row zero, as the
collection builds them), ids sorted by routing.sorted_unique (perm, seg), output
float32 [N, D] (num_segments = N). Cases (--cases):
  zipf    ids Zipf(--zipf) over [0, --vocab) (truncated by resampling)
  unique  N distinct ids (every segment one position)
  heavy   ids uniform over --heavy_ids values (a few segments of ~N / heavy_ids positions)
Each impl is jitted on its own and timed blocking on every call (median of --iters after
--warmup). Bytes (the HBM floor): N D s read (the gathered rows, s = g's item size)
+ 8 N (idx, seg) + 4 K D written; GB/s = bytes / time; frac_hbm = GB/s / --hbm_tbps.
max_abs_err: the kernel against XLA (float32 summation order only). --sweep also times
the kernel at each --sweep_knobs setting on the zipf case. Writes JSON (--out), prints
a table last.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from benchmarks.timing import timed
from gemjax.sparse.routing import sorted_unique
from kernels.segment_sum import sorted_segment_sum, sorted_segment_sum_reference

FLAGS = flags.FLAGS
flags.DEFINE_bool("smoke", False, "tiny sizes, CPU interpret mode (a check that it runs)")
flags.DEFINE_integer("n", 2_636_288, "positions N (gem1b: two sequence features' tokens)")
flags.DEFINE_integer("dim", 512, "row width D")
flags.DEFINE_integer("vocab", 2_000_000, "id range of the zipf case")
flags.DEFINE_float("zipf", 1.1, "Zipf exponent of the zipf case")
flags.DEFINE_integer("heavy_ids", 64, "distinct ids of the heavy case")
flags.DEFINE_list("cases", ["zipf", "unique", "heavy"], "cases to time")
flags.DEFINE_string("dtype", "bfloat16", "g's dtype: bfloat16 or float32")
flags.DEFINE_integer("warmup", 3, "untimed calls per program")
flags.DEFINE_integer("iters", 20, "timed calls per program")
flags.DEFINE_bool("sweep", False, "also time the kernel at each --sweep_knobs setting (zipf)")
flags.DEFINE_list("sweep_knobs", ["64/128/4", "64/256/8", "32/128/4", "128/128/8", "64/64/4",
                                  "32/256/4"],
                  "block_n/block_d/num_warps settings for --sweep")
flags.DEFINE_float("hbm_tbps", 4.8, "HBM bandwidth of the roofline, TB/s (H200: 4.8)")
flags.DEFINE_string("out", "bench_segment_sum.json", "JSON output path")


def zipf_ids(rng, n, vocab, a):
    """n ids Zipf(a) over [0, vocab): P(i) proportional to (i + 1)^-a."""
    p = 1.0 / np.arange(1, vocab + 1, dtype=np.float64) ** a
    return rng.choice(vocab, size=n, p=p / p.sum()).astype(np.int32)


def case_ids(name, rng, n):
    if name == "zipf":
        return zipf_ids(rng, n, FLAGS.vocab, FLAGS.zipf)
    if name == "unique":
        return rng.permutation(n).astype(np.int32)
    if name == "heavy":
        return rng.integers(0, FLAGS.heavy_ids, size=n).astype(np.int32)
    raise ValueError(f"--cases: unknown case {name!r} (have zipf, unique, heavy)")


def hbm_bytes(n, d, k, itemsize):
    """The floor's bytes: gathered rows read, idx + seg read, the float32 output written."""
    return n * d * itemsize + 8 * n + 4 * k * d


def row(case, impl, ms, n, d, k, itemsize, u, err=None, knobs=None):
    gbps = hbm_bytes(n, d, k, itemsize) / (ms * 1e-3) / 1e9
    return dict(case=case, impl=impl, ms=ms, GBps=gbps, frac_hbm=gbps / (FLAGS.hbm_tbps * 1e3),
                n=n, d=d, unique=u, max_abs_err=err, knobs=knobs)


def main(_):
    if FLAGS.smoke:
        FLAGS.n, FLAGS.dim, FLAGS.vocab, FLAGS.warmup, FLAGS.iters = 3000, 48, 5000, 1, 2
        FLAGS.sweep_knobs = ["16/16/4"]
    dtype = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}[FLAGS.dtype]
    n, d = FLAGS.n, FLAGS.dim
    rng = np.random.default_rng(0)
    g = jnp.asarray(rng.standard_normal((n + 1, d), np.float32), dtype).at[n].set(0)
    itemsize = jnp.dtype(dtype).itemsize
    xla = jax.jit(lambda g, idx, seg: sorted_segment_sum_reference(g, idx, seg, n))

    def kernel(**knobs):
        return jax.jit(lambda g, idx, seg: sorted_segment_sum(g, idx, seg, n, impl="pallas",
                                                              **knobs))

    rows = []
    print(f"backend {jax.default_backend()}, {jax.devices()[0].device_kind}, N={n}, D={d}, "
          f"g {FLAGS.dtype}", flush=True)
    for case in FLAGS.cases:
        ids = jnp.asarray(case_ids(case, rng, n))
        uniq, perm, seg = jax.jit(sorted_unique)(ids)
        u = int(jnp.sum(seg[-1]) + 1)
        args = (g, perm, seg)
        ms_x, ref = timed(xla, args, FLAGS.warmup, FLAGS.iters)
        rows.append(row(case, "xla", ms_x, n, d, n, itemsize, u))
        ms_k, out = timed(kernel(), args, FLAGS.warmup, FLAGS.iters)
        err = float(jnp.max(jnp.abs(out - ref)))
        rows.append(row(case, "pallas", ms_k, n, d, n, itemsize, u, err))
        del ref, out
        print(f"{case}: unique {u}, xla {ms_x:.3f} ms, pallas {ms_k:.3f} ms, "
              f"max abs err {err:.3g}", flush=True)
        if FLAGS.sweep and case == "zipf":
            for spec in FLAGS.sweep_knobs:
                bn, bd, w = (int(x) for x in spec.split("/"))
                knobs = dict(block_n=bn, block_d=bd, num_warps=w)
                ms, _ = timed(kernel(**knobs), args, FLAGS.warmup, FLAGS.iters)
                rows.append(row(case, "pallas_sweep", ms, n, d, n, itemsize, u, knobs=spec))
                print(f"  sweep {spec}: {ms:.3f} ms", flush=True)
    with open(FLAGS.out, "w") as f:
        json.dump(dict(n=n, d=d, dtype=FLAGS.dtype, backend=jax.default_backend(),
                       hbm_tbps=FLAGS.hbm_tbps, rows=rows), f, indent=1)
    print(f"\n{'case':8} {'impl':13} {'knobs':10} {'unique':>9} {'ms':>9} {'GB/s':>8} "
          f"{'frac_hbm':>8} {'max_abs_err':>11}")
    for r in rows:
        err = "" if r["max_abs_err"] is None else f"{r['max_abs_err']:.3g}"
        print(f"{r['case']:8} {r['impl']:13} {r['knobs'] or '':10} {r['unique']:9d} "
              f"{r['ms']:9.3f} {r['GBps']:8.1f} {r['frac_hbm']:8.3f} {err:>11}")


if __name__ == "__main__":
    app.run(main)
