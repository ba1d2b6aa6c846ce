"""Bucket branches fixed at trace time (EmbeddingCollection.branch_needs / branch_plan /
fixed_branches) vs the in-step lax.switch.

The exchange buckets and the replica sync buckets pick their branch inside the
step (a pmax, then a lax.switch around all_to_alls / all-gathers). XLA:GPU runs
such a conditional on the host: it copies the branch index back and waits for
the device, so the host cannot queue the next step ahead (measured on 2 H200s:
the device idled ~20-30 ms per step). With the branches computed from the batch
ahead of the step and fixed while tracing, the program must hold no conditional
around a collective, and give the same lookups, stats and updated tables bit for
bit. A plan made for another batch must show up in ids_overflow, not vanish.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.extend
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from gemjax.sparse import SGD, EmbeddingCollection, routing
from gemjax.sparse import plans as plans_lib
import test_sparse_exchange_buckets as teb
import test_sparse_sharded as tss

COLLECTIVES = {"all_gather", "all_to_all", "psum", "pmax", "reduce_scatter", "psum_scatter",
               "ppermute", "ragged_all_to_all"}


def collectives_in_conds(jaxpr) -> int:
    """Collective equations inside cond branches, anywhere in a (closed) jaxpr."""
    def walk(jx, inside):
        n = 0
        for e in jx.eqns:
            if inside and e.primitive.name in COLLECTIVES:
                n += 1
            for sub in jax.extend.core.jaxprs_in_params(e.params):
                n += walk(sub, inside or e.primitive.name == "cond")
        return n
    return walk(jaxpr.jaxpr, False)


def make(mesh, plan, replica_axes, **kw):
    """tss's tables but "hist" (a mean-pooled bag: its branches are the "tags" bag's, and
    each table adds its own exchange, unique and sync switches to every program here)."""
    specs = [s for s in tss.make_specs(SGD(lr=0.5)) if s.name != "hist"]
    plans = plans_lib.resolve(plan, specs, mesh, replica_axes)
    plans = {n: dataclasses.replace(p, min_capacity=1) for n, p in plans.items()}
    if "user" in plans:
        plans["user"] = dataclasses.replace(plans["user"], capacity_factor=tss.USER_CAP)
    return EmbeddingCollection(specs, plans, mesh, replica_axes=replica_axes, **kw)


def to_global(dev, mesh, axes):
    """tss.to_global without the "hist" feature (no table here serves it)."""
    feats = tss.to_global(dev, mesh, axes)
    del feats["hist"]
    return feats


CASES = [   # shape, names, plan, replica axes, collection options
    ((8,), ("x",), "row_wise", (), dict(exchange_buckets=teb.BUCKETS, unique_buckets=())),
    ((2, 4), ("replica", "model"), "fs2d", ("replica",),
     dict(exchange_buckets=teb.BUCKETS, unique_buckets=routing.DEFAULT_BUCKETS)),
    ((2, 4), ("replica", "model"), "2d", ("replica",), dict(exchange_buckets=teb.BUCKETS)),
    ((8,), ("replica",), "replicated", ("replica",), dict(sync_buckets=True)),
    ((8, 1), ("replica", "model"), "2d", ("replica",),
     dict(sync_buckets=True, exchange_buckets=teb.BUCKETS)),
]


@pytest.mark.parametrize("shape,names,plan,replica_axes,kw", CASES)
def test_fixed_branches_equal_the_switch(shape, names, plan, replica_axes, kw):
    """Two steps, each with its own plan: a diverse batch, then a heavily duplicated one
    (every id i -> i % 1: one id per table, the smallest bucket everywhere). The switch
    programs serve both steps (same shapes); each plan traces and compiles its own."""
    mesh = tss.mesh_of(shape, names)
    coll, coll0 = make(mesh, plan, replica_axes, **kw), make(mesh, plan, replica_axes, **kw)
    assert coll.has_switches()
    axes = tuple(mesh.axis_names)
    rng = np.random.default_rng(5)
    tables = {s.name: {"weights": tss.quantized(rng, (s.vocab, s.dim), 64.0)}
              for s in coll.specs.values()}
    state, state0 = coll.from_logical(tables), coll0.from_logical(tables)
    lookup0 = jax.jit(coll0.lookup)
    apply0 = jax.jit(coll0.apply_gradients, donate_argnums=0)
    plans = []
    for narrow in (None, (1, 1)):
        dev = tss.make_batch(rng, mesh.size)
        if narrow:
            dev = teb.narrowed(dev, *narrow)
        feats = to_global(dev, mesh, axes)
        plan_ = coll.branch_plan(feats, jax.device_get(coll.branch_needs(feats)))
        plans.append(plan_)
        assert plan_ and all(x >= 0 or s >= 0 for _, x, s in plan_), plan_
        with coll.fixed_branches(plan_):
            traced = jax.jit(coll.lookup).trace(state, feats)      # one trace: jaxpr and program
            acts, res = traced.lower().compile()(state, feats)
        assert collectives_in_conds(traced.jaxpr) == 0
        traced0 = lookup0.trace(state0, feats)
        assert collectives_in_conds(traced0.jaxpr) > 0 or \
            not any(coll0._switched(n)[0] for n in coll0.specs)
        acts0, res0 = lookup0(state0, feats)
        for f in acts0:
            np.testing.assert_array_equal(np.asarray(acts[f]), np.asarray(acts0[f]), err_msg=f)
        for k in res0["stats"]:
            assert int(res["stats"][k]) == int(res0["stats"][k]), k
        for n, x, _ in plan_:
            if x >= 0:   # the fixed branch is the one the switch took
                assert int(np.asarray(res0["route"][n]["xb"])[0]) == x, n
        g = {f: jax.device_put(tss.quantized(rng, acts[f].shape, 8.0).astype(np.float32),
                               NamedSharding(mesh, P(axes))) for f in acts}
        with coll.fixed_branches(plan_):
            traced = jax.jit(coll.apply_gradients, donate_argnums=0).trace(state, res, g)
            ja = traced.jaxpr
            state = traced.lower().compile()(state, res, g)
        assert collectives_in_conds(ja) == 0
        assert collectives_in_conds(apply0.trace(state0, res0, g).jaxpr) > 0
        state0 = apply0(state0, res0, g)
    got, want = coll.to_logical(state), coll0.to_logical(state0)
    for n in want:
        for k in want[n]:
            np.testing.assert_array_equal(got[n][k], want[n][k], err_msg=f"{n}.{k}")
        assert not np.array_equal(want[n]["weights"], tables[n]["weights"]), n
    assert plans[0] != plans[1], plans
    # one id per table: the smallest bucket everywhere
    assert all(x <= 0 and s <= 0 for n, x, s in plans[1]), plans


@pytest.mark.parametrize("shape,names,plan,replica_axes,kw", [CASES[0], CASES[3]])
def test_a_plan_too_small_for_the_batch_is_counted(shape, names, plan, replica_axes, kw):
    """The plan of a heavily duplicated batch, used for a diverse one: ids_overflow > 0."""
    mesh = tss.mesh_of(shape, names)
    coll = make(mesh, plan, replica_axes, **kw)
    axes = tuple(mesh.axis_names)
    rng = np.random.default_rng(6)
    state = coll.init(jax.random.key(0))
    dev = tss.make_batch(rng, mesh.size)
    small = to_global(teb.narrowed(dev, 1, 1), mesh, axes)
    feats = to_global(dev, mesh, axes)
    plan_small = coll.branch_plan(small, jax.device_get(coll.branch_needs(small)))
    plan_right = coll.branch_plan(feats, jax.device_get(coll.branch_needs(feats)))
    assert plan_small != plan_right
    with coll.fixed_branches(plan_right):
        _, res = jax.jit(coll.lookup)(state, feats)
    base = int(res["stats"]["ids_overflow"])          # the "user" table's own overflow
    with coll.fixed_branches(plan_small):
        _, res = jax.jit(coll.lookup)(state, feats)
    assert int(res["stats"]["ids_overflow"]) > base


def test_needs_are_the_numpy_counts():
    """branch_needs: the largest per-destination and the largest unique count over devices."""
    mesh = tss.mesh_of((8,), ("x",))
    coll = make(mesh, "row_wise", (), exchange_buckets=teb.BUCKETS, unique_buckets=())
    rng = np.random.default_rng(7)
    dev = tss.make_batch(rng, 8)
    feats = to_global(dev, mesh, ("x",))
    needs = jax.device_get(coll.branch_needs(feats))
    caps = coll._capacities(feats, coll._groups(feats))
    plan = dict((n, x) for n, x, _ in coll.branch_plan(feats, needs))
    for n in coll.specs:
        assert plan[n] == teb.expected_branch(coll, n, dev, caps[n]), n
        s = coll.specs[n]
        uniq = [np.unique(np.concatenate([d[f].reshape(-1) if f in ("u1", "u2")
                                          else np.concatenate(d[f] + [np.zeros(0, int)])
                                          for f in sorted(s.features)])) for d in dev]
        assert int(needs[n][1]) == max(len(u) for u in uniq), n


def test_no_switches_no_plan():
    mesh = tss.mesh_of((8,), ("x",))
    coll = make(mesh, "row_wise", ())
    assert not coll.has_switches()
    feats = to_global(tss.make_batch(np.random.default_rng(0), 8), mesh, ("x",))
    assert coll.branch_needs(feats) == {} and coll.branch_plan(feats, {}) == ()
    with pytest.raises(ValueError, match="not an index"):
        routing._check_branch(4, [1, 2, 3])


def test_first_at_least_is_the_numpy_search_without_a_loop():
    """The bucket index the switches take: np.searchsorted's, as compares (no XLA while
    loop, which XLA:GPU would step from the host)."""
    caps = [3, 5, 9]
    f = jax.jit(lambda x: routing.first_at_least(caps, x))
    for x in (0, 3, 4, 5, 9, 10, -1):
        assert int(f(np.int32(x))) == int(np.searchsorted(caps, x)), x
    assert "while" not in jax.jit(f).lower(np.int32(4)).as_text()
