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
from test_kernels_common import (check_against, np_attention, offsets_of, random_qkv, run_vjp,
                                 vjp_outputs)

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
    """kw: masks (kernel and reference); tiles: FlashConfig overrides (kernel only). The
    fused paths the backward took."""
    return _check_all([dict(mode=mode, lens=lens, fused=fused_bwd, dtype=dtype, seed=seed,
                            tiles=tiles, **kw)], monkeypatch)[0]


def _check_all(cases, monkeypatch, on_case=None):
    """Each case (dict: mode, lens, fused, dtype, seed, tiles, masks) against the float64
    formula, out and all gradients, every case in one jitted program (the kernels compile
    once, together). The fused paths each case's backward took, in order; on_case(i), if
    given, is called while case i traces."""
    calls = _count_fused(monkeypatch)
    runs, args = [], []
    for c in cases:
        c = dict(c)
        mode, fused = c.pop("mode"), c.pop("fused")
        ql, kl = (np.asarray(x) for x in c.pop("lens"))
        dtype, tiles = c.pop("dtype", jnp.float32), c.pop("tiles", None) or {}
        tq, tk = (int(-(-x.sum() // 128) * 128) for x in (ql, kl))
        args.append(random_qkv(np.random.default_rng(c.pop("seed", 0)), tq, tk, 2, 32, dtype))
        qo, ko = offsets_of(ql), offsets_of(kl)
        runs.append((mode, fused, dtype, qo, ko, c, _fn(mode, qo, ko, fused, **c, **tiles)))
    paths = []

    def all_cases(args):
        outs = []
        for i, (run, a) in enumerate(zip(runs, args)):
            n = len(calls)
            if on_case is not None:
                on_case(i)
            outs.append(vjp_outputs(run[-1], *a))
            paths.append(calls[n:])
        return outs
    got = jax.jit(all_cases)(args)
    for (mode, fused, dtype, qo, ko, kw, _), a, g in zip(runs, args, got):
        want = np_attention(*a, qo, ko, mode=mode,
                            **(dict(activation="silu", scale=0.3) if mode == "gdpa" else
                               dict(scale=32 ** -0.5)), **kw)
        check_against(g, want, dtype, f"{mode} fused_bwd={fused} {kw}", q_end=qo[-1])
    return paths


def _case(mode, lens, fused, **kw):
    return dict(mode=mode, lens=lens, fused=fused, **kw)


# (case, the fused path it takes); each mode: both sides picked by "auto" (their default
# knobs: rest_group 8), an aligned short side, a mismatched side (the fused path on the
# long side), "off"; bf16 inputs (float32 accumulators, cast once); a causal window on
# both shapes. The aligned and mismatched cases set rest_group (the kernel of the rows no
# other tile owns loops over `group` tiles per program; 3 does not divide the tile counts
# here, so the last program's tail idles): straddling rows (mismatched) and none
# (aligned), each side in each mode; dkv_split on the aligned "q_rows" (ignored: one
# program per key tile). (gdpa's "auto" on the 32-key side:
# test_backward_knobs_auto_split_the_heaviest_key_tiles_of_short_key_sides, in bf16.)
ROWS = {
    "gdpa": [(_case("gdpa", PMA, "auto", seed=1, dtype=jnp.bfloat16), "q_rows"),
             (_case("gdpa", CROSS_ALIGNED, "k_rows", tiles=dict(rest_group=2)), "k_rows"),
             (_case("gdpa", CROSS, "q_rows", tiles=dict(rest_group=3)), "q_rows"),
             (_case("gdpa", PMA, "off", seed=2), None)],
    "softmax": [(_case("softmax", CROSS, "auto", causal=True, window=9), "k_rows"),
                (_case("softmax", PMA, "auto", seed=1, causal=True, window=9), "q_rows"),
                (_case("softmax", PMA_ALIGNED, "q_rows", tiles=dict(rest_group=4, dkv_split=2)),
                 "q_rows"),
                (_case("softmax", PMA, "k_rows", tiles=dict(rest_group=3)), "k_rows"),
                (_case("softmax", CROSS, "off", seed=3), None)],
}


@pytest.mark.parametrize("mode", ["gdpa", "softmax"])
def test_rows_backward_matches_float64(mode, monkeypatch):
    """No atomics: rows owned by one tile of the other side come from that tile's program,
    the rest (straddling, empty) from their own kernel, whose tiles without such rows
    skip their loop; aligned, ragged and mismatched shapes; "auto" fuses the short side
    (32 keys: "k_rows", 16 queries: "q_rows"), "off" fuses nothing; bf16; causal windows;
    rest_group (ROWS); the path really ran."""
    paths = _check_all([c for c, _ in ROWS[mode]], monkeypatch)
    assert paths == [[] if p is None else [p] for _, p in ROWS[mode]]


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


# long samples across many 32-query dK/dV steps (float32 tiles), so chunks split them
LONG_CROSS = ([300, 0, 5, 190, 33, 64, 1, 3], [32, 32, 0, 31, 33, 1, 17, 0])
LONG_SELF = ([300, 0, 1, 190, 33, 64], [300, 0, 1, 190, 33, 64])


def test_dkv_split_matches_float64(monkeypatch):
    """dkv_split: each key tile's query loop in `split` programs, their partial dK / dV
    summed after the kernel; chunks that are empty, that start or end inside the masked
    edge tiles, samples without keys or queries; cross and self layouts ("q_rows", which
    keeps one program per tile: test_rows_backward_matches_float64). Each mode runs the
    unfused backward split here; the fused one ("k_rows", whose split tiles merge through
    dkv_split_tiles' path) in test_dkv_split_tiles_matches_float64 in each mode, and in
    bf16 in test_backward_knobs_auto_split_the_heaviest_key_tiles_of_short_key_sides; a
    causal window. The split itself does not depend on the mode (its query loop is the
    dK / dV kernel's)."""
    cases = [  # (mode, lens, fused, split, extra)
        ("gdpa", LONG_CROSS, "off", 2, {}),
        ("softmax", LONG_SELF, "off", 3, dict(causal=True, window=40))]
    paths = _check_all([_case(m, lens, f, tiles=dict(dkv_split=s), **x)
                        for m, lens, f, s, x in cases], monkeypatch)
    assert paths == [[] if f == "off" else [f] for _, _, f, _, _ in cases]


def test_dkv_split_tiles_matches_float64(monkeypatch):
    """dkv_split_tiles: only the first `top` tiles of the launch order split (their
    partials summed and scattered into dK / dV), the others stored whole; top past the
    tile count splits every tile through the same path (aligned keys, split in 4); each
    mode fused and unfused. With 1 split tile the partial buffer holds 2 chunks of one
    32-row tile (float32 tiles), not 2 x Tk rows, for dK and for dV."""
    cases = [  # (mode, fused, lens, split, top)
        ("gdpa", "k_rows", LONG_CROSS, 2, 1), ("gdpa", "k_rows", CROSS_ALIGNED, 4, 99),
        ("gdpa", "off", LONG_CROSS, 4, 3), ("softmax", "k_rows", LONG_CROSS, 3, 2),
        ("softmax", "off", LONG_SELF, 3, 2)]
    seen, case = [], []
    real = triton_backward._merge_top
    monkeypatch.setattr(triton_backward, "_merge_top", lambda direct, partial, perm, split, top, bk: (
        seen.append((case[-1], partial.shape[0], direct.shape[0], top)) or
        real(direct, partial, perm, split, top, bk)))
    paths = _check_all([_case(m, lens, f, seed=9, tiles=dict(dkv_split=s, dkv_split_tiles=t))
                        for m, f, lens, s, t in cases], monkeypatch, on_case=case.append)
    assert paths == [[] if c[1] == "off" else [c[1]] for c in cases]
    assert [x[1:] for x in seen if x[0] == 0] == [(2 * 32, 256, 1)] * 2


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
    # end to end: the backward that ran on LONG_CROSS (CROSS's keys; auto: "k_rows") split
    # its key tiles in 4; bf16 inputs
    splits = []
    real = triton_backward._dkv_outputs
    monkeypatch.setattr(triton_backward, "_dkv_outputs",
                        lambda k, split, *a: splits.append(split) or real(k, split, *a))
    assert _check("gdpa", LONG_CROSS, "auto", monkeypatch, seed=4, dtype=jnp.bfloat16) == ["k_rows"]
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
