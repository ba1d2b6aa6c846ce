"""Sparse embedding step on one GPU: routed lookup + fused row-wise Adagrad vs naive JAX.

    PYTHONPATH=. XLA_PYTHON_CLIENT_MEM_FRACTION=.97 python3 experiments/bench_sparse.py \
        --vocab=100000000 --dim=128 --batch=65536 --ids_per_sample=20 --out=$OUT/bench_sparse.json

Rows:
  gemjax     EmbeddingCollection lookup + apply_gradients (row-wise Adagrad), state donated
  lookup     the lookup alone
  naive      jnp.take + jax.grad w.r.t. the whole table + optax.adagrad (dense [V, D] grad)
  probe      gemjax at growing vocab sizes: the largest that trains (--probe_rows)

Ids: Zipf(--zipf) over [0, vocab) (truncated by resampling), scattered over the
table by a multiplicative hash. Effective bandwidth counts, per step,
  table bytes  = U*D*4 (gather) + 2 * U*(D*4 + 4) (read + write rows and accumulators)
  all bytes    = table bytes + activations written + activation grads read
with U the unique ids of the batch, over the measured step time, against the
3.6 TB/s HBM copy rate measured on the H200.
"""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from gemjax.data.jagged import Jagged
from gemjax.sparse import EmbeddingCollection, RowWiseAdagrad, TableSpec

FLAGS = flags.FLAGS
flags.DEFINE_integer("vocab", 100_000_000, "rows of the table")
flags.DEFINE_integer("dim", 128, "embedding width")
flags.DEFINE_integer("batch", 65_536, "samples per step")
flags.DEFINE_integer("ids_per_sample", 20, "ids per sample (one bag each)")
flags.DEFINE_float("zipf", 1.05, "Zipf exponent of id popularity")
flags.DEFINE_integer("steps", 10, "timed steps")
flags.DEFINE_string("pooling", "sum", "'sum' (bags pooled to [B, D]) or 'none' ([B, L, D])")
flags.DEFINE_list("naive_rows", ["100000000", "50000000", "25000000"], "vocab sizes for the naive path")
flags.DEFINE_list("probe_rows", ["200000000", "240000000", "260000000"], "vocab sizes to probe")
flags.DEFINE_float("hbm_tbps", 3.6, "reference HBM bandwidth, TB/s")
flags.DEFINE_string("out", "bench_sparse.json", "JSON output path")


def zipf_ids(rng, n, vocab, a):
    """n ids, Zipf(a) ranks truncated to [1, vocab] by resampling, hashed over [0, vocab)."""
    out = np.empty(0, np.int64)
    while out.size < n:
        z = rng.zipf(a, 2 * n)
        out = np.concatenate([out, z[z <= vocab]])
    ranks = out[:n] - 1
    return ((ranks * 2654435761) % vocab).astype(np.int32)


def table_init(vocab, dim):
    """A fused elementwise init (no random-bit buffer, so huge tables fit)."""
    def make():
        r = jax.lax.broadcasted_iota(jnp.uint32, (vocab, dim), 0)
        c = jax.lax.broadcasted_iota(jnp.uint32, (vocab, dim), 1)
        h = (r * jnp.uint32(2654435761) + c * jnp.uint32(40503)) >> 16
        w = (h.astype(jnp.float32) / 65536.0 - 0.5) * (2.0 / np.sqrt(dim))
        return {"t": {"weights": w, "accum": jnp.zeros((vocab,), jnp.float32)}}
    return jax.jit(make)()


def make_feats(ids, batch, per):
    if FLAGS.pooling == "none":
        return {"f": jnp.asarray(ids.reshape(batch, per))}
    t = batch * per
    offsets = np.arange(batch + 1, dtype=np.int32) * per
    seg = np.repeat(np.arange(batch, dtype=np.int32), per)
    pos = np.tile(np.arange(per, dtype=np.int32), batch)
    return {"f": Jagged(jnp.asarray(ids), jnp.asarray(offsets), jnp.asarray(seg), jnp.asarray(pos))}


def timed(fn, args_fn, steps):
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


def run_gemjax(vocab, batches, lookup_only=False, apply_only=False):
    pooling = None if FLAGS.pooling == "none" else FLAGS.pooling
    spec = TableSpec("t", vocab, FLAGS.dim, features=("f",), pooling=pooling,
                     optimizer=RowWiseAdagrad(lr=0.01), bounds="clamp")
    coll = EmbeddingCollection([spec])
    state = [table_init(vocab, FLAGS.dim)]

    def step(state, feats):
        acts, res = coll.lookup(state, feats)
        g_acts = {f: a * 1e-3 for f, a in acts.items()}
        return coll.apply_gradients(state, res, g_acts), res["stats"]["ids_overflow"]

    lookup = jax.jit(lambda s, f: coll.lookup(s, f)[0])
    step = jax.jit(step, donate_argnums=0)
    i = [0]

    def args():
        i[0] += 1
        return state[0], batches[i[0] % len(batches)]

    if lookup_only:
        _, t = timed(lookup, args, FLAGS.steps)
        return t
    if apply_only:   # residuals and grads fixed, state donated and fed back
        feats = batches[0]
        acts, res = jax.jit(coll.lookup)(state[0], feats)
        g = {f: a * 1e-3 for f, a in acts.items()}
        apply = jax.jit(coll.apply_gradients, donate_argnums=0)
        state[0] = apply(state[0], res, g)
        jax.block_until_ready(state[0])
        ts = []
        for _ in range(FLAGS.steps):
            t0 = time.perf_counter()
            state[0] = apply(state[0], res, g)
            jax.block_until_ready(state[0])
            ts.append(time.perf_counter() - t0)
        del state[0]
        return float(np.median(ts))
    t0 = time.perf_counter()
    state[0], over = step(*args())
    jax.block_until_ready(state[0])
    compile_s = time.perf_counter() - t0
    ts = []
    for _ in range(FLAGS.steps):
        a = args()
        t0 = time.perf_counter()
        state[0], over = step(*a)
        jax.block_until_ready(state[0])
        ts.append(time.perf_counter() - t0)
    w = state[0]["t"]["weights"]
    finite = bool(jnp.isfinite(w[:1000]).all())
    del state[0], w
    return float(np.median(ts)), compile_s, int(over), finite


def run_naive(vocab, ids_list):
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
    for k in range(FLAGS.steps):
        t0 = time.perf_counter()
        w, opt_state = step(w, opt_state, ids_list[k % len(ids_list)])
        jax.block_until_ready(w)
        ts.append(time.perf_counter() - t0)
    del w, opt_state
    return float(np.median(ts))


def bytes_model(ids_list, dim, lookup_only=False):
    """Bytes moved per step: (unique ids U, table bytes, table + activation bytes, per-id bytes).

    table:  U*D*4 gathered (+ 2*U*(D*4+4) rows and accumulators read and written by the update)
    acts:   activations written (+ their grads read by the update)
    per-id: every id's row counted, as FBGEMM's TBE benchmark does: N*D*4 gathered
            (+ 2*N*(D*4+4) updated) plus the activations
    """
    u = float(np.mean([np.unique(i).size for i in ids_list]))
    n = ids_list[0].size
    acts = (n if FLAGS.pooling == "none" else FLAGS.batch) * dim * 4
    if lookup_only:
        return u, u * dim * 4, u * dim * 4 + acts, n * dim * 4 + acts
    table = u * dim * 4 + 2 * u * (dim * 4 + 4)
    return u, table, table + 2 * acts, n * dim * 4 + 2 * n * (dim * 4 + 4) + 2 * acts


def main(_):
    rng = np.random.default_rng(0)
    n = FLAGS.batch * FLAGS.ids_per_sample
    results, rows = {"device": str(jax.devices()[0]), "flags": FLAGS.flag_values_dict()}, []

    def batches_for(vocab):
        ids = [zipf_ids(rng, n, vocab, FLAGS.zipf) for _ in range(3)]
        return ids, [make_feats(i, FLAGS.batch, FLAGS.ids_per_sample) for i in ids]

    def record(name, vocab, t, ids, extra=None):
        u, tb, ab, pb = bytes_model(ids, FLAGS.dim, lookup_only="lookup" in name)
        r = {"name": name, "vocab": vocab, "params": vocab * FLAGS.dim, "step_ms": t * 1e3,
             "unique_ids": u, "table_TBps": tb / t / 1e12, "all_TBps": ab / t / 1e12,
             "per_id_TBps": pb / t / 1e12,
             "table_frac_hbm": tb / t / 1e12 / FLAGS.hbm_tbps, "all_frac_hbm": ab / t / 1e12 / FLAGS.hbm_tbps,
             **(extra or {})}
        rows.append(r)
        print(json.dumps(r), flush=True)

    ids, feats = batches_for(FLAGS.vocab)
    t, comp, over, finite = run_gemjax(FLAGS.vocab, feats)
    record("gemjax step", FLAGS.vocab, t, ids, {"compile_s": comp, "overflow": over, "finite": finite})
    record("gemjax lookup only", FLAGS.vocab, run_gemjax(FLAGS.vocab, feats, lookup_only=True), ids)

    t = run_gemjax(FLAGS.vocab, feats, apply_only=True)
    rows.append({"name": "gemjax apply_gradients only", "vocab": FLAGS.vocab, "step_ms": t * 1e3})
    print(json.dumps(rows[-1]), flush=True)
    flat = jnp.asarray(ids[0])
    w = jnp.zeros((FLAGS.vocab, FLAGS.dim), jnp.float32)
    g = jnp.ones((flat.size, FLAGS.dim), jnp.float32)
    parts = {
        "part: jnp.unique(N ids, size=N, inverse)":
            (jax.jit(lambda i: jnp.unique(i, size=i.size, fill_value=2**31 - 1, return_inverse=True)), (flat,)),
        "part: gather N rows": (jax.jit(lambda w, i: jnp.take(w, i, axis=0)), (w, flat)),
        "part: segment_sum [N, D] by inverse": (jax.jit(lambda g, i: jax.ops.segment_sum(g, i, g.shape[0])),
                                                (g, jnp.asarray(np.unique(ids[0], return_inverse=True)[1].astype(np.int32)))),
    }
    for name, (fn, a) in parts.items():
        _, t = timed(fn, lambda: a, FLAGS.steps)
        rows.append({"name": name, "vocab": FLAGS.vocab, "step_ms": t * 1e3})
        print(json.dumps(rows[-1]), flush=True)
    del w, g, parts   # free the 51 GB zero table before the naive path and the probe

    naive_done = False
    for v in map(int, FLAGS.naive_rows):
        if naive_done:
            break
        ids_v, feats_v = batches_for(v)
        try:
            t = run_naive(v, [jnp.asarray(i) for i in ids_v])
            record("naive take+dense grad+optax adagrad", v, t, ids_v)
            naive_done = True
            if v != FLAGS.vocab:
                t, comp, over, finite = run_gemjax(v, feats_v)
                record("gemjax step (naive's size)", v, t, ids_v, {"overflow": over})
        except Exception as e:  # noqa: BLE001  (out of memory is a result here)
            msg = str(e).splitlines()[0][:200]
            rows.append({"name": "naive take+dense grad+optax adagrad", "vocab": v, "error": msg})
            print(json.dumps(rows[-1]), flush=True)

    for v in map(int, FLAGS.probe_rows):
        ids_v, feats_v = batches_for(v)
        try:
            t, comp, over, finite = run_gemjax(v, feats_v)
            record("probe gemjax step", v, t, ids_v, {"finite": finite})
        except Exception as e:  # noqa: BLE001
            rows.append({"name": "probe gemjax step", "vocab": v, "error": str(e).splitlines()[0][:200]})
            print(json.dumps(rows[-1]), flush=True)
            break

    results["rows"] = rows
    with open(FLAGS.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"\n{'what':40s} {'vocab':>11s} {'params':>9s} {'step ms':>8s} {'table TB/s':>10s} "
          f"{'all TB/s':>8s} {'%HBM(all)':>9s} {'per-id TB/s':>11s} {'%HBM(per-id)':>12s}")
    for r in rows:
        if "table_TBps" not in r and "error" not in r:
            print(f"{r['name']:40s} {r['vocab']:>11d} {'':>9s} {r['step_ms']:>8.2f}")
        elif "error" in r:
            print(f"{r['name']:40s} {r['vocab']:>11d} {r['vocab'] * FLAGS.dim / 1e9:>8.1f}B  FAILED: {r['error'][:60]}")
        else:
            print(f"{r['name']:40s} {r['vocab']:>11d} {r['params'] / 1e9:>8.1f}B {r['step_ms']:>8.2f} "
                  f"{r['table_TBps']:>10.2f} {r['all_TBps']:>8.2f} {100 * r['all_frac_hbm']:>8.1f}% "
                  f"{r['per_id_TBps']:>11.2f} {100 * r['per_id_TBps'] / FLAGS.hbm_tbps:>11.1f}%")


if __name__ == "__main__":
    app.run(main)
