"""Invariants the fast host pipeline must keep (no timings here).

The synthetic stream is pinned by hashes: any change to the values, dtypes, shapes
or order of a batch (or its true probabilities and counters) fails these tests, and
so does a value that depends on the CPU's BLAS kernel or numpy's SIMD dispatch (the
hashes are recomputed in subprocesses under other OpenBLAS core types and with
numpy's dispatched SIMD paths turned off).
"""

import dataclasses
import hashlib
import json
import os
import platform
import subprocess
import sys

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


_SMALL = get_config("small").data
_TIGHT = dataclasses.replace(_SMALL, batch_size=64, capacity_slack=0.4, synthetic=dataclasses.replace(
    _SMALL.synthetic, seq_median=300.0, seq_cap=512))       # both truncation paths fire
# (config, seed, stream, (step, shard, num_shards)) -> digest
PINNED = [
    ("tiny", 0, "train", (0, 0, 1), "c2e9c350507b7b58"),
    ("tiny", 0, "train", (7, 1, 2), "21138e503d3fa9dd"),
    ("tiny", 0, "eval", (0, 0, 1), "aefab70b1c1238c0"),
    ("tiny", 0, "eval", (7, 1, 2), "7bc053aeb672dc13"),
    ("small", 3, "train", (0, 0, 1), "035d9cc06e8f249d"),
    ("small", 3, "train", (5, 2, 4), "71d6c8c606f6d3fe"),
    ("small", 3, "eval", (0, 0, 1), "d436644f71b1b296"),
    ("small", 3, "eval", (5, 2, 4), "364b11e964798487"),
    ("tight", 1, "train", (2, 1, 2), "594063b7588b0f07"),
    ("tight", 1, "eval", (2, 1, 2), "1a4ea20cc6a3cc56"),
    ("h200", 0, "train", (0, 3, 16), "3f0866f825ac851b"),
    ("h200", 0, "eval", (0, 3, 16), "49bac86a278a2e93"),
]


def _cfg(name):
    return _TIGHT if name == "tight" else get_config(name).data


@pytest.mark.parametrize("name,seed,stream,key,expect", PINNED,
                         ids=[f"{p[0]}-{p[2]}-{'-'.join(map(str, p[3]))}" for p in PINNED])
def test_stream_is_bit_identical_to_the_pinned_hashes(name, seed, stream, key, expect):
    batch, info = SyntheticStream(_cfg(name), seed, stream).shard_batch(*key)
    assert _digest(batch, info) == expect


def pinned_digests() -> list[str]:
    """The digest of every PINNED batch, computed in this process."""
    return [_digest(*SyntheticStream(_cfg(n), seed, stream).shard_batch(*key))
            for n, seed, stream, key, _ in PINNED]


def _simd_dispatch_found() -> list[str]:
    """numpy's run-time dispatched SIMD targets this CPU has (e.g. X86_V3, X86_V4)."""
    from numpy._core import _multiarray_umath as umath
    return [f for f in umath.__cpu_dispatch__ if umath.__cpu_features__.get(f)]


def _cpu_variants() -> dict[str, dict[str, str]]:
    """Environments that change which BLAS kernel and which SIMD exp / log numpy runs."""
    out = {}
    if platform.machine().lower() in ("x86_64", "amd64"):
        # Prescott (SSE3) runs on every x86-64; Haswell (AVX2) only where the CPU has it
        with open("/proc/cpuinfo") as f:
            avx2 = " avx2" in f.read()
        for core in ("Prescott",) + (("Haswell",) if avx2 else ("Nehalem",)):
            out[f"OPENBLAS_CORETYPE={core}"] = {"OPENBLAS_CORETYPE": core}
    if _simd_dispatch_found():
        out["numpy SIMD dispatch off"] = {"NPY_DISABLE_CPU_FEATURES": " ".join(_simd_dispatch_found())}
    return out


def test_stream_does_not_depend_on_blas_kernels_or_simd_dispatch():
    """The pinned digests, recomputed under other OpenBLAS core types and with numpy's
    dispatched SIMD paths disabled, are unchanged (a stream that used BLAS or numpy's
    exp / log / pow gave other digests under each of these)."""
    variants = _cpu_variants()
    if not variants:
        pytest.skip(f"no BLAS / SIMD variants known for {platform.machine()}")
    code = ("import json, sys; sys.path.insert(0, 'tests'); "
            "from test_data_speed_invariants import pinned_digests; print(json.dumps(pinned_digests()))")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    expect = [p[-1] for p in PINNED]
    for name, env in variants.items():
        proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                              timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu", **env})
        assert proc.returncode == 0, f"{name}: {proc.stderr[-2000:]}"
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        diff = [(PINNED[i][:4], g) for i, (g, e) in enumerate(zip(got, expect)) if g != e]
        assert not diff, f"{name}: stream differs from the pinned hashes at {diff}"


def test_tight_config_exercises_both_truncations():
    _, info = SyntheticStream(_TIGHT, 1).shard_batch(2, 1, 2)
    assert info.seq_truncated_to_cap > 0 and info.seq_truncated_to_capacity > 0


def test_recency_window_matches_a_per_sample_slice():
    """The vectorised window (seg_r, cats_r) = the last `recent` cats of each packed sample."""
    cfg = get_config("tiny").data
    s = SyntheticStream(cfg, 5)
    rng = np.random.default_rng(11)
    b = 64
    fav = rng.integers(0, cfg.synthetic.num_categories, (b, 3))
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
    # float64 reference of the inverse CDF through numpy's own exp / log / pow: the ranks
    # agree except where the inverse CDF lies within rounding of an integer
    u = np.random.default_rng(4).random(20_000).astype(np.float64)
    x = np.exp(u * np.log(5001.0)) if a == 1.0 else ((5001.0 ** (1 - a) - 1) * u + 1) ** (1 / (1 - a))
    expect = np.clip(np.floor(x) - 1, 0, 4999).astype(np.int64)
    near_integer = np.abs(x - np.rint(x)) < 1e-9 * x
    np.testing.assert_array_equal(ref[~near_integer], expect[~near_integer])
    assert near_integer.mean() < 1e-3
    with pytest.raises(ValueError, match="zipf_ranks: out must be an integer array"):
        zipf_ranks(np.random.default_rng(4), 5000, a, 10, out=np.zeros(10, np.float32))
