"""The fused Triton backward (kernels/jagged_flash.py, FlashConfig.fused_bwd): one kernel
over one side's tiles computes every gradient and adds the other side's by float32
atomics ("k": over key tiles, the default for short query sides; "q": over query tiles).
Against the float64 per-sample formula, forward and gradients."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import jagged_flash
from kernels.gdpa.pallas import gdpa_pallas
from kernels.jagged_attention.pallas import jagged_attention_pallas
from kernels.jagged_flash import FlashConfig, fused_backward_side
from test_kernels_common import check_against, np_attention, offsets_of, random_qkv, run_vjp

# short sides at the 16 / 32-token tiles: 0, 1, tile - 1, tile, tile + 1; a sample with
# no keys (cross) or no queries (PMA); long sides across the 64-token tiles. Capacities
# (sums rounded up to 128) / 8 samples: 32 keys (cross) and 16 queries (PMA) per sample;
# fused_bwd="auto" fuses the PMA shape ("k").
CROSS = ([70, 0, 5, 130, 33, 64, 1, 3], [32, 32, 0, 31, 33, 1, 17, 0])   # (q lens, kv lens)
PMA = ([16, 16, 0, 15, 17, 1, 16, 16], [90, 0, 40, 129, 64, 1, 63, 5])


def _fn(mode, qo, ko, fused_bwd, **kw):
    qo, ko = jnp.asarray(qo), jnp.asarray(ko)
    if mode == "gdpa":
        return lambda q, k, v: gdpa_pallas(q, k, v, qo, ko, activation="silu", scale=0.3,
                                           fused_bwd=fused_bwd, **kw)
    return lambda q, k, v: jagged_attention_pallas(q, k, v, qo, ko, fused_bwd=fused_bwd, **kw)


def _count_fused(monkeypatch):
    calls, real = [], jagged_flash._backward_fused
    monkeypatch.setattr(jagged_flash, "_backward_fused",
                        lambda cfg, *a: calls.append(cfg.fused_bwd) or real(cfg, *a))
    return calls


def _check(mode, lens, fused_bwd, monkeypatch, dtype=jnp.float32, seed=0, **kw):
    ql, kl = (np.asarray(x) for x in lens)
    tq, tk = (int(-(-x.sum() // 128) * 128) for x in (ql, kl))
    q, k, v, do = random_qkv(np.random.default_rng(seed), tq, tk, 2, 32, dtype)
    qo, ko = offsets_of(ql), offsets_of(kl)
    calls = _count_fused(monkeypatch)
    got = run_vjp(jax.jit(_fn(mode, qo, ko, fused_bwd, **kw)), q, k, v, do)
    want = np_attention(q, k, v, do, qo, ko, mode=mode,
                        **(dict(activation="silu", scale=0.3) if mode == "gdpa" else
                           dict(scale=32 ** -0.5)), **kw)
    check_against(got, want, dtype, f"{mode} fused_bwd={fused_bwd}", q_end=qo[-1])
    return calls


@pytest.mark.parametrize("mode", ["gdpa", "softmax"])
@pytest.mark.parametrize("shape,fused", [("cross", "q"), ("cross", "k"), ("pma", "k"),
                                         ("pma", "q")])
def test_fused_backward_matches_float64(mode, shape, fused, monkeypatch):
    """Either side fused on either shape (the atomics add into whichever side is the
    other one), tile-edge and empty samples; the fused kernel really ran."""
    calls = _check(mode, CROSS if shape == "cross" else PMA, fused, monkeypatch)
    assert calls == [fused]


@pytest.mark.parametrize("mode", ["gdpa", "softmax"])
def test_auto_fuses_short_query_sides_only_and_off_does_not(mode, monkeypatch):
    assert _check(mode, PMA, "auto", monkeypatch, seed=1) == ["k"]
    assert _check(mode, CROSS, "auto", monkeypatch) == []
    assert _check(mode, PMA, "off", monkeypatch, seed=2) == []


def test_fused_backward_bf16_and_masks(monkeypatch):
    """bf16 inputs (float32 atomics, cast once), a causal window on the PMA shape."""
    assert _check("gdpa", CROSS, "q", monkeypatch, dtype=jnp.bfloat16) == ["q"]
    assert _check("softmax", PMA, "k", monkeypatch, causal=True, window=9) == ["k"]


def test_fused_backward_side_resolution(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    cfg = FlashConfig(mode="gdpa")
    assert fused_backward_side(cfg, 82_000, 8192, 256) == "off"     # W2: "q" measured slower
    assert fused_backward_side(cfg, 4096, 150_000, 256) == "k"      # W3: 16 queries each
    assert fused_backward_side(cfg, 45_056, 45_056, 64) == "off"    # W1: long both
    assert fused_backward_side(cfg, 8192, 4096, 256) == "k"         # both short
    assert fused_backward_side(dataclasses.replace(cfg, fused_bwd="q"), 1, 1, 1) == "q"
    rope = FlashConfig(mode="softmax", rope=True)
    assert fused_backward_side(rope, 4096, 4096, 256) == "off"
    with pytest.raises(ValueError, match="does not take RoPE"):
        fused_backward_side(FlashConfig(mode="softmax", rope=True, fused_bwd="q"), 1, 1, 1)
    with pytest.raises(ValueError, match="fused_bwd must be"):
        fused_backward_side(FlashConfig(mode="gdpa", fused_bwd="yes"), 1, 1, 1)
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_deterministic_ops=true")
    assert fused_backward_side(cfg, 4096, 150_000, 256) == "off"    # atomics: no fixed order


def _lognormal(rng, n, median, hi):
    return np.clip(rng.lognormal(np.log(median), 0.8, n).astype(int), 16, hi)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["gdpa", "softmax"])
@pytest.mark.parametrize("shape", ["W2", "W3"])
def test_gpu_fused_backward_on_w2_w3_lengths(shape, mode, monkeypatch):
    """bf16, H=4, D=128 on the issue's cross (32 keys) and PMA (16 queries) workloads,
    64 samples, against the float64 formula: W2 with fused_bwd="q", W3 with the
    default (auto: "k")."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
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
    got = run_vjp(jax.jit(_fn(mode, qo, ko, "q" if shape == "W2" else "auto")), q, k, v, do)
    assert calls == ["q" if shape == "W2" else "k"]
    want = np_attention(q, k, v, do, qo, ko, mode=mode,
                        **(dict(activation="silu", scale=0.3) if mode == "gdpa" else
                           dict(scale=128 ** -0.5)))
    check_against(got, want, jnp.bfloat16, f"{shape} {mode} fused", q_end=qo[-1])


def test_tiles_over_a_short_side_launch_in_order():
    """The launch order skips its sort where the inner loop runs over a short side (one
    or two tiles each); the other side stays heaviest-first."""
    from kernels.jagged_flash import build_layout
    ql, kl = CROSS
    cfg = FlashConfig(mode="gdpa", bq=64, bk=32, bq_dkv=64, bk_dkv=32)
    lay = build_layout(cfg, jnp.asarray(offsets_of(ql)), jnp.asarray(offsets_of(kl)), 384, 256, 32)
    np.testing.assert_array_equal(lay["q_perm"], np.arange(384 // 64))     # keys: 32 each
    work = np.asarray(lay["k_hi"] - lay["k_lo"])[np.asarray(lay["k_perm"])]
    assert np.all(np.diff(work) <= 0) and work[0] > work[-1]                # queries: long
