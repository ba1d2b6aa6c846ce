"""Exchange capacity buckets (EmbeddingCollection(exchange_buckets=...)) vs the static-C path.

Same state, same batches (duplicate ids, empty bags, Jagged padding, a "user"
table small enough to overflow): lookups, stats and updated tables must be
bit-identical to exchange_buckets=() on every plan, on 8 devices and a 2 x 4
mesh, and the chosen branch must follow the largest per-destination unique
count (recomputed here in numpy). The float64 reference check of the bucketed
default lives in tests/test_sparse_sharded.py (buckets are on by default).
"""

from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from gemjax.sparse import SGD, EmbeddingCollection, routing
from gemjax.sparse import plans as plans_lib
import test_sparse_reference as ref
import test_sparse_sharded as tss

BUCKETS = (0.125, 0.25, 0.5)


def make_pair(mesh, plan, replica_axes, unique_buckets=(), tables=None):
    """(bucketed, unbucketed) collections with test_sparse_sharded's specs and capacities.

    unique_buckets=() by default: one update branch per exchange branch (compile time);
    the nesting with the owner's unique buckets is run by one case here and by every
    test in test_sparse_sharded.py (the collection's defaults there).
    """
    specs = [s for s in tss.make_specs(SGD(lr=0.5)) if tables is None or s.name in tables]
    plans = plans_lib.resolve(plan, specs, mesh, replica_axes)
    plans = {n: dataclasses.replace(p, min_capacity=1) for n, p in plans.items()}
    if "user" in plans:
        plans["user"] = dataclasses.replace(plans["user"], capacity_factor=tss.USER_CAP)
    return [EmbeddingCollection(specs, plans, mesh, replica_axes=replica_axes, exchange_buckets=b,
                                unique_buckets=unique_buckets) for b in (BUCKETS, ())]


def expected_branch(coll, name, dev, cap):
    """numpy: index of the smallest exchange capacity >= max over devices and owners of
    the unique valid ids a device sends to one owner."""
    s, p, lay = coll.specs[name], coll.plans[name], coll.layouts[name]
    need = 0
    for feats in dev:
        flat = np.concatenate([feats[f].reshape(-1) if f in ("u1", "u2")
                               else np.concatenate(feats[f] + [np.zeros(0, int)])
                               for f in sorted(s.features)])
        uniq = np.unique(flat)
        if p.kind == "table_wise":
            owner = np.full(uniq.shape, p.shard)
        else:
            owner = ref.owner(uniq, s.vocab, p.split, lay.num_model, lay.num_fs)
        need = max(need, int(np.bincount(owner, minlength=lay.num_model).max(initial=0)))
    caps = routing.exchange_caps(cap, BUCKETS)
    return min(int(np.searchsorted(caps, need)), len(caps) - 1)


def narrowed(dev, k, stride):
    """Every id i -> (i % k) * stride: heavy duplication, few unique ids per destination."""
    return [{f: (v % k * stride if isinstance(v, np.ndarray) else [x % k * stride for x in v])
             for f, v in d.items()} for d in dev]


def run_pair(mesh, plan, replica_axes, steps=2, seed=0, narrow=(), unique_buckets=()):
    """Both collections side by side; returns {table: (branch, full-C branch)} per step."""
    coll, coll0 = make_pair(mesh, plan, replica_axes, unique_buckets)
    axes = tuple(mesh.axis_names)
    rng = np.random.default_rng(seed)
    tables = {s.name: {"weights": tss.quantized(rng, (s.vocab, s.dim), 64.0)}
              for s in coll.specs.values()}
    state, state0 = coll.from_logical(tables), coll0.from_logical(tables)
    fns = [(jax.jit(c.lookup), jax.jit(c.apply_gradients, donate_argnums=0)) for c in (coll, coll0)]
    branches = []
    for step in range(steps):
        dev = tss.make_batch(rng, mesh.size)
        if narrow:
            dev = narrowed(dev, *narrow)
        feats = tss.to_global(dev, mesh, axes)
        (acts, res), (acts0, res0) = fns[0][0](state, feats), fns[1][0](state0, feats)
        for f in acts0:
            np.testing.assert_array_equal(np.asarray(acts[f]), np.asarray(acts0[f]), err_msg=f)
        for k in res0["stats"]:
            assert int(res["stats"][k]) == int(res0["stats"][k]), k
        caps = coll._capacities(feats, coll._groups(feats))
        got = {}
        for n, r in res["route"].items():
            if "xb" not in r:
                assert coll.layouts[n].num_model == 1 and coll.layouts[n].num_fs == 1, n
                continue
            xb = np.asarray(r["xb"])
            assert (xb == xb[0]).all(), f"devices of table {n} picked different branches {xb}"
            assert int(xb[0]) == expected_branch(coll, n, dev, caps[n]), n
            assert r["recv"].shape == res0["route"][n]["recv"].shape
            got[n] = (int(xb[0]), len(routing.exchange_caps(caps[n], BUCKETS)) - 1)
        branches.append(got)
        g = {f: jax.device_put(tss.quantized(rng, acts[f].shape, 8.0).astype(np.float32),
                               NamedSharding(mesh, P(axes))) for f in acts}
        state, state0 = fns[0][1](state, res, g), fns[1][1](state0, res0, g)
    got, want = coll.to_logical(state), coll0.to_logical(state0)
    for n in want:
        for k in want[n]:
            np.testing.assert_array_equal(got[n][k], want[n][k], err_msg=f"{n}.{k}")
    return coll, branches


@pytest.mark.parametrize("shape,plan,unique_buckets", [
    ((8,), "row_wise", ()), ((8,), "table_wise", ()), ((8,), "replicated", ()),
    ((2, 4), "row_wise_range", ()), ((2, 4), "2d", ()), ((2, 4), "fs2d", routing.DEFAULT_BUCKETS)])
def test_same_as_static_capacity(shape, plan, unique_buckets):
    names = ("x",) if len(shape) == 1 else ("replica", "model")
    mesh = tss.mesh_of(shape, names)
    replica_axes = () if len(shape) == 1 else ("replica",)
    coll, branches = run_pair(mesh, plan, replica_axes, unique_buckets=unique_buckets)
    if plan == "replicated":
        assert branches == [{}, {}]
        return
    # the overflowing "user" table needs the full C; some table exchanges at a smaller one
    assert all(b["user"][0] == b["user"][1] for b in branches), branches
    assert any(x < full for b in branches for x, full in b.values()), branches


@pytest.mark.parametrize("shape,plan,narrow,unique_buckets", [
    ((8,), "row_wise", (8, 1), ()), ((2, 4), "fs2d", (4, 2), routing.DEFAULT_BUCKETS)])
def test_heavy_duplicates_take_the_smallest_bucket(shape, plan, narrow, unique_buckets):
    """At most one unique id per destination (mod split: owner = i % 8, fs2d: (i % 8) // 2)."""
    names = ("x",) if len(shape) == 1 else ("replica", "model")
    _, branches = run_pair(tss.mesh_of(shape, names), plan, () if len(shape) == 1 else ("replica",),
                           steps=1, narrow=narrow, unique_buckets=unique_buckets)
    assert all(x == 0 for b in branches for x, _ in b.values()), branches
    assert any(full > 0 for b in branches for _, full in b.values()), branches


def all_to_all_caps(hlo: str) -> tuple[set[int], set[int]]:
    """Per-destination capacities of the compiled all_to_alls: (int32 ids [1, c], f32 rows [1, c, 8])."""
    heads = [ln.split("all-to-all(")[0] for ln in hlo.splitlines()
             if re.search(r"= \(?[sf]32\[.*\ball-to-all\(", ln)]
    return ({int(m) for h in heads for m in re.findall(r"s32\[1,(\d+)\]", h)},
            {int(m) for h in heads for m in re.findall(r"f32\[1,(\d+),8\]", h)})


def test_all_to_all_shapes_include_the_small_bucket():
    """The compiled lookup and update hold an all_to_all at each bucket capacity."""
    mesh = tss.mesh_of((8,), ("x",))
    coll, _ = make_pair(mesh, "row_wise", (), tables=("hist",))
    feats = tss.to_global(tss.make_batch(np.random.default_rng(0), 8), mesh, ("x",))
    feats = {"hist": feats["hist"]}
    cap = coll._capacities(feats, coll._groups(feats))["hist"]
    small = routing.exchange_caps(cap, BUCKETS)
    state = coll.init(jax.random.key(0))
    lookup = jax.jit(coll.lookup).lower(state, feats).compile()
    ids, rows = all_to_all_caps(lookup.as_text())
    assert small[0] < cap and set(small) <= ids and set(small) <= rows, (small, ids, rows)
    acts, res = lookup(state, feats)
    apply = jax.jit(coll.apply_gradients).lower(state, res, acts).compile().as_text()
    _, grads = all_to_all_caps(apply)            # the backward sends [S_m, c, D] grads
    assert set(small) <= grads, (small, grads)


def test_exchange_caps_and_bad_fractions():
    assert routing.exchange_caps(64, BUCKETS) == [8, 16, 32, 64]
    assert routing.exchange_caps(3, BUCKETS) == [1, 2, 3]
    assert routing.exchange_caps(5, ()) == [5]
    slot = np.array([0, 3, 64 + 2, 2 * 64, 64 + 40])
    np.testing.assert_array_equal(routing.rebucket_slots(slot, 64, 8, 2), [0, 3, 10, 16, 16])
    with pytest.raises(ValueError, match="exchange_buckets"):
        EmbeddingCollection(tss.make_specs(SGD()), exchange_buckets=(0.5, 1.5))


def test_trainer_config_turns_exchange_buckets_on():
    from gemjax.config import get_config
    from gemjax.train.step import Trainer
    assert Trainer.create(get_config("tiny")).coll.exchange_buckets == ()
    on = Trainer.create(get_config("tiny", "train.sparse_exchange_buckets=true"))
    assert on.coll.exchange_buckets == tuple(routing.DEFAULT_EXCHANGE_BUCKETS)
