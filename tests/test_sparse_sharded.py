"""Sharded lookups + sparse optimizer steps vs the independent numpy reference.

8 simulated CPU devices: a 1-D mesh of 8 and a 2 x 4 (replica, model) mesh.
Batches hold duplicate ids, empty bags, Jagged padding and (for the "user"
table) a capacity small enough to overflow.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from gemjax.data.jagged import Jagged, pack
from gemjax.sparse import SGD, Adagrad, EmbeddingCollection, LazyAdam, RowWiseAdagrad, TableSpec
from gemjax.sparse import plans as plans_lib
import test_sparse_reference as ref

B, T, STEPS = 4, 16, 2
USER_CAP = 0.5      # capacity factor of the "user" table: small enough to overflow


def mesh_of(shape, names):
    return Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), names)


def make_specs(opt, dtype=jnp.float32):
    return [
        TableSpec("user", 50, 8, features=("u1", "u2"), optimizer=opt, dtype=dtype),
        TableSpec("tags", 37, 8, features=("tags",), pooling="sum", optimizer=opt, dtype=dtype),
        TableSpec("hist", 61, 8, features=("hist",), pooling="mean", optimizer=opt, dtype=dtype),
    ]


def make_batch(rng, n_dev):
    """Per-device host feats and the global (concatenated) arrays."""
    dev = []
    for _ in range(n_dev):
        tag_len = rng.integers(0, 5, B)
        tag_len[0] = 0                                          # an empty bag on every device
        hist_len = rng.choice([0, 1, 2, 4], B)             # powers of two: exact means
        dev.append({
            "u1": rng.integers(0, 12, B),                       # few values: duplicates
            "u2": rng.integers(0, 50, (B, 3)),
            "tags": [rng.integers(0, 37, n) for n in tag_len],
            "hist": [rng.integers(0, 61, n) for n in hist_len],
        })
    return dev


def to_global(dev, mesh, axes):
    sh = NamedSharding(mesh, P(axes))
    put = lambda xs: jax.device_put(np.concatenate(xs), sh)
    out = {f: put([d[f].astype(np.int32) for d in dev]) for f in ("u1", "u2")}
    for f in ("tags", "hist"):
        js = [pack([s.astype(np.int32) for s in d[f]], capacity=T) for d in dev]
        out[f] = Jagged(put([j.values for j in js]), put([j.offsets for j in js]),
                        put([j.segment_ids for j in js]), put([j.positions for j in js]))
    return out


def ref_step(tables, dev, grads, plans, lays, specs, update):
    """One reference step: acts per device and the updated tables (float64)."""
    acts = [dict() for _ in dev]
    gsum = {n: np.zeros_like(t["weights"]) for n, t in tables.items()}
    touched = {n: set() for n in tables}
    over = 0
    for d, feats in enumerate(dev):
        for s in specs:
            p, lay = plans[s.name], lays[s.name]
            fs = sorted(f for f in s.features)
            n_ids = sum(feats[f].size if f in ("u1", "u2") else T for f in fs)
            flat = np.concatenate([feats[f].reshape(-1) if f in ("u1", "u2")
                                   else np.concatenate(feats[f] + [np.zeros(0, int)]) for f in fs])
            cap = ref.capacity(n_ids, lay.num_model, p.capacity_factor, p.min_capacity)
            fixed = p.shard if p.kind == "table_wise" else None
            kept = ref.kept_mask(flat, s.vocab, p.split, lay.num_model, lay.num_fs, cap, fixed)
            over += int((~kept).sum())
            w = tables[s.name]["weights"]
            start = 0
            for f in fs:
                g = grads[f][d]
                if f in ("u1", "u2"):
                    ids = feats[f].reshape(-1)
                    k = kept[start:start + ids.size]
                    start += ids.size
                    acts[d][f] = (w[ids] * k[:, None]).reshape(feats[f].shape + (s.dim,))
                    for i, kk, gg in zip(ids, k, g.reshape(-1, s.dim)):
                        if kk:
                            gsum[s.name][i] += gg
                            touched[s.name].add(int(i))
                else:
                    pooled = np.zeros((B, s.dim))
                    for b, ids in enumerate(feats[f]):
                        k = kept[start:start + ids.size]
                        start += ids.size
                        div = max(len(ids), 1) if s.pooling == "mean" else 1
                        pooled[b] = (w[ids] * k[:, None]).sum(0) / div
                        for i, kk in zip(ids, k):
                            if kk:
                                gsum[s.name][i] += g[b] / div
                                touched[s.name].add(int(i))
                    acts[d][f] = pooled
    new = {}
    for s in specs:
        rows = np.array(sorted(touched[s.name]), int)
        new[s.name] = ref.apply_update(tables[s.name], rows, gsum[s.name], update)
    return acts, new, over


def quantized(rng, shape, denom):
    """Values k / denom with small integers k: sums of them are exact in float32."""
    return rng.integers(-8, 9, shape).astype(np.float64) / denom


def run_case(mesh, plan, replica_axes, opt, update, *, exact, rng_seed=0, dtype=jnp.float32,
             batch_axes=None, **coll_kw):
    specs = make_specs(opt, dtype)
    axes = tuple(mesh.axis_names if batch_axes is None else batch_axes)
    plans = plans_lib.resolve(plan, specs, mesh, replica_axes)
    plans = {n: dataclasses.replace(p, min_capacity=1) for n, p in plans.items()}
    plans["user"] = dataclasses.replace(plans["user"], capacity_factor=USER_CAP)
    coll = EmbeddingCollection(specs, plans, mesh, replica_axes=replica_axes, batch_axes=axes,
                               **coll_kw)
    rng = np.random.default_rng(rng_seed)
    n_dev = int(np.prod([mesh.shape[a] for a in axes]))
    tables = {}
    for s in specs:
        t = {"weights": quantized(rng, (s.vocab, s.dim), 64.0)}
        t.update({k: np.zeros(np.shape(v)[:0] + (s.vocab,) + np.shape(v)[1:], np.float64)
                  for k, v in s.optimizer.init_state(1, s.dim).items()})
        tables[s.name] = t
    state = coll.from_logical(tables)
    lookup = jax.jit(coll.lookup)
    apply = jax.jit(coll.apply_gradients, donate_argnums=0)
    lays = coll.layouts
    for step in range(STEPS):
        dev = make_batch(rng, n_dev)
        feats = to_global(dev, mesh, axes)
        coll.check_ids(feats)
        if step == 0:    # junk on padding tokens is ignored by the per-shard check; real ids are not
            real = np.asarray(feats["hist"].segment_ids) < B          # local sentinel is B
            assert not real.all()
            junk = np.where(real, np.asarray(feats["hist"].values), 999)
            coll.check_ids({"hist": feats["hist"].replace(values=junk)})
            bad = np.asarray(feats["hist"].values).copy()
            bad[T * (n_dev - 1)] = -1          # first token of the last device's (non-empty) buffer
            if np.asarray(feats["hist"].offsets)[-1] > 0:
                with pytest.raises(ValueError, match="feature 'hist'"):
                    coll.check_ids({"hist": feats["hist"].replace(values=bad)})
        acts, res = lookup(state, feats)
        grads = {f: [quantized(rng, (B,) + acts[f].shape[1:], 8.0) for _ in range(n_dev)]
                 for f in acts}
        ref_acts, tables, over = ref_step(tables, dev, grads, plans, lays, specs, update)
        if dtype == jnp.bfloat16:      # storage rounds each update once (float32 math is exact here)
            for t in tables.values():
                t["weights"] = t["weights"].astype(ml_dtypes.bfloat16).astype(np.float64)
        for f in acts:
            got = np.asarray(acts[f], np.float64)
            want = np.concatenate([ra[f] for ra in ref_acts])
            if exact:
                np.testing.assert_array_equal(got, want, err_msg=f"acts {f} step {step}")
            else:
                np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7, err_msg=f"acts {f}")
        assert int(res["stats"]["ids_overflow"]) == over
        assert int(res["stats"]["ids_out_of_range"]) == 0
        g_acts = {f: jax.device_put(np.concatenate(grads[f]).astype(np.float32),
                                    NamedSharding(mesh, P(axes))) for f in acts}
        state = apply(state, res, g_acts)
    got = coll.to_logical(state)
    for n, t in tables.items():
        for k, v in t.items():
            if exact:
                np.testing.assert_array_equal(got[n][k].astype(np.float64), v, err_msg=f"{n}.{k}")
            else:
                np.testing.assert_allclose(got[n][k].astype(np.float64), v, rtol=1e-6, atol=1e-7,
                                           err_msg=f"{n}.{k}")
    return coll, state, over


SGD_EXACT = (SGD(lr=0.5), functools.partial(ref.sgd, lr=0.5))


def check_memory_matches_plan(coll, state, mesh):
    """Bytes each device holds per table (weights + optimizer state) = the plan's prediction.

    A table_wise stack holds, per device, its largest device block of whole tables.
    """
    for u, ts in coll.units.items():
        held = sum(max(sh.data.nbytes for sh in a.addressable_shards) for a in state[u].values())
        p, s = coll.plans[ts[0]], coll.specs[ts[0]]
        if p.kind == "table_wise":
            per_dev = {}
            for t in ts:
                per_dev[coll.plans[t].shard] = per_dev.get(coll.plans[t].shard, 0) + \
                    plans_lib.bytes_per_device(coll.specs[t], coll.plans[t], mesh)
            assert held == max(per_dev.values()), u
        else:
            assert held == plans_lib.bytes_per_device(s, p, mesh), u
        assert all(a.sharding.spec == P(p.storage_axes or None) for a in state[u].values())


@pytest.mark.parametrize("plan", ["replicated", "row_wise_range", "table_wise"])
def test_1d_mesh_sgd_exact(plan):
    mesh = mesh_of((8,), ("x",))
    coll, state, over = run_case(mesh, plan, (), *SGD_EXACT, exact=True)
    check_memory_matches_plan(coll, state, mesh)
    if plan == "table_wise":       # three tables, each whole on its own device, one stack
        assert list(coll.units) == ["@table_wise_0"]
        assert sorted(p.shard for p in coll.plans.values()) == sorted({p.shard for p in coll.plans.values()})
    if plan != "replicated":
        assert over > 0, "the batch was meant to overflow the user table's capacity"


@pytest.mark.parametrize("plan", ["row_wise", "2d", "2d_range", "fs2d", "fs2d_range"])
def test_2x4_mesh_sgd_exact(plan):
    mesh = mesh_of((2, 4), ("replica", "model"))
    coll, state, over = run_case(mesh, plan, ("replica",), *SGD_EXACT, exact=True)
    assert over > 0
    check_memory_matches_plan(coll, state, mesh)
    if plan.startswith("2d"):     # the two replicas of each model shard hold identical rows
        for n in coll.specs:
            for a in state[n].values():
                copies = {}
                for sh in a.addressable_shards:
                    copies.setdefault(sh.index[0].start or 0, []).append(np.asarray(sh.data))
                assert len(copies) == 4
                for c in copies.values():
                    assert len(c) == 2 and np.array_equal(c[0], c[1])


def test_bf16_tables_fs2d_exact():
    mesh = mesh_of((2, 4), ("replica", "model"))
    coll, state, _ = run_case(mesh, "fs2d", ("replica",), *SGD_EXACT, exact=True, dtype=jnp.bfloat16)
    assert state["user"]["weights"].dtype == jnp.bfloat16
    check_memory_matches_plan(coll, state, mesh)


def test_batch_copies_along_a_non_batch_axis_count_once():
    """Batch sharded over "replica" only: the 4 "model" devices of a row see the same ids."""
    mesh = mesh_of((2, 4), ("replica", "model"))
    run_case(mesh, "row_wise", (), *SGD_EXACT, exact=True, batch_axes=("replica",))


# (plan, optimizer, numpy reference update): also run on real GPUs by tests/test_sparse_gpu.py
OPTIMIZER_CASES = [
    ("row_wise_mod", RowWiseAdagrad(lr=0.1, eps=1e-6),
     functools.partial(ref.rowwise_adagrad, lr=0.1, eps=1e-6)),
    ("fs2d", Adagrad(lr=0.1, eps=1e-6), functools.partial(ref.adagrad, lr=0.1, eps=1e-6)),
    ("2d", LazyAdam(lr=0.01), functools.partial(ref.lazy_adam, lr=0.01, b1=0.9, b2=0.999, eps=1e-8)),
]


@pytest.mark.parametrize("plan,opt,update", OPTIMIZER_CASES)
def test_optimizers_match_reference(plan, opt, update):
    mesh = mesh_of((2, 4), ("replica", "model"))
    run_case(mesh, plan, ("replica",), opt, update, exact=False)


@pytest.mark.parametrize("dedup,buckets", [("sort", ()), ("sort_scatter", ()), ("scatter", ()),
                                            ("sort", (0.1, 0.3, 0.6)), ("sort_scatter", (0.1, 0.3, 0.6))])
def test_one_device_local_path(dedup, buckets):
    """One device: the local path (no all_to_all; rows unique after the forward's dedupe)."""
    mesh = mesh_of((1,), ("x",))
    coll, _, _ = run_case(mesh, "row_wise", (), RowWiseAdagrad(lr=0.1, eps=1e-6),
                          functools.partial(ref.rowwise_adagrad, lr=0.1, eps=1e-6), exact=False,
                          dedup=dedup, unique_buckets=buckets)
    assert coll.dedup == dedup


@pytest.mark.parametrize("plan,shape", [("row_wise_range", (8,)), ("fs2d", (2, 4)), ("2d", (2, 4))])
def test_scatter_dedup_still_exact(plan, shape):
    """The original unsorted scatter-add path stays selectable and exact."""
    mesh = mesh_of(shape, ("x",) if len(shape) == 1 else ("replica", "model"))
    run_case(mesh, plan, () if len(shape) == 1 else ("replica",), *SGD_EXACT, exact=True,
             dedup="scatter")


def test_unique_buckets_at_the_owner_exact():
    """dedup="sort" + buckets on a sharded table: the owner's update runs bucketed. (They
    are the collection's defaults, so test_2x4_mesh_sgd_exact runs them on the 2d and
    fs2d plans; this is the range-split row_wise owner on the 2 x 4 mesh.)"""
    from gemjax.sparse import routing
    mesh = mesh_of((2, 4), ("replica", "model"))
    coll, _, _ = run_case(mesh, "row_wise_range", ("replica",), *SGD_EXACT, exact=True,
                          dedup="sort", unique_buckets=routing.DEFAULT_BUCKETS)
    default = EmbeddingCollection(make_specs(SGD()))
    assert (default.dedup, default.unique_buckets) == (coll.dedup, coll.unique_buckets)


def test_bf16_grads_exact_on_bf16_values():
    """grad_dtype=bfloat16: quantized grads (k/8, |k| <= 8) are bf16-exact, so SGD stays exact."""
    mesh = mesh_of((2, 4), ("replica", "model"))
    run_case(mesh, "fs2d", ("replica",), *SGD_EXACT, exact=True, grad_dtype=jnp.bfloat16)


def test_bad_dedup_and_grad_dtype_are_named():
    specs = make_specs(SGD())
    with pytest.raises(ValueError, match="dedup"):
        EmbeddingCollection(specs, dedup="hash")
    with pytest.raises(ValueError, match="grad_dtype"):
        EmbeddingCollection(specs, grad_dtype=jnp.float16)
    with pytest.raises(ValueError, match="unique_buckets"):
        EmbeddingCollection(specs, unique_buckets=(0.5, 1.5))


def _eqns(jaxpr):
    """Every equation of a jaxpr and of the jaxprs inside it (shard_map, pjit, cond...)."""
    for e in jaxpr.eqns:
        yield e
        for v in e.params.values():
            for sub in (v if isinstance(v, (list, tuple)) else [v]):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _eqns(inner)


@pytest.mark.parametrize("shape,names,plan", [((1,), ("data",), "row_wise"),
                                              ((1,), ("replica",), "replicated"),
                                              ((8,), ("replica",), "replicated"),
                                              ((2, 4), ("replica", "model"), "fs2d")])
def test_bf16_activation_grads_stay_bf16_with_the_same_update(shape, names, plan):
    """A bf16 model's per-id grads stay bf16 where the device sums its own rows (a local or
    a replicated table: no float32 copy of the [N, D] rows; exchanged ones travel in
    grad_dtype as before): the float32 duplicate sums widen them exactly, so the update
    equals the one from the same values given as float32."""
    mesh = mesh_of(shape, names)
    specs = make_specs(Adagrad(lr=0.1))
    replica = ("replica",) if "replica" in names else ()
    plans = {n: dataclasses.replace(p, min_capacity=1)
             for n, p in plans_lib.resolve(plan, specs, mesh, replica).items()}
    coll = EmbeddingCollection(specs, plans, mesh, replica_axes=replica, batch_axes=names)
    rng = np.random.default_rng(3)
    tables = {s.name: {"weights": rng.normal(size=(s.vocab, s.dim)),
                       **{k: np.zeros((s.vocab,) + np.shape(v)[1:])
                          for k, v in s.optimizer.init_state(1, s.dim).items()}} for s in specs}
    n_dev = int(np.prod(shape))
    feats = to_global(make_batch(rng, n_dev), mesh, names)
    acts, res = jax.jit(coll.lookup)(coll.from_logical(tables), feats)
    g16 = {f: jnp.asarray(rng.normal(size=a.shape), jnp.bfloat16) for f, a in acts.items()}
    g32 = {f: g.astype(jnp.float32) for f, g in g16.items()}
    apply = jax.jit(coll.apply_gradients)
    new16 = apply(coll.from_logical(tables), res, g16)
    new32 = apply(coll.from_logical(tables), res, g32)
    for a, b in zip(jax.tree.leaves(new16), jax.tree.leaves(new32)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    jaxpr = jax.make_jaxpr(coll.apply_gradients)(coll.from_logical(tables), res, g16)
    # the "user" table's unpooled ids (u1 [B], u2 [B, 3] per device) plus the zero row: its
    # rows are gathered in bf16; pooled bags (tags, hist) are float32 sources by design
    n_user = B * 4 + 1                     # per device: the batch is split over every device
    rows = {(e.outvars[0].aval.shape[0], e.outvars[0].aval.dtype)
            for e in _eqns(jaxpr.jaxpr) if e.primitive.name == "concatenate"
            and e.outvars[0].aval.ndim == 2}
    owned = len(shape) == 1
    want, other = (jnp.bfloat16, jnp.float32) if owned else (jnp.float32, jnp.bfloat16)
    assert (n_user, jnp.dtype(want)) in rows and (n_user, jnp.dtype(other)) not in rows, rows


@pytest.mark.parametrize("shape,names,plan", [((1,), ("data",), "row_wise"),
                                              ((2, 4), ("replica", "model"), "fs2d")])
def test_act_dtype_rounds_unpooled_rows_and_keeps_pooled_sums(shape, names, plan):
    """act_dtype=bfloat16: unpooled rows come back as the float32 rows rounded to bfloat16,
    pooled bags as the same float32 sums; their gradients flow back in bfloat16."""
    mesh = mesh_of(shape, names)
    specs = make_specs(Adagrad(lr=0.1))
    replica = ("replica",) if "replica" in names else ()
    plans = {n: dataclasses.replace(p, min_capacity=1)
             for n, p in plans_lib.resolve(plan, specs, mesh, replica).items()}
    colls = [EmbeddingCollection(specs, plans, mesh, replica_axes=replica, batch_axes=names,
                                 act_dtype=dt) for dt in (None, "bfloat16")]
    rng = np.random.default_rng(5)
    tables = {s.name: {"weights": rng.normal(size=(s.vocab, s.dim)),
                       **{k: np.zeros((s.vocab,) + np.shape(v)[1:])
                          for k, v in s.optimizer.init_state(1, s.dim).items()}} for s in specs}
    feats = to_global(make_batch(rng, int(np.prod(shape))), mesh, names)
    (a32, _), (a16, res16) = [jax.jit(c.lookup)(c.from_logical(tables), feats) for c in colls]
    assert set(a32) == set(a16)
    for f in a32:
        pooled = f in ("tags", "hist")
        assert a16[f].dtype == (jnp.float32 if pooled else jnp.bfloat16), (f, a16[f].dtype)
        want = np.asarray(a32[f]) if pooled else np.asarray(a32[f].astype(jnp.bfloat16))
        np.testing.assert_array_equal(np.asarray(a16[f]), want)
    g = jax.grad(lambda a: sum(jnp.sum(v.astype(jnp.float32) ** 2) for v in a.values()))(a16)
    assert {f: g[f].dtype for f in g} == {f: a16[f].dtype for f in a16}
    new = jax.jit(colls[1].apply_gradients)(colls[1].from_logical(tables), res16, g)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(new))


def test_bad_act_dtype_is_named():
    for bad in ("int32", "float33"):
        with pytest.raises(ValueError, match="act_dtype"):
            EmbeddingCollection(make_specs(SGD()), act_dtype=bad)


def test_replicas_of_one_device_update_as_a_local_table():
    """A replicated table whose replica axis has one device keeps nothing in sync: it takes
    the local update (the unique-count buckets, no all-gather), bit-equal to a local plan's."""
    specs = make_specs(Adagrad(lr=0.1))
    rng = np.random.default_rng(7)
    tables = {s.name: {"weights": rng.normal(size=(s.vocab, s.dim)),
                       **{k: np.zeros((s.vocab,) + np.shape(v)[1:])
                          for k, v in s.optimizer.init_state(1, s.dim).items()}} for s in specs}
    dev = make_batch(rng, 1)
    out, progs = [], []
    for names, plan, replica in ((("data",), "row_wise", ()),
                                 (("replica",), "replicated", ("replica",))):
        mesh = mesh_of((1,), names)
        plans = {n: dataclasses.replace(p, min_capacity=1)
                 for n, p in plans_lib.resolve(plan, specs, mesh, replica).items()}
        coll = EmbeddingCollection(specs, plans, mesh, replica_axes=replica, batch_axes=names)
        assert [plans_lib.table_axes(p, mesh)[2] for p in plans.values()] == [()] * 3
        feats = to_global(dev, mesh, names)
        acts, res = jax.jit(coll.lookup)(coll.from_logical(tables), feats)
        g = {f: jnp.asarray(np.random.default_rng(1).normal(size=a.shape), a.dtype)
             for f, a in acts.items()}
        out.append(coll.to_logical(jax.jit(coll.apply_gradients)(coll.from_logical(tables), res, g)))
        prims = [e.primitive.name for e in _eqns(
            jax.make_jaxpr(coll.apply_gradients)(coll.from_logical(tables), res, g).jaxpr)]
        progs.append((prims.count("all_gather"), prims.count("cond")))
    for a, b in zip(jax.tree.leaves(out[0]), jax.tree.leaves(out[1])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert progs[0] == progs[1] and progs[0][0] == 0 and progs[0][1] > 0, progs
