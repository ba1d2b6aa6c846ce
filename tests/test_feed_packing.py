"""The packed feed (one byte buffer per shard, unpacked on the mesh) gives the arrays the
per-leaf copy gives: dtype, shape, sharding, placement and every bit."""

import jax
import ml_dtypes
import numpy as np
import pytest

from gemjax.data.batch import Batch
from gemjax.data.feeding import ENV_PACK, Feeder, pack_default
from gemjax.data.jagged import Jagged, layout_from_lengths
from gemjax.data import packing

B, CAP = 6, 16


def _shard(step: int, shard: int, num_shards: int):
    """A shard with every leaf kind: int32, float32 with odd bits, bool, bf16 with NaN
    payloads, uint8, int64 (canonicalized to int32), a [B, 0] float32 and a [CAP, 0] leaf."""
    rng = np.random.default_rng(1000 * step + shard)
    odd = np.array([-0.0, 1e-45, np.inf, -np.inf, 3.4e38, np.nan], np.float32)
    odd[-1] = np.frombuffer(np.uint32(0x7FC00123).tobytes(), np.float32)[0]    # NaN payload
    bf = rng.standard_normal((CAP, 3)).astype(ml_dtypes.bfloat16)
    bf.view(np.uint16)[0, 0] = 0x7FC1
    lengths = rng.integers(0, 4, B)
    offsets, seg, pos = layout_from_lengths(lengths, CAP)
    values = {"item": rng.integers(0, 1 << 30, CAP).astype(np.int32),
              "flag": rng.random(CAP) < 0.5, "bf": bf,
              "code": rng.integers(0, 256, CAP).astype(np.uint8),
              "empty": np.zeros((CAP, 0), np.float32)}
    batch = Batch(sparse={"user": rng.integers(-5, 1 << 40, B).astype(np.int64),
                          "odd": np.stack([odd] * B) * np.float32(-1) ** step},
                  dense=np.zeros((B, 0), np.float32),
                  sequences={"clicks": Jagged(values, offsets, seg, pos)},
                  labels=rng.integers(0, 2, (B, 2)).astype(np.float32),
                  label_mask=np.ones((B, 2), np.float32),
                  surface=rng.integers(0, 3, B).astype(np.int32),
                  weights=rng.random(B).astype(np.float32))
    return batch, None


def _bits(x) -> tuple:
    a = np.asarray(x)
    return a.dtype.str, a.shape, np.ascontiguousarray(a).tobytes()


@pytest.mark.parametrize("shape,names,axis", [((1,), ("batch",), None),
                                              ((2, 4), ("a", "b"), ("b", "a"))])
def test_packed_feed_equals_per_leaf_bit_for_bit(shape, names, axis):
    n = int(np.prod(shape))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]).reshape(shape), names)
    packed = Feeder(_shard, mesh, axis=axis, workers=2, pack=True)
    leafwise = Feeder(_shard, mesh, axis=axis, workers=2, pack=False)
    got = list(packed.batches(0, 2))
    ref = list(leafwise.batches(0, 2))
    for (step, a, _, ta), (_, b, _, tb) in zip(got, ref):
        assert ta == tb
        c = leafwise.to_device(leafwise.host_batch(step)[0])
        la, lb, lc = (jax.tree_util.tree_leaves_with_path(t) for t in (a, b, c))
        assert [p for p, _ in la] == [p for p, _ in lb] == [p for p, _ in lc]
        assert len(la) == 15
        for (path, x), (_, y), (_, z) in zip(la, lb, lc):
            assert x.dtype == y.dtype == z.dtype, path
            assert x.shape == y.shape == z.shape, path
            assert x.sharding == y.sharding == z.sharding, path
            assert _bits(x) == _bits(y) == _bits(z), path
            for p, q in zip(x.addressable_shards, y.addressable_shards):
                assert p.device == q.device and p.index == q.index, path
                assert _bits(p.data) == _bits(q.data), path
        assert a.sparse["user"].dtype == np.int32 and a.sequences["clicks"].values["flag"].dtype == bool
        assert a.dense.shape == (B * n, 0)


def test_pack_layout_offsets_and_empty_leaves():
    batch, _ = _shard(0, 0, 1)
    row, layout = packing.pack(batch)
    sizes = [int(np.prod(s)) * np.dtype(d).itemsize for s, d, _ in layout.leaves]
    offs = [o for _, _, o in layout.leaves]
    assert row.dtype == np.uint8 and row.shape == (1, sum(sizes)) == (1, layout.nbytes)
    assert offs == list(np.cumsum([0] + sizes[:-1]))
    empty_row, empty = packing.pack({"a": np.zeros((4, 0), np.float32)})
    assert empty_row.shape == (1, 0) and empty.leaves == (((4, 0), "float32", 0),)


def test_shard_shape_mismatch_is_named_in_the_packed_path():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("batch",))

    def uneven(step, shard, n):
        b, info = _shard(step, shard, n)
        if shard == 1:
            b = b.replace(weights=np.ones(B + 1, np.float32))
        return b, info

    with pytest.raises(ValueError, match=r"step 0: shard 1 leaf .*weights"):
        list(Feeder(uneven, mesh, pack=True).batches(0, 1))


def test_pack_default_reads_the_environment(monkeypatch):
    monkeypatch.delenv(ENV_PACK, raising=False)
    assert pack_default() is True
    monkeypatch.setenv(ENV_PACK, "0")
    assert pack_default() is False
    monkeypatch.setenv(ENV_PACK, "off")
    with pytest.raises(ValueError, match=ENV_PACK):
        pack_default()
