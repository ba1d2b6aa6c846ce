"""Duplicate summing (routing.dedup_ids / sum_duplicates) vs numpy, both dedup modes.

Seeded sweeps over sizes 1, 2, 7, 64, 513 with few distinct values (many
duplicates), all ids equal, INVALID entries (padding) mixed in, and all
INVALID. The reference: np.unique + np.add.at in float64.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gemjax.sparse import routing

INVALID = int(routing.INVALID)


def cases():
    rng = np.random.default_rng(0)
    out = []
    for n in (1, 2, 7, 64, 513):
        out.append(rng.integers(0, max(2, n // 4), n))                  # many duplicates
        key = rng.integers(0, 1000, n)
        key[rng.random(n) < 0.3] = INVALID                              # padding mixed in
        out.append(key)
    out += [np.full(9, 5), np.full(6, INVALID), np.array([INVALID, 3, INVALID, 0, 3])]
    return [k.astype(np.int32) for k in out]


@pytest.mark.parametrize("dedup", routing.DEDUPS)
def test_dedup_and_sum_match_numpy(dedup):
    rng = np.random.default_rng(1)

    @jax.jit
    def run(key, g):
        uniq, res = routing.dedup_ids(key, dedup)
        return uniq, routing.inverse(res), routing.sum_duplicates(g, res, key.shape[0])

    for key in cases():
        n = key.size
        g = rng.standard_normal((n, 3)).astype(np.float32)
        uniq, inv, sums = map(np.asarray, run(jnp.asarray(key), jnp.asarray(g)))
        want_u, want_inv = np.unique(key, return_inverse=True)
        u = want_u.size
        np.testing.assert_array_equal(uniq[:u], want_u, err_msg=f"uniq n={n}")
        assert (uniq[u:] == INVALID).all(), "unique ids must be INVALID-filled past the last one"
        np.testing.assert_array_equal(inv, want_inv)
        want = np.zeros((n, 3))
        np.add.at(want, want_inv, g.astype(np.float64))
        np.testing.assert_allclose(sums, want, rtol=1e-5, atol=1e-5, err_msg=f"sums n={n}")


def test_sorted_unique_segments_are_non_decreasing_and_consistent():
    rng = np.random.default_rng(2)
    key = rng.integers(0, 40, 300).astype(np.int32)
    uniq, perm, seg = map(np.asarray, jax.jit(routing.sorted_unique)(jnp.asarray(key)))
    assert (np.diff(seg) >= 0).all()
    np.testing.assert_array_equal(key[perm], uniq[seg])
    np.testing.assert_array_equal(perm, np.argsort(key, kind="stable"))


@pytest.mark.parametrize("v,caps,counts", [
    (500, [7, 16, 32, 64], (3, 7, 8, 16, 17, 40, 64)),
    (12, [7, 12], (3, 7, 8, 12)),             # a 12-row table: no bucket past its rows
])
@pytest.mark.parametrize("dedup", routing.DEDUPS)
def test_bucketed_update_equals_full_update(dedup, v, caps, counts):
    """update_unique_bucketed == dedupe + update on all N rows, for unique counts that
    select every bucket (few distinct ids ... all distinct), with padding and a src_index;
    the buckets stop at the table's rows."""
    from gemjax.sparse import RowWiseAdagrad
    rng = np.random.default_rng(3)
    opt, n, d, buckets = RowWiseAdagrad(lr=0.1, eps=1e-6), 64, 4, (0.1, 0.25, 0.5)
    state = {"weights": jnp.asarray(rng.standard_normal((v, d)), jnp.float32),
             "accum": jnp.asarray(rng.random(v), jnp.float32)}
    src = jnp.asarray(rng.standard_normal((10, d)), jnp.float32)
    full = jax.jit(lambda s, key, si: routing.update_rows(
        s, jnp.where(key != INVALID, key, -1), jnp.take(src, si, axis=0), opt, dedup=dedup))

    @jax.jit
    def bucketed(s, key, si):
        uniq, res = routing.dedup_ids(key, dedup)
        return routing.update_unique_bucketed(s, src, {**res, "uniq": uniq}, opt, buckets, src_index=si)

    assert routing.bucket_sizes(n, buckets, rows=v) == caps
    args = (state, jnp.full((n,), INVALID, jnp.int32), jnp.zeros((n,), jnp.int32))
    conds = [e for e in jax.make_jaxpr(bucketed)(*args).jaxpr.eqns[0].params["jaxpr"].eqns
             if e.primitive.name == "cond"]
    assert [len(e.params["branches"]) for e in conds] == [len(caps)]   # one branch per bucket
    for distinct in counts:
        key = rng.permutation(np.resize(rng.choice(v, distinct, replace=False), n)).astype(np.int32)
        key[rng.random(n) < 0.1] = INVALID
        si = rng.integers(0, 10, n).astype(np.int32)
        want = full(state, jnp.asarray(key), jnp.asarray(si))
        got = bucketed(state, jnp.asarray(key), jnp.asarray(si))
        for k in want:
            np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-6, atol=1e-7,
                                       err_msg=f"{k} distinct={distinct}")


def test_unknown_dedup_is_named():
    with pytest.raises(ValueError, match="dedup"):
        routing.dedup_ids(jnp.zeros(3, jnp.int32), "radix")
