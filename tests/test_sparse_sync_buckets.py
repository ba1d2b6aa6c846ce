"""Replica sync of local table copies at the unique count (routing.sync_update_bucketed).

A replicated table, or a 2d table whose model group is one device, keeps one
copy per replica; every replica applies every replica's touched rows. With
EmbeddingCollection(sync_buckets=True) and its default unique buckets, each
replica sums its duplicates first and the replicas all-gather only the smallest
bucket holding the largest unique count over them. The branch must be the same on every replica (a pmax)
and the updated tables must equal the all-N gather's (sync_buckets=False), bit
for bit, also when heavy duplicates send it to the smallest bucket. The float64
reference check of the unbucketed sync lives in tests/test_sparse_sharded.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from gemjax.sparse import SGD, EmbeddingCollection, routing
from gemjax.sparse import plans as plans_lib
import test_sparse_exchange_buckets as teb
import test_sparse_sharded as tss


def test_sync_bucket_is_the_largest_unique_count_over_replicas():
    mesh = tss.mesh_of((8,), ("r",))
    n, caps = 16, routing.bucket_sizes(16, routing.DEFAULT_BUCKETS)          # [4, 6, 8, 16]
    counts = np.array([0, 3, 1, 4, 2, 0, 1, 2])
    for top, want in ((0, 0), (5, 1), (7, 2), (13, 3)):        # device 5's count; the max: 4, 5, 7, 13
        c = counts.copy()
        c[5] = top
        uniq = np.full((8, n), routing.INVALID, np.int32)
        for d in range(8):
            uniq[d, :c[d]] = np.arange(c[d])
        f = jax.shard_map(lambda u: routing.sync_bucket(u[0], caps, ("r",))[None], mesh=mesh,
                          in_specs=P("r"), out_specs=P("r"), check_vma=False)
        got = np.asarray(jax.jit(f)(jnp.asarray(uniq)[:, None, :]))
        assert (got == want).all(), (extra, got)
        assert caps[want] >= c.max() and (want == 0 or caps[want - 1] < c.max())


def _max_unique(dev, coll, name):
    s = coll.specs[name]
    return max(len(np.unique(np.concatenate([feats[f].reshape(-1) if f in ("u1", "u2")
                                             else np.concatenate(feats[f] + [np.zeros(0, int)])
                                             for f in sorted(s.features)])))
               for feats in dev)


def _collection(mesh, plan, replica_axes, sync_buckets):
    """test_sparse_sharded's specs and capacities, default unique buckets."""
    specs = tss.make_specs(SGD(lr=0.5))
    plans = plans_lib.resolve(plan, specs, mesh, replica_axes)
    plans = {n: dataclasses.replace(p, min_capacity=1) for n, p in plans.items()}
    return EmbeddingCollection(specs, plans, mesh, replica_axes=replica_axes,
                               sync_buckets=sync_buckets)


@pytest.mark.parametrize("shape,names,plan,replica_axes", [
    ((8,), ("replica",), "replicated", ("replica",)),
    ((2, 4), ("replica", "model"), "replicated", ("replica",)),
    ((8, 1), ("replica", "model"), "2d", ("replica",)),
])
@pytest.mark.parametrize("narrow", [None, (1, 1)])
def test_same_update_as_the_all_n_gather(shape, names, plan, replica_axes, narrow):
    mesh = tss.mesh_of(shape, names)
    coll, coll0 = (_collection(mesh, plan, replica_axes, sync) for sync in (True, False))
    assert coll.unique_buckets == routing.DEFAULT_BUCKETS
    for c in (coll, coll0):
        assert all(c.layouts[n].num_model == 1 and c.layouts[n].num_fs == 1 for n in c.specs)
        assert all(c._axes(n)[2] for n in c.specs), "every table syncs over replicas"
    axes = tuple(mesh.axis_names)
    rng = np.random.default_rng(3)
    tables = {s.name: {"weights": tss.quantized(rng, (s.vocab, s.dim), 64.0)}
              for s in coll.specs.values()}
    state, state0 = coll.from_logical(tables), coll0.from_logical(tables)
    fns = [(jax.jit(c.lookup), jax.jit(c.apply_gradients, donate_argnums=0)) for c in (coll, coll0)]
    for _ in range(2):
        dev = tss.make_batch(rng, mesh.size)
        if narrow:
            dev = teb.narrowed(dev, *narrow)
            # every id is 0: at most one unique id per table per device, which the
            # smallest bucket (ceil(N / 4) >= 1 rows) holds
            assert all(_max_unique(dev, coll, n) <= 1 for n in coll.specs)
        feats = tss.to_global(dev, mesh, axes)
        (acts, res), (acts0, res0) = fns[0][0](state, feats), fns[1][0](state0, feats)
        g = {f: jax.device_put(tss.quantized(rng, acts[f].shape, 8.0).astype(np.float32),
                               jax.sharding.NamedSharding(mesh, P(axes))) for f in acts}
        state, state0 = fns[0][1](state, res, g), fns[1][1](state0, res0, g)
    got, want = coll.to_logical(state), coll0.to_logical(state0)
    for n in want:
        for k in want[n]:
            np.testing.assert_array_equal(got[n][k], want[n][k], err_msg=f"{n}.{k}")
        assert not np.array_equal(want[n]["weights"], tables[n]["weights"]), f"{n} was not updated"


def test_sync_buckets_need_unique_buckets():
    specs = tss.make_specs(SGD(lr=0.5))
    with pytest.raises(ValueError, match="needs unique_buckets"):
        EmbeddingCollection(specs, unique_buckets=(), sync_buckets=True)
