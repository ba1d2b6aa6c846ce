"""Benchmark the jagged attention kernels on one GPU (issue 6 workloads W1-W4).

For each workload: forward and forward+backward time of our Pallas kernel, the
useful TFLOP/s (valid query-key pairs only: 4*H*D*sum(Lq*Lkv) forward, 3.5x that
for forward+backward), the roofline floor max(FLOPs / peak, bytes / HBM BW), and
the best alternatives in the same run: cuDNN softmax attention on padded tensors
with sequence lengths, and the GDPA formula in plain jnp on padded tensors.

    python3 -m benchmarks.bench_attention --out /tmp/bench.json
    python3 -m benchmarks.bench_attention --sweep --sweep_budget_s=50

Times are per call in a steady stream of back-to-back calls at the GPU's sustained clock
(attention_workloads.time_stream: --warm_s=0.3 s of calls first, as the H200 throttles to its 700 W
power cap within tens of ms; then the slope between rounds of --iters and 2 * --iters
calls, so a round's fixed cost of first-dispatch latency and final sync drops out); the
per-call time of the longer round, that cost included, is printed beside it as 'round'.

--chain=8 also times 8 calls chained inside one jit (per call): no dispatch gap between
calls, as inside a training step (every row, or the rows --chain_rows names). Rows: our
kernels (the public defaults and engine / knob variants; --bwd_alts picks the backward
settings timed beside the default on W2 / W3), XLA streaming the bytes the floor counts
(self-attention shapes: the memory floor as XLA reaches it), cuDNN and padded jnp.

--sweep tries a small grid of kernel knobs per workload in the same run (forward
knobs timed on the forward, backward knobs on forward+backward with the default
forward), skips what is left once its share of --sweep_budget_s has passed, and prints the
best per workload and op before the main table.
"""

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from benchmarks.attention_workloads import (BLOCK_BWD_GRID, BLOCK_FWD_GRID,
                                            block_knobs_bwd, block_knobs_fwd, pack_arrays,
                                            fwd_and_train, parse_mosaic_knobs, stream_same_bytes,
                                            stream_same_bytes_train, time_stream, valid_pairs, workload)
from kernels.block_attention import block_attention_reference
from kernels.dispatch import block_attention_pallas
from kernels.dispatch import gdpa_pallas
from kernels.jagged_attention import jagged_attention
from kernels.dispatch import jagged_attention_pallas
from kernels.dispatch import jagged_flash
from kernels.triton import FlashConfig, adapt_tiles, build_layout
from kernels.triton import run_forward as _forward
from kernels.dispatch import TILES as GDPA_TILES
from kernels.dispatch import TILES as SOFTMAX_TILES
from kernels.dispatch import BLOCK_TILES as BLOCK_TILED_TILES

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "bench_attention.json", "JSON output path")
flags.DEFINE_list("workloads", ["W1", "W2", "W3", "W4"], "which workloads")
flags.DEFINE_integer("iters", 50, "calls per short round (long rounds: twice that); time_stream")
flags.DEFINE_integer("round_pairs", 3, "round pairs per timing, their median taken (time_stream)")
flags.DEFINE_float("warm_s", 0.3, "seconds of back-to-back calls before each timing (the GPU's "
                   "sustained clock under its power cap; 0: burst figures)")
flags.DEFINE_integer("heads", 4, "heads")
flags.DEFINE_integer("head_dim", 128, "head dim")
flags.DEFINE_string("activation", "silu", "GDPA activation")
flags.DEFINE_float("peak_tflops", 625.0, "bf16 matmul ceiling for the roofline (XLA, H200)")
flags.DEFINE_float("hbm_tbs", 3.6, "HBM bandwidth for the roofline, TB/s")
flags.DEFINE_bool("baselines", True, "also time cuDNN padded and padded jnp GDPA")
flags.DEFINE_list("rows", [], "time only the rows whose name contains one of these (empty: all)")
flags.DEFINE_list("mosaic_variants", ["schedule_barrier=0", "fused_dq=1"],
                  "W1: extra Mosaic forward + backward rows (softmax and GDPA) with these "
                  "MosaicConfig knobs (knob=int joined by '+') in all three kernels; "
                  "backward-only knobs leave the forward as it is")
flags.DEFINE_integer("chain", 0, "also time CHAIN calls chained inside one jit (per-call "
                     "time, columns 'chain'): no per-dispatch gap between calls, as inside a "
                     "training step (e.g. 8); 0 = off")
flags.DEFINE_list("chain_rows", [], "with --chain: chain only the rows of these exact names "
                  "(empty: every row)")
flags.DEFINE_list("bwd_alts", [], "W2 / W3: time only these backward settings beside the "
                  "default (tags as in the row names, e.g. fused_bwd_off; empty: all)")
flags.DEFINE_integer("max_samples", 0, "keep only the first N samples (smoke tests); 0 = all")
flags.DEFINE_integer("max_len", 0, "clip every sample's query and key lengths to N (interpret "
                     "smoke tests: the interpreter's time grows with the tokens); 0 = as drawn")
flags.DEFINE_bool("sweep", False, "also try the knob grids below, report the best")
flags.DEFINE_float("sweep_budget_s", 50.0, "per workload, split evenly over its (op, pass) "
                   "sweeps: a sweep starts no entry once its share is spent")
flags.DEFINE_float("sweep_deadline_s", 0.0, "no sweep entry starts this many seconds after "
                   "the program started (0: no deadline); the main rows always run")

# Knob grids (--sweep). Tiled engine forward: bq:bk:num_warps:num_stages (the dQ kernel
# uses bq/bk too); backward: bq_dkv:bk_dkv:num_warps_bwd:num_stages_bwd.
# Ordered by promise (the sweep stops at its budget): 64x64 with 8 warps (122 registers,
# 16 warps per SM in the resource report, never timed), then the defaults and the rest.
FWD_GRID = ["64:64:8:3", "64:64:4:3", "64:64:8:2", "64:64:4:2", "64:32:4:3", "64:128:4:2",
            "128:64:8:3", "128:128:8:2", "128:64:4:3"]
# 32-key dK/dV tiles remove its register spill (884 B per thread for GDPA at 64:64:4).
BWD_GRID = ["64:32:4:2", "64:32:8:2", "64:64:4:2", "64:64:8:2", "32:64:4:2", "64:128:8:2",
            "128:64:8:2"]
_START = time.perf_counter()


def timeit(fn, *args):
    """Seconds per call in a steady stream (attention_workloads.time_stream, --iters, --warm_s,
    --round_pairs)."""
    return time_stream(fn, *args, iters=FLAGS.iters, warm_s=FLAGS.warm_s,
                       pairs=FLAGS.round_pairs)[0]


def chained(fn, k):
    """One jit calling fn k times back to back, each call's inputs passed through an
    optimization barrier with the previous call's outputs (so the calls run in order
    and XLA cannot merge or hoist them); all k outputs are returned (none is dropped)."""
    def run(*args):
        outs = [fn(*args)]
        for _ in range(k - 1):
            args, _ = jax.lax.optimization_barrier((args, outs[-1]))
            outs.append(fn(*args))
        return outs
    return jax.jit(run)


def padded(x, off, lens, lmax):
    idx = np.asarray(off[:-1])[:, None] + np.arange(lmax)[None, :]
    idx = np.where(np.arange(lmax)[None, :] < lens[:, None], idx, 0)
    return jnp.where(jnp.asarray(np.arange(lmax)[None, :] < lens[:, None])[..., None, None],
                     x[jnp.asarray(idx)], 0)


def measure(name, fns, args, flops, bytes_fwd, bytes_bwd, only=None):
    """Row with fwd and fwd_bwd times / TF/s / floors; only='fwd' | 'fwd_bwd' times one."""
    fwd, train = fns
    row = dict(impl=name)
    if FLAGS.rows and not any(r in name for r in FLAGS.rows):
        row["skipped"] = "--rows"
        return row
    for tag, f, a, fl, by in (("fwd", fwd, args[:3], flops, bytes_fwd),
                              ("fwd_bwd", train, args, 3.5 * flops, bytes_fwd + bytes_bwd)):
        if only is not None and tag != only:
            continue
        try:
            t, per_round = time_stream(f, *a, iters=FLAGS.iters, warm_s=FLAGS.warm_s,
                                       pairs=FLAGS.round_pairs)
            row[tag + "_ms"] = t * 1e3
            row[tag + "_round_ms"] = per_round * 1e3   # a round's fixed cost included
            row[tag + "_tflops"] = fl / t / 1e12
            floor = max(fl / (FLAGS.peak_tflops * 1e12), by / (FLAGS.hbm_tbs * 1e12))
            row[tag + "_floor_ms"] = floor * 1e3
            if FLAGS.chain > 1 and (not FLAGS.chain_rows or name in FLAGS.chain_rows):
                t = timeit(chained(f, FLAGS.chain), *a) / FLAGS.chain
                row[tag + "_chain_ms"] = t * 1e3
                row[tag + "_chain_tflops"] = fl / t / 1e12
        except Exception as e:  # baselines may OOM or be unsupported; record it
            row[tag + "_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    return row


def run_workload(wname, rng):
    kind, ql, kl = workload(wname)
    if FLAGS.max_samples:
        ql, kl = ql[:FLAGS.max_samples], kl[:FLAGS.max_samples]
    if FLAGS.max_len:
        ql, kl = np.minimum(ql, FLAGS.max_len), np.minimum(kl, FLAGS.max_len)
    h, d, dt = FLAGS.heads, FLAGS.head_dim, jnp.bfloat16
    q, k, v, do, qo, ko = pack_arrays(ql, kl, h, d, dt, rng)
    pairs = valid_pairs(kind, ql, kl)
    flops = 4.0 * h * d * pairs
    tok_bytes = h * d * 2
    nq, nk = int(ql.sum()), int(kl.sum())
    bytes_fwd = (2 * nq + 2 * nk) * tok_bytes                   # q, k, v in; o out
    bytes_bwd = (3 * nq + 4 * nk) * tok_bytes                   # q,k,v,o?,do in; dq,dk,dv out
    args = (q, k, v, do)
    rows = []
    meta = dict(workload=wname, kind=kind, samples=len(ql), q_tokens=nq, kv_tokens=nk,
                valid_pairs=pairs, fwd_gflop=flops / 1e9, bytes_fwd=bytes_fwd,
                bytes_fwd_bwd=bytes_fwd + bytes_bwd, max_q=int(ql.max()), max_kv=int(kl.max()))
    act = FLAGS.activation
    scale = 1.0 / int(kl.max())
    if kind != "cross" and q.shape == k.shape:   # the memory floor as XLA reaches it
        rows.append(measure("xla_stream_same_bytes", (jax.jit(stream_same_bytes),
                                                      jax.jit(stream_same_bytes_train)),
                            args, flops, bytes_fwd, bytes_bwd))
    if kind == "block":
        rows.append(measure("pallas_block", fwd_and_train(
            lambda q, k, v: block_attention_pallas(q, k, v, qo)), args, flops, bytes_fwd, bytes_bwd))
        rows.append(measure("pallas_block_per_block_exact_trig", fwd_and_train(
            lambda q, k, v: block_attention_pallas(q, k, v, qo, engine="per_block", fast_trig=False)),
            args, flops, bytes_fwd, bytes_bwd))
        tiled = FlashConfig(mode="softmax", scale=d ** -0.5, block=64, rope=True,
                            interpret=jax.default_backend() != "gpu", **BLOCK_TILED_TILES)
        rows.append(measure("pallas_block_tiled_engine", fwd_and_train(
            lambda q, k, v: jagged_flash(tiled, q, k, v, qo, qo, rope_theta=10_000.0)), args,
            flops, bytes_fwd, bytes_bwd))
        rows.append(measure("jnp_block_reference", fwd_and_train(
            lambda q, k, v: block_attention_reference(q, k, v, qo)), args, flops, bytes_fwd,
            bytes_bwd))
        if FLAGS.sweep:
            meta["sweep"] = sweep_block(qo, args, flops, bytes_fwd, bytes_bwd, rows)
        w1 = valid_pairs("self", ql, kl) * 4.0 * h * d
        rows.append(measure("pallas_softmax_W1", fwd_and_train(
            lambda q, k, v: jagged_attention_pallas(q, k, v, qo, ko)), args, w1, bytes_fwd,
            bytes_bwd))
        # the W4 target's yardstick: W1 jagged softmax through the public op's default
        # (the Mosaic kernels on a Hopper GPU)
        rows.append(measure("default_softmax_W1", fwd_and_train(
            lambda q, k, v: jagged_attention(q, k, v, qo, ko)), args, w1, bytes_fwd, bytes_bwd))
        meta["w1_over_w4_flops"] = w1 / flops
        return meta, rows
    rows.append(measure(f"pallas_gdpa_{act}", fwd_and_train(
        lambda q, k, v: gdpa_pallas(q, k, v, qo, ko, activation=act, scale=scale)),
        args, flops, bytes_fwd, bytes_bwd))
    if kind == "self" and jax.default_backend() == "gpu":
        # the Mosaic GPU forward (kernels/mosaic/forward.py) with the Triton backward
        rows.append(measure(f"mosaic_fwd_gdpa_{act}", fwd_and_train(
            lambda q, k, v: gdpa_pallas(q, k, v, qo, ko, activation=act, scale=scale,
                                        forward="mosaic")), args, flops, bytes_fwd, bytes_bwd))
        # and the Mosaic backward (dQ, dK / dV kernels) too
        rows.append(measure(f"mosaic_fwd_bwd_gdpa_{act}", fwd_and_train(
            lambda q, k, v: gdpa_pallas(q, k, v, qo, ko, activation=act, scale=scale,
                                        forward="mosaic", backward="mosaic")),
            args, flops, bytes_fwd, bytes_bwd))
    rows.append(measure("pallas_softmax", fwd_and_train(
        lambda q, k, v: jagged_attention_pallas(q, k, v, qo, ko)), args, flops, bytes_fwd,
        bytes_bwd))
    if kind != "self":   # the fused backward's other settings beside the default
        # (default "auto": "k_rows" on W2, "q_rows" on W3), the rest kernel one tile per
        # program (rest_group; "auto": 8), and on W2 the dK/dV kernel's query loop whole
        # (dkv_split 1), every key tile in 2 and the 16
        # heaviest in 8 ("auto": the 32 heaviest in 4)
        alts = [("fused_bwd_off", dict(fused_bwd="off")), ("rest_group1", dict(rest_group=1))]
        if kind == "cross":
            alts += [("dkv_split1", dict(dkv_split=1)),
                     ("dkv_split2_all", dict(dkv_split=2, dkv_split_tiles=0)),
                     ("dkv_split8_top16", dict(dkv_split=8, dkv_split_tiles=16))]
        for tag, kw in alts:
            if FLAGS.bwd_alts and tag not in FLAGS.bwd_alts:
                continue
            rows.append(measure(f"pallas_gdpa_{act}_{tag}", fwd_and_train(
                lambda q, k, v, kw=kw: gdpa_pallas(q, k, v, qo, ko, activation=act,
                                                   scale=scale, **kw)),
                args, flops, bytes_fwd, bytes_bwd, only="fwd_bwd"))
            rows.append(measure(f"pallas_softmax_{tag}", fwd_and_train(
                lambda q, k, v, kw=kw: jagged_attention_pallas(q, k, v, qo, ko, **kw)),
                args, flops, bytes_fwd, bytes_bwd, only="fwd_bwd"))
    if kind == "self" and jax.default_backend() == "gpu":
        rows.append(measure("mosaic_fwd_softmax", fwd_and_train(
            lambda q, k, v: jagged_attention_pallas(q, k, v, qo, ko, forward="mosaic")), args,
            flops, bytes_fwd, bytes_bwd))
        rows.append(measure("mosaic_fwd_bwd_softmax", fwd_and_train(
            lambda q, k, v: jagged_attention_pallas(q, k, v, qo, ko, forward="mosaic",
                                                    backward="mosaic")), args,
            flops, bytes_fwd, bytes_bwd))
        for spec in FLAGS.mosaic_variants:   # MosaicConfig knobs, side by side
            kw = dict(forward="mosaic", backward="mosaic",
                      mosaic_fwd=tuple(sorted(parse_mosaic_knobs(spec).items())))
            kw["mosaic_bwd"] = kw["mosaic_fwd"]
            rows.append(measure(f"mosaic_fwd_bwd_softmax[{spec}]", fwd_and_train(
                lambda q, k, v, kw=kw: jagged_attention_pallas(q, k, v, qo, ko, **kw)),
                args, flops, bytes_fwd, bytes_bwd))
            rows.append(measure(f"mosaic_fwd_bwd_gdpa_{act}[{spec}]", fwd_and_train(
                lambda q, k, v, kw=kw: gdpa_pallas(q, k, v, qo, ko, activation=act,
                                                   scale=scale, **kw)),
                args, flops, bytes_fwd, bytes_bwd))
    # where the forward time goes: layout (XLA) vs the Pallas kernel alone
    b = len(ql)
    cfg = adapt_tiles(FlashConfig(mode="gdpa", activation=act, scale=scale, **GDPA_TILES,
                                  fast_act=True, interpret=jax.default_backend() != "gpu"),
                      q.shape[0], k.shape[0], b, q.dtype)
    lay_fn = jax.jit(lambda qo, ko: build_layout(cfg, qo, ko, q.shape[0], k.shape[0], d))
    lay = lay_fn(qo, ko)
    kern = jax.jit(lambda q, k, v, lay: _forward(cfg, q, k, v, lay)[0])
    meta["gdpa_tiles"] = dict(bq=cfg.bq, bk=cfg.bk, bq_dkv=cfg.bq_dkv, bk_dkv=cfg.bk_dkv)
    meta["layout_only_ms"] = timeit(lay_fn, qo, ko) * 1e3
    meta["gdpa_fwd_kernel_only_ms"] = timeit(kern, q, k, v, lay) * 1e3
    meta["gdpa_fwd_kernel_only_tflops"] = flops / meta["gdpa_fwd_kernel_only_ms"] / 1e9
    if FLAGS.sweep:
        ops = {"gdpa": (GDPA_TILES, lambda q, k, v, t: gdpa_pallas(
            q, k, v, qo, ko, activation=act, scale=scale, **t))}
        if kind == "self":
            ops["softmax"] = (SOFTMAX_TILES, lambda q, k, v, t: jagged_attention_pallas(
                q, k, v, qo, ko, **t))
        budget = FLAGS.sweep_budget_s / (2 * len(ops))
        meta["sweep"] = {op: sweep_tiled(op, base, fn, (len(ql), q.shape[0], k.shape[0]), args,
                                         flops, bytes_fwd, bytes_bwd, rows, budget)
                         for op, (base, fn) in ops.items()}
    if FLAGS.baselines:
        lq, lk = int(ql.max()), int(kl.max())
        qp, dop = padded(q, qo, ql, lq), padded(do, qo, ql, lq)
        kp, vp = padded(k, ko, kl, lk), padded(v, ko, kl, lk)
        pargs = (qp, kp, vp, dop)
        qlen, klen = jnp.asarray(ql, jnp.int32), jnp.asarray(kl, jnp.int32)

        def cudnn(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, query_seq_lengths=qlen,
                                                key_value_seq_lengths=klen,
                                                implementation="cudnn")
        rows.append(measure("cudnn_padded_softmax", fwd_and_train(cudnn), pargs, flops,
                            bytes_fwd, bytes_bwd))
        mq = jnp.asarray(np.arange(lq)[None, :] < ql[:, None])
        mk = jnp.asarray(np.arange(lk)[None, :] < kl[:, None])
        actf = {"silu": jax.nn.silu, "gelu": lambda x: jax.nn.gelu(x, approximate=False),
                "gelu_tanh": jax.nn.gelu, "relu": jax.nn.relu, "identity": lambda x: x}[act]

        def jnp_gdpa(q, k, v):
            s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
            p = actf(s) * scale
            p = jnp.where(mq[:, None, :, None] & mk[:, None, None, :], p, 0).astype(v.dtype)
            return jnp.einsum("bhqk,bkhd->bqhd", p, v)
        rows.append(measure("jnp_padded_gdpa", fwd_and_train(jnp_gdpa), pargs, flops,
                            bytes_fwd, bytes_bwd))
    return meta, rows


def _time_left(t0, budget):
    now = time.perf_counter()
    left = budget - (now - t0)
    if FLAGS.sweep_deadline_s > 0:
        left = min(left, FLAGS.sweep_deadline_s - (now - _START))
    return left


def _sweep(label, grid, knobs_of, dedupe_key, fn, args, flops, bytes_fwd, bytes_bwd, rows, only,
           budget):
    """Time fn(q, k, v, knobs) for each grid entry (one of fwd / fwd_bwd); best entry."""
    best, seen, t0 = None, set(), time.perf_counter()
    for spec in grid:
        knobs = knobs_of(spec)
        key = dedupe_key(knobs)
        if key in seen:
            continue
        seen.add(key)
        if _time_left(t0, budget) <= 0:
            rows.append(dict(impl=f"sweep_{label}_{spec}", skipped="sweep budget spent"))
            continue
        row = measure(f"sweep_{label}_{spec}", fwd_and_train(
            lambda q, k, v, t=knobs: fn(q, k, v, t)), args, flops, bytes_fwd, bytes_bwd, only)
        row["knobs"] = knobs
        rows.append(row)
        ms = row.get(only + "_ms")
        print(f"[sweep] {label} {spec}: {only} "
              + (f"{ms:.3f} ms" if ms is not None else row.get("error", "no time")), flush=True)
        if ms is not None and (best is None or ms < best["ms"]):
            best = dict(spec=spec, knobs=knobs, ms=ms, tflops=row[only + "_tflops"])
    return best


def sweep_tiled(op, base, fn, shape, args, flops, bytes_fwd, bytes_bwd, rows, budget):
    """Best forward and backward tiles of the tiled engine for one op on this workload."""
    b, tq, tk = shape
    dt = args[0].dtype

    def adapted(t):  # the tiles the kernel really runs (short sides shrink them)
        c = adapt_tiles(FlashConfig(mode="gdpa", **t), tq, tk, b, dt)
        return tuple(getattr(c, f) for f in ("bq", "bk", "bq_dkv", "bk_dkv", "num_warps",
                                             "num_stages", "num_warps_bwd", "num_stages_bwd"))

    def fwd_knobs(spec):
        bq, bk, nw, ns = (int(x) for x in spec.split(":"))
        return {**base, "bq": bq, "bk": bk, "num_warps": nw, "num_stages": ns}

    def bwd_knobs(spec):
        bq, bk, nw, ns = (int(x) for x in spec.split(":"))
        return {**base, "bq_dkv": bq, "bk_dkv": bk, "num_warps_bwd": nw, "num_stages_bwd": ns}

    common = (fn, args, flops, bytes_fwd, bytes_bwd, rows)
    return dict(fwd=_sweep(f"{op}_fwd", FWD_GRID, fwd_knobs, adapted, *common, "fwd", budget),
                bwd=_sweep(f"{op}_bwd", BWD_GRID, bwd_knobs, adapted, *common, "fwd_bwd",
                           budget))


def sweep_block(qo, args, flops, bytes_fwd, bytes_bwd, rows):
    """Best per-block kernel knobs (W4) for the forward and the backward."""
    fn = lambda q, k, v, t: block_attention_pallas(q, k, v, qo, engine="per_block", **t)
    key = lambda t: tuple(sorted(t.items()))
    common = (fn, args, flops, bytes_fwd, bytes_bwd, rows)
    budget = FLAGS.sweep_budget_s / 2
    return {"block": dict(
        fwd=_sweep("block_fwd", BLOCK_FWD_GRID, block_knobs_fwd, key, *common, "fwd", budget),
        bwd=_sweep("block_bwd", BLOCK_BWD_GRID, block_knobs_bwd, key, *common, "fwd_bwd",
                   budget))}


def main(_):
    rng = np.random.default_rng(1)
    results = []
    for w in FLAGS.workloads:
        meta, rows = run_workload(w, rng)
        results.append(dict(meta=meta, rows=rows))
        print(json.dumps(meta), flush=True)
        for r in rows:
            print("  ", json.dumps(r), flush=True)
        with open(FLAGS.out, "w") as f:  # after every workload: partial runs keep results
            json.dump(dict(device=str(jax.devices()[0]), results=results), f, indent=1)
    if FLAGS.sweep:
        print(f"\nsweep best (default knobs in kernels/triton/tuning.py TUNING / BLOCK_KNOBS)")
        print(f"{'wl':3} {'op':8} {'pass':4} {'best spec':>14} {'ms':>8} {'TF/s':>6}")
        for res in results:
            for op, passes in res["meta"].get("sweep", {}).items():
                for pas, bst in passes.items():
                    if bst:
                        print(f"{res['meta']['workload']:3} {op:8} {pas:4} {bst['spec']:>14} "
                              f"{bst['ms']:8.3f} {bst['tflops']:6.0f}")
    print(f"\nms per call in a steady stream (round: per call of one round of {2 * FLAGS.iters}, "
          "its fixed cost included)")
    print(f"{'wl':3} {'impl':40} {'fwd ms':>8} {'TF/s':>6} {'floor':>7} "
          f"{'f+b ms':>8} {'TF/s':>6} {'floor':>7}  {'round: fwd':>10} {'f+b':>7}"
          + (f"  {'chained: fwd':>12} {'TF/s':>6} {'f+b':>7} {'TF/s':>6}" if FLAGS.chain > 1
             else ""))
    for res in results:
        for r in res["rows"]:
            if r["impl"].startswith("sweep_"):
                continue  # in the JSON and the sweep summary
            g = lambda key: r.get(key, float("nan"))
            print(f"{res['meta']['workload']:3} {r['impl'][:40]:40} {g('fwd_ms'):8.3f} "
                  f"{g('fwd_tflops'):6.0f} {g('fwd_floor_ms'):7.3f} {g('fwd_bwd_ms'):8.3f} "
                  f"{g('fwd_bwd_tflops'):6.0f} {g('fwd_bwd_floor_ms'):7.3f}  "
                  f"{g('fwd_round_ms'):10.3f} {g('fwd_bwd_round_ms'):7.3f}"
                  + (f"  {g('fwd_chain_ms'):12.3f} {g('fwd_chain_tflops'):6.0f} "
                     f"{g('fwd_bwd_chain_ms'):7.3f} {g('fwd_bwd_chain_tflops'):6.0f}"
                     if FLAGS.chain > 1 else ""))
    for res in results:
        if "w1_over_w4_flops" in res["meta"]:
            print(w4_speedup_line(res["meta"], res["rows"]))


def w4_speedup_line(meta, rows):
    """W4's target: BlockAttention (the default engine) faster than W1 jagged softmax (the
    public op's default) by at least their FLOP ratio / 4; per call and chained."""
    by = {r["impl"]: r for r in rows}
    blk, w1 = by.get("pallas_block", {}), by.get("default_softmax_W1", {})
    want = meta["w1_over_w4_flops"] / 4
    parts = []
    for tag in ("fwd", "fwd_bwd", "fwd_round", "fwd_bwd_round", "fwd_chain", "fwd_bwd_chain"):
        a, b = blk.get(tag + "_ms"), w1.get(tag + "_ms")
        if a and b:
            parts.append(f"{tag} {b / a:.2f}x")
    return (f"W4 (pallas_block) vs W1 softmax (default impl): {', '.join(parts) or 'n/a'}; "
            f"target FLOPs / 4 = {want:.2f}x")


if __name__ == "__main__":
    app.run(main)
