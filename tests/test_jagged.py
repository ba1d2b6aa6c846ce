"""Jagged layout: packing, padded round trips, validation, truncation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gemjax.data.jagged import (Jagged, bucket_capacity, from_padded, layout_from_lengths, pack,
                                to_padded, truncate_recent, validate)


def _random_lengths(rng, b):
    lengths = rng.integers(0, 9, b)
    lengths[rng.random(b) < 0.3] = 0
    lengths[rng.random(b) < 0.2] = 1
    return lengths


@pytest.mark.parametrize("seed", range(5))
def test_pack_layout_matches_python_loop(seed):
    rng = np.random.default_rng(seed)
    lengths = _random_lengths(rng, rng.integers(1, 12))
    seqs = [rng.normal(size=(n, 3)).astype(np.float32) for n in lengths]
    j = pack(seqs, multiple=16)
    assert j.capacity % 16 == 0 and j.capacity >= lengths.sum()
    # independent expectation: walk the samples one token at a time
    t = 0
    for b, s in enumerate(seqs):
        for p in range(len(s)):
            assert j.segment_ids[t] == b and j.positions[t] == p
            np.testing.assert_array_equal(j.values[t], s[p])
            t += 1
    assert (j.segment_ids[t:] == len(seqs)).all() and (j.positions[t:] == 0).all()
    assert (j.values[t:] == 0).all()
    np.testing.assert_array_equal(np.asarray(j.lengths), lengths)
    validate(j)


@pytest.mark.parametrize("seed", range(4))
def test_padded_round_trip_under_jit(seed):
    rng = np.random.default_rng(seed)
    b, l = 7, 6
    lengths = _random_lengths(rng, b).clip(0, l)
    padded = rng.normal(size=(b, l, 2)).astype(np.float32)
    j = from_padded(padded, lengths, multiple=8)
    out, mask = jax.jit(lambda j: to_padded(j, l))(jax.tree.map(jnp.asarray, j))
    expect_mask = np.arange(l)[None] < lengths[:, None]
    np.testing.assert_array_equal(np.asarray(mask), expect_mask)
    np.testing.assert_array_equal(np.asarray(out), np.where(expect_mask[..., None], padded, 0))


def test_to_padded_drops_tokens_past_max_len():
    j = pack([np.arange(5.0), np.arange(2.0)], capacity=8)
    out, mask = to_padded(j, 3)
    np.testing.assert_array_equal(np.asarray(out), [[0, 1, 2], [0, 1, 0]])
    np.testing.assert_array_equal(np.asarray(mask), [[1, 1, 1], [1, 1, 0]])


def test_dict_fields_and_all_empty():
    j = pack({"item": [np.array([3, 4]), np.array([], np.int64)],
              "event": [np.array([1, 0]), np.array([], np.int64)]}, capacity=4)
    np.testing.assert_array_equal(j.values["item"], [3, 4, 0, 0])
    np.testing.assert_array_equal(np.asarray(j.lengths), [2, 0])
    empty = pack([np.zeros((0,)), np.zeros((0,))], capacity=4)
    assert int(empty.offsets[-1]) == 0 and not np.asarray(empty.mask).any()
    validate(empty)


def test_bucket_capacity():
    assert bucket_capacity(0) == 128
    assert bucket_capacity(128) == 128
    assert bucket_capacity(129) == 256
    assert bucket_capacity(1000, multiple=64) == 1024
    with pytest.raises(ValueError, match="num_tokens"):
        bucket_capacity(-1)


def test_errors_name_the_input():
    with pytest.raises(ValueError, match="capacity is 4"):
        layout_from_lengths([3, 3], 4)
    with pytest.raises(ValueError, match="lengths must be >= 0"):
        layout_from_lengths([2, -1], 8)
    with pytest.raises(ValueError, match="field 'b' lengths differ"):
        pack({"a": [np.zeros(2)], "b": [np.zeros(3)]})
    j = pack([np.zeros(2), np.zeros(3)], capacity=8)
    with pytest.raises(ValueError, match="clicks.offsets must be non-decreasing"):
        validate(j.replace(offsets=np.array([0, 3, 2], np.int32)), "clicks")
    with pytest.raises(ValueError, match="clicks.segment_ids disagree"):
        validate(j.replace(segment_ids=np.zeros(8, np.int32)), "clicks")
    with pytest.raises(ValueError, match="clicks holds 9 tokens but its capacity is 8"):
        validate(j.replace(offsets=np.array([0, 2, 9], np.int32)), "clicks")


def test_truncate_recent_keeps_newest_and_counts():
    seqs = [np.arange(5), np.arange(2), np.arange(0)]
    out, n = truncate_recent(seqs, 3)
    assert n == 1
    np.testing.assert_array_equal(out[0], [2, 3, 4])
    np.testing.assert_array_equal(out[1], [0, 1])


def test_jagged_is_a_pytree():
    j = pack([np.ones(2), np.ones(1)], capacity=4)
    leaves = jax.tree.leaves(j)
    assert len(leaves) == 4
    doubled = jax.tree.map(lambda x: x * 2, j)
    assert isinstance(doubled, Jagged)
    np.testing.assert_array_equal(doubled.offsets, [0, 4, 6])


def test_fit_to_capacity_is_the_largest_common_cap_that_fits():
    from gemjax.data.jagged import fit_to_capacity
    rng = np.random.default_rng(0)
    for _ in range(50):
        lengths = rng.integers(0, 40, rng.integers(1, 20))
        cap = int(rng.integers(0, lengths.sum() + 5))
        got = fit_to_capacity(lengths, cap)
        assert got.sum() <= cap or lengths.sum() <= cap
        # brute force: the largest c with sum(min(L, c)) <= cap
        best = max(c for c in range(int(lengths.max()) + 1) if np.minimum(lengths, c).sum() <= cap)
        expect = lengths if lengths.sum() <= cap else np.minimum(lengths, best)
        np.testing.assert_array_equal(got, expect)
