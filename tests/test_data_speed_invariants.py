"""Invariants the fast host pipeline must keep (no timings here).

The synthetic stream is pinned by hashes taken before the pipeline was
optimised: any change to the values, dtypes, shapes or order of a batch (or its
true probabilities and counters) fails these tests.
"""

import dataclasses
import hashlib

import jax
import numpy as np
import pytest

from gemjax.config import get_config
from gemjax.data.synthetic import SyntheticStream


def _digest(batch, info) -> str:
    """sha256 over every leaf (path, dtype, shape, bytes), true probs and counters."""
    h = hashlib.sha256()
    for path, x in jax.tree_util.tree_leaves_with_path((batch, info.true_probs)):
        x = np.asarray(x)
        h.update(f"{jax.tree_util.keystr(path)}|{x.dtype.str}|{x.shape}|".encode())
        h.update(np.ascontiguousarray(x).tobytes())
    h.update(f"{info.seq_truncated_to_cap},{info.seq_truncated_to_capacity}".encode())
    return h.hexdigest()[:16]


_TIGHT = dataclasses.replace(get_config("small").data, batch_size=64, seq_median=300.0, seq_cap=512,
                             capacity_slack=0.4)       # both truncation paths fire
# (config, seed, stream, (step, shard, num_shards)) -> digest recorded before the speed-ups
PINNED = [
    ("tiny", 0, "train", (0, 0, 1), "4d68f570932672ef"),
    ("tiny", 0, "train", (7, 1, 2), "a46be8a42c073c5a"),
    ("tiny", 0, "eval", (0, 0, 1), "486ef5ba6f587d41"),
    ("tiny", 0, "eval", (7, 1, 2), "1ab29c2e24c6db97"),
    ("small", 3, "train", (0, 0, 1), "614e0ea3d7e23a1e"),
    ("small", 3, "train", (5, 2, 4), "b47c19b662e33f91"),
    ("small", 3, "eval", (0, 0, 1), "e04c1fdefc403958"),
    ("small", 3, "eval", (5, 2, 4), "6c91b4f1b086d676"),
    ("tight", 1, "train", (2, 1, 2), "e1ad54a6815ce340"),
    ("tight", 1, "eval", (2, 1, 2), "444d09f0bbe74ad2"),
    ("h200", 0, "train", (0, 3, 16), "45e9c67076c2a2fe"),
    ("h200", 0, "eval", (0, 3, 16), "1cc4dbc0161a7d79"),
]


def _cfg(name):
    return _TIGHT if name == "tight" else get_config(name).data


@pytest.mark.parametrize("name,seed,stream,key,expect", PINNED,
                         ids=[f"{p[0]}-{p[2]}-{'-'.join(map(str, p[3]))}" for p in PINNED])
def test_stream_is_bit_identical_to_the_pinned_hashes(name, seed, stream, key, expect):
    batch, info = SyntheticStream(_cfg(name), seed, stream).shard_batch(*key)
    assert _digest(batch, info) == expect


def test_tight_config_exercises_both_truncations():
    _, info = SyntheticStream(_TIGHT, 1).shard_batch(2, 1, 2)
    assert info.seq_truncated_to_cap > 0 and info.seq_truncated_to_capacity > 0


def test_recency_window_matches_a_per_sample_slice():
    """The vectorised window (seg_r, cats_r) = the last `recent` cats of each packed sample."""
    cfg = get_config("tiny").data
    s = SyntheticStream(cfg, 5)
    rng = np.random.default_rng(11)
    b = 64
    fav = rng.integers(0, cfg.num_categories, (b, 3))
    jag, (seg_r, cats_r), _, n_cut = s._sequence(rng, "clicks", fav, capacity=4096)
    assert n_cut == 0
    off, cat = np.asarray(jag.offsets), np.asarray(jag.values["cat"])
    assert (np.diff(off) == 0).any() and (np.diff(off) > cfg.recent).any()   # empty and long samples
    expect_seg = np.concatenate([[i] * len(cat[off[i]:off[i + 1]][-cfg.recent:]) for i in range(b)])
    expect_cat = np.concatenate([cat[off[i]:off[i + 1]][-cfg.recent:] for i in range(b)])
    np.testing.assert_array_equal(seg_r, expect_seg)
    np.testing.assert_array_equal(cats_r, expect_cat)
    # tokens really come from the user's favourites about 70% of the time
    in_fav = (fav[np.repeat(np.arange(b), np.diff(off))] == cat[:off[-1], None]).any(1)
    assert 0.6 < in_fav.mean() < 0.9


def _mesh(shape, names):
    return jax.sharding.Mesh(np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape), names)


@pytest.mark.parametrize("shape,names,workers", [((4,), ("data",), 1), ((2, 2), ("a", "b"), 3)])
def test_feeder_batches_equal_the_sequential_host_path(shape, names, workers):
    """Threaded per-device feeding = to_device(host_batch(step)) and each device holds its shard."""
    from gemjax.data.feeding import Feeder
    cfg = dataclasses.replace(get_config("tiny").data, batch_size=32)
    stream = SyntheticStream(cfg, 2)
    seen = []
    feeder = Feeder(stream.shard_batch, _mesh(shape, names), workers=workers, prefetch=2,
                    check_ids=lambda feats: seen.append(sorted(feats)),
                    id_fields={"clicks": ("item",)})
    got = list(feeder.batches(3, 6))
    assert [g[0] for g in got] == [3, 4, 5]
    assert len(seen) == 3 * feeder.num_shards and "clicks.item" in seen[0]
    for step, batch, infos, tokens in got:
        host, host_infos, host_tokens = feeder.host_batch(step)
        ref = feeder.to_device(host)
        assert tokens == host_tokens
        for a, b in zip(infos, host_infos):
            np.testing.assert_array_equal(a.true_probs, b.true_probs)
        for x, y in zip(jax.tree.leaves(batch), jax.tree.leaves(ref)):
            assert x.sharding == y.sharding and x.shape == y.shape
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        # device i of the batch axes holds source shard i (checked against make_shard directly)
        shard_of = {d: i for i, d in enumerate(feeder.local_devices)}
        leaf = batch.sequences["clicks"].offsets
        for piece in leaf.addressable_shards:
            i = shard_of[piece.device]
            expect = stream.shard_batch(step, i, feeder.num_shards)[0].sequences["clicks"].offsets
            np.testing.assert_array_equal(np.asarray(piece.data), expect)


def test_feeder_errors_name_the_step_shard_and_leaf():
    from gemjax.data.feeding import Feeder
    cfg = dataclasses.replace(get_config("tiny").data, batch_size=16)
    stream = SyntheticStream(cfg, 0)

    def bad_dense(step, shard, n):
        b, info = stream.shard_batch(step, shard, n)
        if shard == 1:
            d = b.dense.copy()
            d[2, 1] = np.nan
            b = b.replace(dense=d)
        return b, info

    with pytest.raises(ValueError, match=r"step 0 shard 1: dense feature 1 of sample 2"):
        list(Feeder(bad_dense, _mesh((2,), ("data",)), workers=2).batches(0, 2))

    def ragged(step, shard, n):                         # shard 1 gets a bigger capacity
        b, info = stream.shard_batch(step, shard, n)
        if shard == 1:
            j = b.sequences["views"]
            cap = j.capacity + 128
            b = b.replace(sequences={**b.sequences, "views": j.replace(
                values={k: np.pad(v, (0, 128)) for k, v in j.values.items()},
                segment_ids=np.pad(j.segment_ids, (0, 128), constant_values=j.num_samples),
                positions=np.pad(j.positions, (0, 128)))})
            assert b.sequences["views"].capacity == cap
        return b, info

    with pytest.raises(ValueError, match=r"step 0: shard 1 leaf .*views.*same shapes"):
        list(Feeder(ragged, _mesh((2,), ("data",)), workers=1).batches(0, 1))


@pytest.mark.parametrize("a", [0.8, 1.0, 1.05])
def test_zipf_ranks_into_int32_out_equals_the_int64_ranks(a):
    from gemjax.data.synthetic import zipf_ranks
    ref = zipf_ranks(np.random.default_rng(4), 5000, a, 20_000)
    out = np.full(20_000, -7, np.int32)
    got = zipf_ranks(np.random.default_rng(4), 5000, a, 20_000, out=out)
    assert got is out and ref.dtype == np.int64
    np.testing.assert_array_equal(out, ref)
    # float64 reference of the inverse CDF, floored, computed without the in-place path
    u = np.random.default_rng(4).random(20_000).astype(np.float64)
    x = np.exp(u * np.log(5001.0)) if a == 1.0 else ((5001.0 ** (1 - a) - 1) * u + 1) ** (1 / (1 - a))
    np.testing.assert_array_equal(ref, np.clip(np.floor(x) - 1, 0, 4999).astype(np.int64))
    with pytest.raises(ValueError, match="zipf_ranks: out must be an integer array"):
        zipf_ranks(np.random.default_rng(4), 5000, a, 10, out=np.zeros(10, np.float32))
