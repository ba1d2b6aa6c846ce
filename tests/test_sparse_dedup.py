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


def test_unknown_dedup_is_named():
    with pytest.raises(ValueError, match="dedup"):
        routing.dedup_ids(jnp.zeros(3, jnp.int32), "radix")
