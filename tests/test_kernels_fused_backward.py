"""The fused Triton backwards (kernels/triton/backward.py, FlashConfig.fused_bwd): one side's
kernel stores the other side's rows whose whole interval lies in its tile, the other
kernel doing the rest ("k_rows", "q_rows"; "auto" picks them for short key / query
sides). Against the float64 per-sample formula, forward and gradients."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.triton import backward as triton_backward
from kernels.dispatch import gdpa_pallas
from kernels.dispatch import jagged_attention_pallas
from kernels.triton.tuning import FlashConfig, backward_knobs, fused_backward_side
from test_kernels_common import check_against, np_attention, offsets_of, random_qkv, run_vjp

# short sides at the 16 / 32-token tiles: 0, 1, tile - 1, tile, tile + 1; a sample with
# no keys (cross) or no queries (PMA); long sides across the 64-token tiles. Capacities
# (sums rounded up to 128) / 8 samples: 32 keys (cross) and 16 queries (PMA) per sample;
# fused_bwd="auto" fuses both ("k_rows" / "q_rows").
CROSS = ([70, 0, 5, 130, 33, 64, 1, 3], [32, 32, 0, 31, 33, 1, 17, 0])   # (q lens, kv lens)
PMA = ([16, 16, 0, 15, 17, 1, 16, 16], [90, 0, 40, 129, 64, 1, 63, 5])
# every sample's short side exactly one tile (32 keys / 16 queries, aligned): "*_rows"
# leaves the other kernel only empty rows
CROSS_ALIGNED = ([70, 0, 5, 130, 33, 64, 1, 3], [32, 32, 0, 32, 32, 32, 32, 0])
PMA_ALIGNED = ([16, 16, 0, 16, 16, 16, 16, 16], PMA[1])


def _fn(mode, qo, ko, fused_bwd, **kw):
    qo, ko = jnp.asarray(qo), jnp.asarray(ko)
    if mode == "gdpa":
        return lambda q, k, v: gdpa_pallas(q, k, v, qo, ko, activation="silu", scale=0.3,
                                           fused_bwd=fused_bwd, **kw)
    return lambda q, k, v: jagged_attention_pallas(q, k, v, qo, ko, fused_bwd=fused_bwd, **kw)


def _count_fused(monkeypatch):
    calls = []
    real = triton_backward._backward_rows
    monkeypatch.setattr(triton_backward, "_backward_rows", lambda cfg, *a: (
        calls.append(cfg.fused_bwd) or real(cfg, *a)))
    return calls


def _check(mode, lens, fused_bwd, monkeypatch, dtype=jnp.float32, seed=0, tiles=None, **kw):
    """kw: masks (kernel and reference); tiles: FlashConfig overrides (kernel only)."""
    ql, kl = (np.asarray(x) for x in lens)
    tq, tk = (int(-(-x.sum() // 128) * 128) for x in (ql, kl))
    q, k, v, do = random_qkv(np.random.default_rng(seed), tq, tk, 2, 32, dtype)
    qo, ko = offsets_of(ql), offsets_of(kl)
    calls = _count_fused(monkeypatch)
    got = run_vjp(jax.jit(_fn(mode, qo, ko, fused_bwd, **kw, **(tiles or {}))), q, k, v, do)
    want = np_attention(q, k, v, do, qo, ko, mode=mode,
                        **(dict(activation="silu", scale=0.3) if mode == "gdpa" else
                           dict(scale=32 ** -0.5)), **kw)
    check_against(got, want, dtype, f"{mode} fused_bwd={fused_bwd}", q_end=qo[-1])
    return calls


@pytest.mark.parametrize("mode", ["gdpa", "softmax"])
@pytest.mark.parametrize("fused,lens", [
    ("k_rows", CROSS), ("k_rows", CROSS_ALIGNED), ("q_rows", PMA), ("q_rows", PMA_ALIGNED),
    ("k_rows", PMA), ("q_rows", CROSS)], ids=["k_rows-cross", "k_rows-cross_aligned",
                                              "q_rows-pma", "q_rows-pma_aligned",
                                              "k_rows-pma", "q_rows-cross"])
def test_rows_backward_matches_float64(mode, fused, lens, monkeypatch):
    """No atomics: rows owned by one tile of the other side come from that tile's program,
    the rest (straddling, empty) from their own kernel, whose tiles without such rows
    skip their loop; aligned, ragged and mismatched shapes; the path really ran."""
    assert _check(mode, lens, fused, monkeypatch) == [fused]


@functools.cache
def _cross_layout():
    """kernels.triton.layout.build_layout of CROSS (64-row query / 32-row key tiles), one
    jitted program (eager, each of its ops compiles alone), built once for the tests
    that read it."""
    from kernels.triton.layout import build_layout
    cfg = FlashConfig(mode="gdpa", bq=64, bk=32, bq_dkv=64, bk_dkv=32)
    return jax.jit(lambda qo, ko: build_layout(cfg, qo, ko, 384, 256, 32))(
        *(jnp.asarray(offsets_of(x)) for x in CROSS))


def test_row_owners_split_the_rows():
    """CROSS's query rows (k_rows over 32-key tiles): owned rows, straddling rows (keys
    31 + 33 across a tile edge) and empty rows; tiles that need the dQ kernel and
    tiles that do not."""
    from kernels.triton.layout import row_owners
    lay = _cross_layout()
    own, need = (np.asarray(x) for x in jax.jit(row_owners, static_argnums=(2, 3))(
        lay["q_start"], lay["q_end"], 32, 64))
    start, end = np.asarray(lay["q_start"]), np.asarray(lay["q_end"])
    span = (start < end) & (own < 0)
    assert (own >= 0).any() and span.any() and ((start >= end) & (own < 0)).any()
    np.testing.assert_array_equal(own[own >= 0], start[own >= 0] // 32)
    assert ((end - 1)[own >= 0] // 32 == own[own >= 0]).all()
    np.testing.assert_array_equal(need, span.reshape(-1, 64).any(axis=1))
    assert need.any() and not need.all()


@pytest.mark.parametrize("mode", ["gdpa", "softmax"])
def test_auto_fuses_short_sides_and_off_does_not(mode, monkeypatch):
    assert _check(mode, PMA, "auto", monkeypatch, seed=1) == ["q_rows"]
    assert _check(mode, CROSS, "auto", monkeypatch) == ["k_rows"]
    assert _check(mode, PMA, "off", monkeypatch, seed=2) == []
    assert _check(mode, CROSS, "off", monkeypatch, seed=3) == []


def test_fused_backward_bf16_and_masks(monkeypatch):
    """bf16 inputs (float32 accumulators, cast once), a causal window on both shapes."""
    assert _check("gdpa", CROSS, "k_rows", monkeypatch, dtype=jnp.bfloat16) == ["k_rows"]
    assert _check("gdpa", PMA, "q_rows", monkeypatch, dtype=jnp.bfloat16) == ["q_rows"]
    assert _check("softmax", PMA, "q_rows", monkeypatch, causal=True, window=9) == ["q_rows"]
    assert _check("softmax", CROSS, "k_rows", monkeypatch, causal=True, window=9) == ["k_rows"]


# long samples across many 32-query dK/dV steps (float32 tiles), so chunks split them
LONG_CROSS = ([300, 0, 5, 190, 33, 64, 1, 3], [32, 32, 0, 31, 33, 1, 17, 0])
LONG_SELF = ([300, 0, 1, 190, 33, 64], [300, 0, 1, 190, 33, 64])


@pytest.mark.parametrize("mode", ["gdpa", "softmax"])
@pytest.mark.parametrize("fused,lens,split", [
    ("off", LONG_CROSS, 2), ("k_rows", LONG_CROSS, 3), ("k_rows", CROSS_ALIGNED, 4),
    ("off", LONG_SELF, 3), ("q_rows", PMA, 2)],
    ids=["off-cross-2", "k_rows-cross-3", "k_rows-aligned-4", "off-self-3", "q_rows-pma-2"])
def test_dkv_split_matches_float64(mode, fused, lens, split, monkeypatch):
    """dkv_split: each key tile's query loop in `split` programs, their partial dK / dV
    summed after the kernel; chunks that are empty, that start or end inside the masked
    edge tiles, samples without keys or queries ("q_rows" keeps one program per tile)."""
    calls = _check(mode, lens, fused, monkeypatch, tiles=dict(dkv_split=split))
    assert calls == ([] if fused == "off" else [fused])


@pytest.mark.parametrize("mode", ["gdpa", "softmax"])
@pytest.mark.parametrize("fused,lens,split,top", [
    ("k_rows", LONG_CROSS, 2, 2), ("k_rows", LONG_CROSS, 3, 1), ("k_rows", CROSS_ALIGNED, 2, 99),
    ("off", LONG_SELF, 3, 2), ("off", LONG_CROSS, 4, 3)],
    ids=["k_rows-2-top2", "k_rows-3-top1", "k_rows-aligned-all", "off-self-3-top2",
         "off-cross-4-top3"])
def test_dkv_split_tiles_matches_float64(mode, fused, lens, split, top, monkeypatch):
    """dkv_split_tiles: only the first `top` tiles of the launch order split (their
    partials summed and scattered into dK / dV), the others stored whole; top past the
    tile count splits every tile through the same path."""
    calls = _check(mode, lens, fused, monkeypatch, seed=9,
                   tiles=dict(dkv_split=split, dkv_split_tiles=top))
    assert calls == ([] if fused == "off" else [fused])


def test_dkv_split_tiles_partials_hold_only_the_split_tiles(monkeypatch):
    """With 1 split tile the partial buffer holds 2 chunks of one 32-row tile (float32
    tiles), not 2 x Tk rows, for dK and for dV."""
    seen = []
    real = triton_backward._merge_top
    monkeypatch.setattr(triton_backward, "_merge_top", lambda direct, partial, perm, split, top, bk: (
        seen.append((partial.shape[0], direct.shape[0], top)) or
        real(direct, partial, perm, split, top, bk)))
    _check("gdpa", LONG_CROSS, "k_rows", monkeypatch, tiles=dict(dkv_split=2, dkv_split_tiles=1))
    assert seen == [(2 * 32, 256, 1)] * 2


def test_dkv_split_with_causal_window_and_bf16(monkeypatch):
    _check("softmax", LONG_SELF, "off", monkeypatch, causal=True, window=40,
           tiles=dict(dkv_split=3))
    _check("gdpa", LONG_CROSS, "k_rows", monkeypatch, dtype=jnp.bfloat16,
           tiles=dict(dkv_split=2))


@pytest.mark.parametrize("mode", ["gdpa", "softmax"])
@pytest.mark.parametrize("fused,lens,group", [
    ("k_rows", CROSS, 3), ("k_rows", CROSS_ALIGNED, 2), ("q_rows", PMA, 3),
    ("q_rows", PMA_ALIGNED, 4)],
    ids=["k_rows-cross-3", "k_rows-aligned-2", "q_rows-pma-3", "q_rows-pma_aligned-4"])
def test_rest_group_matches_float64(mode, fused, lens, group, monkeypatch):
    """rest_group: the kernel of the rows no other tile owns loops over `group` tiles per
    program (the last program's tail idle: 3 does not divide the tile counts here),
    with straddling rows (CROSS, PMA) and with none (aligned)."""
    assert _check(mode, lens, fused, monkeypatch, seed=8, tiles=dict(rest_group=group)) == [fused]


def test_rest_group_must_be_a_positive_int():
    q = jnp.zeros((128, 1, 32), jnp.float32)
    o = jnp.array([0, 128], jnp.int32)
    for bad in (0, -2, 2.0, False):
        with pytest.raises(ValueError, match="rest_group must be"):
            gdpa_pallas(q, q, q, o, o, rest_group=bad)
    for bad in (-1, 1.0, True):
        with pytest.raises(ValueError, match="dkv_split_tiles must be"):
            gdpa_pallas(q, q, q, o, o, dkv_split_tiles=bad)


def test_dkv_split_must_be_a_positive_int():
    q = jnp.zeros((128, 1, 32), jnp.float32)
    o = jnp.array([0, 128], jnp.int32)
    for bad in (0, -1, 1.5, True, "two"):
        with pytest.raises(ValueError, match="dkv_split must be"):
            gdpa_pallas(q, q, q, o, o, dkv_split=bad)


def test_backward_knobs_auto_split_the_heaviest_key_tiles_of_short_key_sides(monkeypatch):
    cfg = FlashConfig(mode="gdpa")
    for side, want in (("k_rows", (4, 32, 8)), ("q_rows", (1, 0, 8)), ("off", (1, 0, 1))):
        got = backward_knobs(dataclasses.replace(cfg, fused_bwd=side))
        assert (got.dkv_split, got.dkv_split_tiles, got.rest_group) == want, side
    got = backward_knobs(dataclasses.replace(cfg, fused_bwd="k_rows", dkv_split=3,
                                             dkv_split_tiles=0, rest_group=2))
    assert (got.dkv_split, got.dkv_split_tiles, got.rest_group) == (3, 0, 2)
    # end to end: the backward that ran on CROSS (auto: "k_rows") split its key tiles in 4
    splits = []
    real = triton_backward._dkv_outputs
    monkeypatch.setattr(triton_backward, "_dkv_outputs",
                        lambda k, split, *a: splits.append(split) or real(k, split, *a))
    assert _check("gdpa", LONG_CROSS, "auto", monkeypatch, seed=4) == ["k_rows"]
    assert splits == [4]


def test_fused_backward_side_resolution():
    cfg = FlashConfig(mode="gdpa")
    assert fused_backward_side(cfg, 82_000, 8192, 256) == "k_rows"  # W2: 32 keys each
    assert fused_backward_side(cfg, 4096, 150_000, 256) == "q_rows"  # W3: 16 queries each
    assert fused_backward_side(cfg, 45_056, 45_056, 64) == "off"    # W1: long both
    assert fused_backward_side(cfg, 8192, 4096, 256) == "q_rows"    # both short
    assert fused_backward_side(dataclasses.replace(cfg, fused_bwd="k_rows"), 1, 1, 1) == "k_rows"
    rope = FlashConfig(mode="softmax", rope=True)
    assert fused_backward_side(rope, 4096, 4096, 256) == "off"
    assert fused_backward_side(rope, 4096, 150_000, 256) == "off"
    for bad in ("q_rows", "k_rows"):
        with pytest.raises(ValueError, match="does not take RoPE"):
            fused_backward_side(FlashConfig(mode="softmax", rope=True, fused_bwd=bad), 1, 1, 1)
    for bad in ("yes", "k"):     # "k" (atomic dQ) was removed
        with pytest.raises(ValueError, match="fused_bwd must be"):
            fused_backward_side(FlashConfig(mode="gdpa", fused_bwd=bad), 1, 1, 1)


def _lognormal(rng, n, median, hi):
    return np.clip(rng.lognormal(np.log(median), 0.8, n).astype(int), 16, hi)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["gdpa", "softmax"])
@pytest.mark.parametrize("shape,fused", [("W2", "k_rows"), ("W3", "q_rows")])
def test_gpu_rows_backward_on_w2_w3_lengths(shape, fused, mode, monkeypatch):
    """fused_bwd="auto" takes "k_rows" on W2 (32 keys per sample: every query row owned
    by one key tile) and "q_rows" on W3 (16 queries: every key row by one query tile),
    64 samples, bf16, H=4, D=128, against the float64 formula."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    _gpu_case(shape, mode, "auto", monkeypatch, want_path=fused)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["gdpa", "softmax"])
@pytest.mark.parametrize("split", [2, 4])
def test_gpu_dkv_split_on_w2_lengths(split, mode, monkeypatch):
    """W2 (auto: "k_rows") with each key tile's query loop in `split` programs, bf16."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    _gpu_case("W2", mode, "auto", monkeypatch, want_path="k_rows", dkv_split=split)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["gdpa", "softmax"])
@pytest.mark.parametrize("shape,fused", [("W2", "k_rows"), ("W3", "q_rows")])
def test_gpu_rest_group_on_w2_w3_lengths(shape, fused, mode, monkeypatch):
    """rest_group=8 on W2 / W3 lengths (auto: "k_rows" / "q_rows"), bf16."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    _gpu_case(shape, mode, "auto", monkeypatch, want_path=fused, rest_group=8)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["gdpa", "softmax"])
@pytest.mark.parametrize("split,top,group", [(2, 32, 1), (4, 32, 8), (3, 5, 1)])
def test_gpu_dkv_split_tiles_on_w2_lengths(split, top, group, mode, monkeypatch):
    """W2 (auto: "k_rows") with only the `top` heaviest key tiles split, bf16."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    _gpu_case("W2", mode, "auto", monkeypatch, want_path="k_rows", dkv_split=split,
              dkv_split_tiles=top, rest_group=group)


def _gpu_case(shape, mode, fused, monkeypatch, want_path=None, **tiles):
    rng = np.random.default_rng(5)
    if shape == "W2":
        ql, kl = _lognormal(rng, 64, 256, 4096), np.full(64, 32)
        ql[:3] = [0, 1, 4096]                 # no queries, one, the clip
    else:
        ql, kl = np.full(64, 16), _lognormal(rng, 64, 512, 4096)
        kl[:3] = [0, 1, 4096]                 # no keys, one, the clip
    tq, tk = (int(-(-x.sum() // 128) * 128) for x in (ql, kl))
    q, k, v, do = random_qkv(rng, tq, tk, 4, 128, jnp.bfloat16)
    qo, ko = offsets_of(ql), offsets_of(kl)
    calls = _count_fused(monkeypatch)
    got = run_vjp(jax.jit(_fn(mode, qo, ko, fused, **tiles)), q, k, v, do)
    assert calls == [want_path or fused]
    want = np_attention(q, k, v, do, qo, ko, mode=mode,
                        **(dict(activation="silu", scale=0.3) if mode == "gdpa" else
                           dict(scale=128 ** -0.5)))
    check_against(got, want, jnp.bfloat16, f"{shape} {mode} fused_bwd={fused}", q_end=qo[-1])


def test_tiles_over_a_short_side_launch_in_order():
    """The launch order skips its sort where the inner loop runs over a short side (one
    or two tiles each); the other side stays heaviest-first."""
    lay = _cross_layout()
    np.testing.assert_array_equal(lay["q_perm"], np.arange(384 // 64))     # keys: 32 each
    work = np.asarray(lay["k_hi"] - lay["k_lo"])[np.asarray(lay["k_perm"])]
    assert np.all(np.diff(work) <= 0) and work[0] > work[-1]                # queries: long
