"""LayerNorm: XLA (nnx.LayerNorm under jit) vs the Pallas Triton kernels (kernels.layer_norm).

    python -m benchmarks.bench_layer_norm --out=$OUT/bench_layer_norm.json     (GPU)
    python -m benchmarks.bench_layer_norm --smoke                               (CPU, interpret)

The sequence encoders' token norms at the gem1b shape: x [--rows, --dim] in --dtype, scale
and bias float32 [D] cast to --dtype (as nnx.LayerNorm(dtype) does), eps 1e-6. Passes:
  fwd          y = LN(x)
  fwd_bwd      y and the VJP of a random dy: (y, dx, dscale, dbias)
Each (impl, pass) is jitted on its own and timed blocking on every call (median of --iters
after --warmup). Bytes (the HBM floor of one pass each way, s = the dtype's item size):
fwd 2 T D s (read x, write y) + 8 T (the kernel's float32 mean and rstd); fwd_bwd adds
3 T D s (read x and dy, write dx) + 8 T (mean, rstd read). GB/s = bytes / time,
frac_hbm = GB/s / --hbm_tbps. max_abs_err: the kernel's outputs against XLA's (float32
of each output, the largest over them). --sweep times the kernel at other knob settings
as well. Writes JSON (--out), prints a table last.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx

from benchmarks.timing import timed
from kernels.layer_norm import layer_norm

FLAGS = flags.FLAGS
flags.DEFINE_bool("smoke", False, "tiny sizes, CPU interpret mode (a check that it runs)")
flags.DEFINE_integer("rows", 1_318_144, "tokens T (gem1b: the pyramid's tokens per step)")
flags.DEFINE_integer("dim", 512, "width D")
flags.DEFINE_string("dtype", "bfloat16", "x's dtype: bfloat16 or float32")
flags.DEFINE_integer("warmup", 3, "untimed calls per program")
flags.DEFINE_integer("iters", 20, "timed calls per program")
flags.DEFINE_list("knobs", [], "kernel knob overrides, name=value (kernels.layer_norm.KNOBS)")
flags.DEFINE_list("sweep", [], "also time the kernel at these settings, each name=value pairs "
                  "joined by ':', e.g. bwd_rows=2:bwd_tiles=32,block_rows=16 (rows impl "
                  "pallas_sweep, on top of --knobs)")
flags.DEFINE_float("hbm_tbps", 4.8, "HBM bandwidth of the roofline, TB/s (H200: 4.8)")
flags.DEFINE_string("out", "bench_layer_norm.json", "JSON output path")


KINDS = ("fwd", "fwd_bwd")


def hbm_bytes(kind, t, d, itemsize):
    """The floor's bytes of one pass (module docstring)."""
    fwd = 2 * t * d * itemsize + 8 * t
    return fwd if kind == "fwd" else fwd + 3 * t * d * itemsize + 8 * t


def xla_layer_norm(x, scale, bias):
    """nnx.LayerNorm(D, dtype=x.dtype) with the given float32 scale and bias."""
    ln = nnx.LayerNorm(x.shape[1], dtype=x.dtype, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    ln.scale, ln.bias = nnx.Param(scale), nnx.Param(bias)
    return ln(x)


def kernel_layer_norm(knobs):
    def fn(x, scale, bias):
        return layer_norm(x, scale.astype(x.dtype), bias.astype(x.dtype), impl="pallas", **knobs)
    return fn


def programs(fn):
    """{pass: jitted program} of a LayerNorm fn(x, scale, bias)."""
    def fwd_bwd(x, scale, bias, dy):
        y, vjp = jax.vjp(fn, x, scale, bias)
        return (y,) + vjp(dy)
    return {"fwd": jax.jit(fn), "fwd_bwd": jax.jit(fwd_bwd)}


def parse_knobs(specs, flag="--knobs"):
    """["name=value", ...] -> {name: int(value)}; ValueError names the flag and entry."""
    knobs = {}
    for spec in specs:
        name, _, value = spec.partition("=")
        try:
            knobs[name] = int(value)
        except ValueError:
            raise ValueError(f"{flag}: expected name=int, got {spec!r}") from None
    return knobs


def max_abs_err(out, ref):
    outs = out if isinstance(out, tuple) else (out,)
    refs = ref if isinstance(ref, tuple) else (ref,)
    return max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
               for a, b in zip(outs, refs))


def main(_):
    if FLAGS.smoke:
        FLAGS.rows, FLAGS.dim, FLAGS.warmup, FLAGS.iters = 300, 96, 2, 2
        FLAGS.sweep = FLAGS.sweep[:1]
    dtype = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}[FLAGS.dtype]
    t, d = FLAGS.rows, FLAGS.dim
    itemsize = jnp.dtype(dtype).itemsize
    keys = jax.random.split(jax.random.key(0), 4)
    x = (2.0 * jax.random.normal(keys[0], (t, d), jnp.float32) + 0.5).astype(dtype)
    dy = jax.random.normal(keys[1], (t, d), jnp.float32).astype(dtype)
    scale = 1.0 + 0.1 * jax.random.normal(keys[2], (d,), jnp.float32)
    bias = 0.1 * jax.random.normal(keys[3], (d,), jnp.float32)
    knobs = parse_knobs(FLAGS.knobs)
    print(f"backend {jax.default_backend()}, {jax.devices()[0].device_kind}, T={t}, D={d}, "
          f"{FLAGS.dtype}, knobs {knobs or 'default'}", flush=True)
    impls = [("xla", "", programs(xla_layer_norm)),
             ("pallas", "", programs(kernel_layer_norm(knobs)))]
    for spec in FLAGS.sweep:
        k = {**knobs, **parse_knobs(spec.split(":"), "--sweep")}
        impls.append(("pallas_sweep", spec, programs(kernel_layer_norm(k))))
    args_of = {"fwd": (x, scale, bias), "fwd_bwd": (x, scale, bias, dy)}
    rows = []
    for kind in KINDS:
        args = args_of[kind]
        ref = None
        for impl, spec, progs in impls:
            ms, out = timed(progs[kind], args, FLAGS.warmup, FLAGS.iters)
            err = None if ref is None else max_abs_err(out, ref)
            ref = out if ref is None else ref
            gbps = hbm_bytes(kind, t, d, itemsize) / (ms * 1e-3) / 1e9
            rows.append(dict(impl=impl, knobs=spec, kind=kind, ms=ms, GBps=gbps,
                             frac_hbm=gbps / (FLAGS.hbm_tbps * 1e3), max_abs_err=err))
            print(f"{kind} {impl} {spec}: {ms:.3f} ms", flush=True)
        del ref, out
    with open(FLAGS.out, "w") as f:
        json.dump(dict(rows_t=t, d=d, dtype=FLAGS.dtype, knobs=knobs, backend=jax.default_backend(),
                       hbm_tbps=FLAGS.hbm_tbps, rows=rows), f, indent=1)
    print(f"\n{'pass':11} {'impl':13} {'knobs':24} {'ms':>9} {'GB/s':>8} {'frac_hbm':>8} "
          f"{'max_abs_err':>11}")
    for r in rows:
        err = "" if r["max_abs_err"] is None else f"{r['max_abs_err']:.3g}"
        print(f"{r['kind']:11} {r['impl']:13} {r['knobs']:24} {r['ms']:9.3f} {r['GBps']:8.1f} "
              f"{r['frac_hbm']:8.3f} {err:>11}")


if __name__ == "__main__":
    app.run(main)
