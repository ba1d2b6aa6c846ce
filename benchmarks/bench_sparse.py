"""Sparse embedding step: routed lookup + fused row-wise Adagrad, every dedup variant vs naive JAX.

    XLA_PYTHON_CLIENT_MEM_FRACTION=.97 python3 -m benchmarks.bench_sparse \
        --vocab=100000000 --dim=128 --batch=65536 --ids_per_sample=20 --out=$OUT/bench_sparse.json
    ... --shard            the same table row-wise over every local GPU (global batch --batch)

Rows (each timed as its own jitted program, median of --steps; the profiler only with
--profile_steps, after the timing):
  step     lookup + apply_gradients of EmbeddingCollection, state donated, per variant
           (each step blocked on: host dispatch + device time)
  step_pipe  the same step, --steps of them dispatched back to back and blocked on once
           (per step), as in a training loop: the host queues step k + 1 while the
           device runs step k, so host time hides behind device time, except where the
           step itself waits for the host (a lax.switch on XLA:GPU: a device-to-host
           copy of the branch index, then the host launches the branch)
  lookup   coll.lookup alone
  apply    coll.apply_gradients alone (fixed residuals and grads, state donated)
  dedup    the id dedupe alone (1 device): "sort" = one stable key-value sort +
           run starts + cumsum; "scatter" = jnp.unique(return_inverse)
  dupsum   summing the N per-id grads [N, D] per unique id alone (1 device)
  update   the fused row-wise Adagrad on the unique rows alone (1 device: gather
           rows + accumulators, update, scatter back; donated)
  naive    jnp.take + jax.grad w.r.t. the whole table + optax.adagrad (dense [V, D]
           grad), at the first size of --naive_rows that fits (1 device only)
  probe    the sort step at growing vocab sizes (--probe_rows; empty to skip)
Variants (--variants; EmbeddingCollection options, see gemjax/sparse/routing.py):
  scatter               dedup="scatter", no buckets: the original jnp.unique + unsorted scatter-add
  sort                  dedup="sort", no buckets: stable sort reused by the backward, sorted segment_sum
  sort_scatter          dedup="sort_scatter", no buckets: the sort's dedupe, unsorted scatter-add
  sort_buckets          dedup="sort" + unique_buckets=(1/4, 3/8, 1/2) (the default's update):
                        dup-sum and update sized to the smallest bucket >= the unique count
                        (of the N ids on a local table, of the S_m * C received slots at a
                        sharded table's owner)
  sort_scatter_buckets  dedup="sort_scatter" + the same buckets
  sort_buckets_bf16     sort_buckets + grad_dtype=bfloat16 (per-id grads gathered in bf16)
  sort_buckets_pallas   sort_buckets with update_impl="pallas": duplicate sum + row-wise Adagrad
                        fused in one Pallas Triton pass (kernels/sparse_update)
  sort_pallas           the same with one bucket of N (one program per id slot, early exit past U)
  sort_pallas_looped    sort_pallas with fused_knobs short_programs=2112 (16 per SM): a fixed grid
                        looping over the short-row groups up to U, so no lax.switch and no idle
                        programs past U
  sort_buckets_xb       sort_buckets + exchange_buckets=(1/8, 1/4, 1/2) (what the trainer's
                        train.sparse_exchange_buckets turns on): the all_to_all (ids, rows,
                        grads) runs at the smallest capacity >= the largest per-destination
                        unique count (--shard); every other variant keeps the static capacity C
                        (exchange_buckets=())
  sort_buckets_bf16_xb  sort_buckets_bf16 + the same exchange buckets
The pieces (dedup, dupsum, update) run on all N rows whatever the variant's buckets;
the *_pallas variants without buckets add "fused" rows: the fused kernel alone over the
N sorted ids (replacing dupsum + update), once per --fused_sweep setting.

Ids: Zipf(--zipf) over [0, vocab) (truncated by resampling), scattered over the
table by a multiplicative hash, N = batch * ids_per_sample per step, U = the
distinct ids of the (global) batch, averaged over the 3 batches cycled. Bytes
per step, D = dim, fp32 rows (4 bytes per element), a 4-byte accumulator per row:
  unique-row convention (the bytes a perfect kernel must move):
    lookup  4*U*D                    each distinct row read once
    update  2*U*(4*D + 4)            each distinct row + accumulator read and written once
    step / apply = lookup + update / update
  every-id convention (FBGEMM TBE benchmarks: each id's row counted):
    lookup  4*N*D + 4*A              every id's row read, activations written
    update  2*N*(4*D + 4) + 4*A      every id's row + accumulator read and written,
                                     activation grads read
    step = both; apply = update
  with A = batch*D pooled activations (N*D with --pooling=none). TB/s = bytes /
  median time; %HBM against --hbm_tbps (3.6 TB/s, the H200 copy rate) x devices.
The table (last) lists every row; the JSON (--out) holds the rows and flags.
"""

from __future__ import annotations

import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from gemjax.data.jagged import Jagged
from gemjax.sparse import EmbeddingCollection, RowWiseAdagrad, TablePlan, TableSpec, routing
from kernels import sparse_update

FLAGS = flags.FLAGS
flags.DEFINE_integer("vocab", 100_000_000, "rows of the table")
flags.DEFINE_integer("dim", 128, "embedding width")
flags.DEFINE_integer("batch", 65_536, "samples per step (global, split over devices with --shard)")
flags.DEFINE_integer("ids_per_sample", 20, "ids per sample (one bag each)")
flags.DEFINE_float("zipf", 1.05, "Zipf exponent of id popularity")
flags.DEFINE_integer("steps", 10, "timed steps")
flags.DEFINE_string("pooling", "sum", "'sum' (bags pooled to [B, D]) or 'none' ([B, L, D])")
flags.DEFINE_list("variants", ["scatter", "sort", "sort_scatter", "sort_buckets", "sort_scatter_buckets",
                                "sort_buckets_bf16", "sort_buckets_xb"], "gemjax variants to time")
flags.DEFINE_string("act_dtype", "", "EmbeddingCollection act_dtype: the unpooled rows (and so "
                    "their grads) in this dtype, e.g. bfloat16 as a bf16 model gets them "
                    "(train.sparse_act_dtype=model); empty: the table's float32")
flags.DEFINE_bool("shard", False, "shard the table row-wise over every local device")
flags.DEFINE_float("capacity_factor", 2.0, "all_to_all capacity factor of the row-wise plan (--shard): "
                   "C = factor * ids per device / shards; overflow is counted in the table")
flags.DEFINE_list("naive_rows", ["100000000", "50000000", "25000000"],
                  "vocab sizes for the naive path, largest first (1 device only; empty to skip)")
flags.DEFINE_list("probe_rows", ["200000000", "240000000", "260000000"],
                  "vocab sizes to probe (empty to skip)")
flags.DEFINE_list("fused_sweep", ["16/256/2/0", "16/1024/2/16/16", "16/256/2/16/16",
                                   "16/128/2/16/16", "16/256/4/16/16", "16/256/2/16/16/1056",
                                   "16/256/2/16/16/2112", "16/256/2/16/16/4224"],
                  "fused kernel knobs block_ids/split/num_warps[/short[/rows_per_program"
                  "[/short_programs]]] (short 0: one program per row; short_programs P: P "
                  "programs looping over the short-row groups; omitted: kernels.sparse_update.KNOBS)")
flags.DEFINE_integer("profile_steps", 0, "also trace this many steps of every variant (after its "
                     "timed steps) into <--out>.profile/<variant> and print where device time goes "
                     "(tools/profile_summary.py); 0 = off")
flags.DEFINE_float("hbm_tbps", 3.6, "reference HBM bandwidth per device, TB/s")
flags.DEFINE_string("out", "bench_sparse.json", "JSON output path")

BUCKETS = routing.DEFAULT_BUCKETS
XB = routing.DEFAULT_EXCHANGE_BUCKETS
VARIANTS = {"scatter": dict(dedup="scatter", unique_buckets=()),
            "sort": dict(dedup="sort", unique_buckets=()),
            "sort_scatter": dict(dedup="sort_scatter", unique_buckets=()),
            "sort_buckets": dict(dedup="sort", unique_buckets=BUCKETS),
            "sort_scatter_buckets": dict(dedup="sort_scatter", unique_buckets=BUCKETS),
            "sort_buckets_bf16": dict(dedup="sort", unique_buckets=BUCKETS, grad_dtype=jnp.bfloat16),
            "sort_buckets_pallas": dict(dedup="sort", unique_buckets=BUCKETS, update_impl="pallas"),
            "sort_pallas": dict(dedup="sort", unique_buckets=(1.0,), update_impl="pallas"),
            "sort_pallas_looped": dict(dedup="sort", unique_buckets=(1.0,), update_impl="pallas",
                                       fused_knobs=dict(short_programs=2112)),
            "sort_buckets_xb": dict(dedup="sort", unique_buckets=BUCKETS, exchange_buckets=XB),
            "sort_buckets_bf16_xb": dict(dedup="sort", unique_buckets=BUCKETS, grad_dtype=jnp.bfloat16,
                                         exchange_buckets=XB)}
for _kw in VARIANTS.values():      # the variants without _xb keep the static all_to_all capacity
    _kw.setdefault("exchange_buckets", ())


def zipf_ids(rng, n, vocab, a):
    """n ids, Zipf(a) ranks truncated to [1, vocab] by resampling, hashed over [0, vocab)."""
    out = np.empty(0, np.int64)
    while out.size < n:
        z = rng.zipf(a, 2 * n)
        out = np.concatenate([out, z[z <= vocab]])
    ranks = out[:n] - 1
    return ((ranks * 2654435761) % vocab).astype(np.int32)


def table_init(vocab, dim, sharding=None):
    """A fused elementwise init (no random-bit buffer, so huge tables fit), [vocab, dim] f32."""
    def make():
        r = jax.lax.broadcasted_iota(jnp.uint32, (vocab, dim), 0)
        c = jax.lax.broadcasted_iota(jnp.uint32, (vocab, dim), 1)
        h = (r * jnp.uint32(2654435761) + c * jnp.uint32(40503)) >> 16
        w = (h.astype(jnp.float32) / 65536.0 - 0.5) * (2.0 / np.sqrt(dim))
        return {"t": {"weights": w, "accum": jnp.zeros((vocab,), jnp.float32)}}
    return jax.jit(make, out_shardings=sharding)()


def make_feats(ids, mesh):
    """Global ids [N] -> {"f": ids [B, L] or a Jagged bag per device}, sharded over the mesh."""
    n_dev = mesh.size
    sh = NamedSharding(mesh, P(mesh.axis_names))
    b, per = FLAGS.batch // n_dev, FLAGS.ids_per_sample
    if FLAGS.pooling == "none":
        return {"f": jax.device_put(ids.reshape(FLAGS.batch, per), sh)}
    offsets = np.arange(b + 1, dtype=np.int32) * per
    seg = np.repeat(np.arange(b, dtype=np.int32), per)
    pos = np.tile(np.arange(per, dtype=np.int32), b)
    tile = lambda a: jax.device_put(np.tile(a, n_dev), sh)
    return {"f": Jagged(jax.device_put(ids, sh), tile(offsets), tile(seg), tile(pos))}


def timed(fn, args_fn, steps):
    """Median seconds of fn(*args_fn()) after one warm-up call; returns (last output, seconds)."""
    out = fn(*args_fn())
    jax.block_until_ready(out)
    ts = []
    for _ in range(steps):
        a = args_fn()
        t0 = time.perf_counter()
        out = fn(*a)
        jax.block_until_ready(out)
        ts.append(time.perf_counter() - t0)
    return out, float(np.median(ts))


def timed_donated(fn, state, rest, steps):
    """Like timed for fn(state, *rest) -> state with the state donated and fed back."""
    state = fn(state, *rest)
    jax.block_until_ready(state)
    ts = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state = fn(state, *rest)
        jax.block_until_ready(state)
        ts.append(time.perf_counter() - t0)
    return state, float(np.median(ts))


def make_coll(vocab, mesh, variant):
    pooling = None if FLAGS.pooling == "none" else FLAGS.pooling
    spec = TableSpec("t", vocab, FLAGS.dim, features=("f",), pooling=pooling,
                     optimizer=RowWiseAdagrad(lr=0.01), bounds="clamp")
    plan = TablePlan("row_wise", "mod", tuple(mesh.axis_names), (), FLAGS.capacity_factor)
    return EmbeddingCollection([spec], plan, mesh, act_dtype=FLAGS.act_dtype or None,
                               **VARIANTS[variant])


def profile_steps(step, state, batches, steps, variant):
    """Trace `steps` more steps; print the device time per op kind and op (per step)."""
    from tools import profile_summary
    path = os.path.join(FLAGS.out + ".profile", variant)
    with jax.profiler.trace(path, create_perfetto_trace=True):
        for k in range(steps):
            state, _ = step(state, batches[k % len(batches)])
        jax.block_until_ready(state)
    events = profile_summary.load_events(path)
    summary = profile_summary.summarize(events, steps)
    print(f"profile {variant} ({steps} steps, {path}):\n"
          + profile_summary.format_summary(summary, top=20), flush=True)
    return state


def bench_variant(coll, state, batches, steps, variant=""):
    """-> (state, {"step", "step_pipe", "lookup", "apply"} seconds, overflow, finite)."""
    def step(state, feats):
        acts, res = coll.lookup(state, feats)
        g_acts = {f: a * 1e-3 for f, a in acts.items()}
        return coll.apply_gradients(state, res, g_acts), res["stats"]["ids_overflow"]

    step = jax.jit(step, donate_argnums=0)
    # two warm-up steps: on a 1-device mesh the fused (Pallas) update returns the state
    # with a replicated rather than P("x") sharding, so the second call compiles again
    for k in range(2):
        state, over = step(state, batches[k % len(batches)])
    jax.block_until_ready(state)
    ts = []
    for k in range(steps):
        t0 = time.perf_counter()
        state, over = step(state, batches[(k + 1) % len(batches)])
        jax.block_until_ready(state)
        ts.append(time.perf_counter() - t0)
    out = {"step": float(np.median(ts))}
    t0 = time.perf_counter()
    for k in range(steps):
        state, over = step(state, batches[(k + 1) % len(batches)])
    jax.block_until_ready(state)
    out["step_pipe"] = (time.perf_counter() - t0) / steps
    if FLAGS.profile_steps:
        state = profile_steps(step, state, batches, FLAGS.profile_steps, variant)
    lookup = jax.jit(lambda s, f: coll.lookup(s, f)[0])
    i = [0]

    def args():
        i[0] += 1
        return state, batches[i[0] % len(batches)]
    _, out["lookup"] = timed(lookup, args, steps)
    acts, res = jax.jit(coll.lookup)(state, batches[0])
    g = {f: a * 1e-3 for f, a in acts.items()}
    apply = jax.jit(coll.apply_gradients, donate_argnums=0)
    state, out["apply"] = timed_donated(apply, state, (res, g), steps)
    finite = bool(jnp.isfinite(state["t"]["weights"][:1000]).all())
    return state, out, int(over), finite


def bench_pieces(state, ids, variant, steps):
    """1 device: the dedupe, the duplicate sum and the row update alone -> (state, seconds)."""
    kw = VARIANTS[variant]
    n, d = ids.size, FLAGS.dim
    key = jnp.asarray(ids)
    dedup = jax.jit(functools.partial(routing.dedup_ids, dedup=kw["dedup"]))
    (uniq, res), t_dedup = timed(dedup, lambda: (key,), steps)
    g = (jnp.arange(n * d, dtype=jnp.float32).reshape(n, d) % 7 * 1e-4).astype(
        kw.get("grad_dtype", jnp.float32))
    dupsum = jax.jit(lambda g, res: routing.sum_duplicates(g, res, n))
    g_u, t_sum = timed(dupsum, lambda: (g, res), steps)
    opt = RowWiseAdagrad(lr=0.01)
    update = jax.jit(lambda s, rows, g_u: routing.update_rows(s, rows, g_u, opt, rows_unique=True),
                     donate_argnums=0)
    rows = jnp.where(uniq != routing.INVALID, uniq, -1)
    state["t"], t_upd = timed_donated(update, state["t"], (rows, g_u), steps)
    out = {"dedup": t_dedup, "dupsum": t_sum, "update": t_upd}
    if kw.get("update_impl") == "pallas":
        del g_u
        perm, seg = res["perm"], res["seg"]
        for knob in FLAGS.fused_sweep:
            names = ("block_ids", "split", "num_warps", "short", "rows_per_program",
                     "short_programs")
            kn = dict(zip(names, (int(x) for x in knob.split("/"))))

            def fused(st, rows, seg, perm, g, kn=kn):
                wt, ac = sparse_update.row_wise_adagrad_fused(
                    st["weights"], st["accum"], rows, seg, perm, g, lr=opt.lr, eps=opt.eps, **kn)
                return {"weights": wt, "accum": ac}
            try:
                state["t"], out[f"fused {knob}"] = timed_donated(
                    jax.jit(fused, donate_argnums=0), state["t"], (rows, seg, perm, g), steps)
            except Exception as e:  # noqa: BLE001  (a knob that does not compile is a result)
                print(f"fused {knob}: {str(e).splitlines()[0][:200]}", flush=True)
                out[f"fused {knob}"] = None
    del g
    return state, out


def run_naive(vocab, ids_list, steps):
    import optax
    opt = optax.adagrad(0.01)
    w = table_init(vocab, FLAGS.dim)["t"]["weights"]
    opt_state = opt.init(w)

    def step(w, opt_state, ids):
        def loss(w):
            rows = jnp.take(w, ids, axis=0)            # [N, D]
            return jnp.sum(rows * rows) * 5e-4
        g = jax.grad(loss)(w)                          # dense [V, D]
        upd, opt_state = opt.update(g, opt_state, w)
        return optax.apply_updates(w, upd), opt_state

    step = jax.jit(step, donate_argnums=(0, 1))
    w, opt_state = step(w, opt_state, ids_list[0])
    jax.block_until_ready(w)
    ts = []
    for k in range(steps):
        t0 = time.perf_counter()
        w, opt_state = step(w, opt_state, ids_list[k % len(ids_list)])
        jax.block_until_ready(w)
        ts.append(time.perf_counter() - t0)
    del w, opt_state
    return float(np.median(ts))


def bytes_per_step(kind, u, n, dim, acts):
    """(unique-row bytes, every-id bytes) of one timed piece; see the module docstring."""
    look_u, upd_u = 4 * u * dim, 2 * u * (4 * dim + 4)
    look_n, upd_n = 4 * n * dim + 4 * acts, 2 * n * (4 * dim + 4) + 4 * acts
    if kind == "lookup":
        return look_u, look_n
    if kind in ("apply", "update", "fused"):
        return upd_u, upd_n
    if kind in ("step", "step_pipe", "naive", "probe"):
        return look_u + upd_u, look_n + upd_n
    return None, None


def main(_):
    rng = np.random.default_rng(0)
    devs = jax.local_devices() if FLAGS.shard else jax.local_devices()[:1]
    mesh = Mesh(np.array(devs), ("x",))
    n_dev = mesh.size
    if FLAGS.batch % n_dev:
        raise ValueError(f"--batch={FLAGS.batch} must divide over {n_dev} devices")
    n = FLAGS.batch * FLAGS.ids_per_sample
    acts = (n if FLAGS.pooling == "none" else FLAGS.batch) * FLAGS.dim
    results = {"device": str(devs[0]), "devices": n_dev, "flags": FLAGS.flag_values_dict()}
    rows = []

    def batches_for(vocab):
        ids = [zipf_ids(rng, n, vocab, FLAGS.zipf) for _ in range(3)]
        return ids, [make_feats(i, mesh) for i in ids]

    def record(kind, variant, vocab, t, ids, extra=None):
        u = float(np.mean([np.unique(i).size for i in ids])) if ids is not None else None
        r = {"kind": kind, "variant": variant, "devices": n_dev, "vocab": vocab,
             "params": vocab * FLAGS.dim, "ms": t * 1e3 if t is not None else None, "unique_ids": u,
             "ids": n, **(extra or {})}
        if t is not None and u is not None:
            bu, bn = bytes_per_step(kind, u, n, FLAGS.dim, acts)
            if bu is not None:
                r.update(unique_TBps=bu / t / 1e12, per_id_TBps=bn / t / 1e12,
                         unique_frac_hbm=bu / t / 1e12 / (FLAGS.hbm_tbps * n_dev),
                         per_id_frac_hbm=bn / t / 1e12 / (FLAGS.hbm_tbps * n_dev))
        rows.append(r)
        print(json.dumps(r), flush=True)

    ids, feats = batches_for(FLAGS.vocab)
    coll0 = make_coll(FLAGS.vocab, mesh, FLAGS.variants[0])
    print(coll0.describe(), flush=True)
    state = table_init(coll0.layouts["t"].padded_vocab, FLAGS.dim, coll0.state_sharding())
    for v in FLAGS.variants:
        coll = make_coll(FLAGS.vocab, mesh, v)
        t0 = time.perf_counter()
        state, ts, over, finite = bench_variant(coll, state, feats, FLAGS.steps, v)
        extra = {"overflow": over, "finite": finite, "wall_s": time.perf_counter() - t0}
        for kind in ("step", "step_pipe", "lookup", "apply"):
            record(kind, v, FLAGS.vocab, ts[kind], ids, extra if kind == "step" else None)
        if n_dev == 1 and "buckets" not in v:
            state, ps = bench_pieces(state, ids[0], v, FLAGS.steps)
            for kind in ("dedup", "dupsum", "update"):
                record(kind, v, FLAGS.vocab, ps[kind], ids[:1])
            for key in [k for k in ps if k.startswith("fused ")]:
                record("fused", f"{v} {key[6:]}", FLAGS.vocab, ps[key], ids[:1])
    del state

    for vocab in ([] if n_dev > 1 else [int(x) for x in FLAGS.naive_rows if x]):
        ids_v, _ = batches_for(vocab)
        try:
            t = run_naive(vocab, [jnp.asarray(i) for i in ids_v], FLAGS.steps)
            record("naive", "take+dense grad+optax", vocab, t, ids_v)
            break
        except Exception as e:  # noqa: BLE001  (out of memory is a result here)
            record("naive", "take+dense grad+optax", vocab, None, None,
                   {"error": str(e).splitlines()[0][:200]})

    for vocab in [int(x) for x in FLAGS.probe_rows if x]:
        ids_v, feats_v = batches_for(vocab)
        try:
            coll = make_coll(vocab, mesh, "sort")
            st = table_init(coll.layouts["t"].padded_vocab, FLAGS.dim, coll.state_sharding())
            st, ts, over, finite = bench_variant(coll, st, feats_v, FLAGS.steps)
            del st
            record("probe", "sort", vocab, ts["step"], ids_v, {"finite": finite, "overflow": over})
        except Exception as e:  # noqa: BLE001
            record("probe", "sort", vocab, None, None, {"error": str(e).splitlines()[0][:200]})
            break

    results["rows"] = rows
    with open(FLAGS.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"\nbench_sparse: {n_dev} x {results['device']}, D={FLAGS.dim}, N={n} ids/step, "
          f"Zipf {FLAGS.zipf}, pooling {FLAGS.pooling}; %HBM of {FLAGS.hbm_tbps} TB/s x {n_dev}")
    print(f"{'kind':9s} {'variant':22s} {'dev':>3s} {'vocab':>11s} {'ms':>8s} {'uniq TB/s':>9s} "
          f"{'%HBM':>6s} {'per-id TB/s':>11s} {'%HBM':>6s}  note")
    for r in rows:
        head = f"{r['kind']:9s} {r['variant']:22s} {r['devices']:>3d} {r['vocab']:>11d}"
        if r["ms"] is None:
            print(f"{head} {'FAILED':>8s}  {r.get('error', '')[:70]}")
            continue
        bw = (f" {r['unique_TBps']:>9.2f} {100 * r['unique_frac_hbm']:>5.1f}% {r['per_id_TBps']:>11.2f} "
              f"{100 * r['per_id_frac_hbm']:>5.1f}%" if "unique_TBps" in r else " " * 36)
        note = []
        if "overflow" in r:
            note.append(f"overflow {r['overflow']}")
        if r.get("finite") is False:
            note.append("NON-FINITE")
        print(f"{head} {r['ms']:>8.3f}{bw}  {', '.join(note)}")


if __name__ == "__main__":
    app.run(main)
