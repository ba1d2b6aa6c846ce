"""gdpa vs the float64 per-sample numpy formula: forward and all gradients, every impl."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import gdpa
from kernels.gdpa import gdpa_reference, gdpa_reference_dense
from test_kernels_common import (assert_only_slice_changes, check_against, np_attention,
                                 offsets_of, random_qkv, vjp_outputs)

# lengths around the 64-token tile: 0, 1, block-1, block, block+1; all-padding tail
SELF = [0, 1, 63, 64, 65, 3]             # 196 tokens in capacity 256
CROSS_KV = [5, 0, 17, 32, 1, 33]          # short K/V per sample (sample 1: no keys)
PMA_Q = [16, 16, 16, 16, 16, 16]          # short learned queries, long K/V


def _case(rng, q_lens, kv_lens, tq, tk, h, d, dtype):
    q, k, v, do = random_qkv(rng, tq, tk, h, d, dtype)
    return q, k, v, do, offsets_of(q_lens), offsets_of(kv_lens)


def _check(impl, q_lens, kv_lens, tq, tk, *, dtype=jnp.float32, h=2, d=32, seed=0, **kw):
    _check_all([dict(impl=impl, q_lens=q_lens, kv_lens=kv_lens, tq=tq, tk=tk, dtype=dtype, h=h,
                     d=d, seed=seed, **kw)])


def _check_all(cases):
    """Each case (dict: impl, q_lens, kv_lens, tq, tk, optional dtype, h, d, seed, gdpa
    keywords) against the float64 formula, out and all gradients; every case in one
    jitted program (its kernels compile together)."""
    runs, args = [], []
    for c in cases:
        c = dict(c)
        impl, ql, kl, tq, tk = (c.pop(x) for x in ("impl", "q_lens", "kv_lens", "tq", "tk"))
        dtype, h, d, seed = (c.pop("dtype", jnp.float32), c.pop("h", 2), c.pop("d", 32),
                             c.pop("seed", 0))
        q, k, v, do, qo, ko = _case(np.random.default_rng(seed), ql, kl, tq, tk, h, d, dtype)
        qo_, ko_ = jnp.asarray(qo), jnp.asarray(ko)
        if impl == "reference-chunked":
            fn = lambda q, k, v, qo_=qo_, ko_=ko_, c=c: gdpa_reference(q, k, v, qo_, ko_,
                                                                        chunk=48, **c)
        elif impl == "dense":
            fn = lambda q, k, v, qo_=qo_, ko_=ko_, c=c: gdpa_reference_dense(q, k, v, qo_, ko_, **c)
        elif impl == "interior":   # 16-token tiles: most tiles of long samples interior
            from kernels.dispatch import gdpa_pallas
            fn = lambda q, k, v, qo_=qo_, ko_=ko_, c=c: gdpa_pallas(
                q, k, v, qo_, ko_, bq=16, bk=16, bq_dkv=16, bk_dkv=32, **c)
        else:
            fn = lambda q, k, v, qo_=qo_, ko_=ko_, c=c, impl=impl: gdpa(q, k, v, qo_, ko_,
                                                                         impl=impl, **c)
        runs.append((impl, dtype, qo, ko, c, fn))
        args.append((q, k, v, do))
    got = jax.jit(lambda args: [vjp_outputs(r[-1], *a) for r, a in zip(runs, args)])(args)
    for (impl, dtype, qo, ko, kw, _), a, g in zip(runs, args, got):
        want = np_attention(*a, qo, ko, mode="gdpa", **kw)
        for x in g:
            assert x.dtype == dtype
        check_against(g, want, dtype, f"gdpa[{impl}] {kw}", q_end=qo[-1])


ACTIVATIONS = ["silu", "gelu", "gelu_tanh", "relu", "identity"]


@pytest.mark.parametrize("impl", ["reference-chunked", "dense"])
def test_reference_self(impl):
    """Every activation, self layout (one program)."""
    _check_all([dict(impl=impl, q_lens=SELF, kv_lens=SELF, tq=256, tk=256, activation=a,
                     scale=0.3) for a in ACTIVATIONS])


def test_reference_masks_cross_and_pma():
    """The chunked reference: causal, window, both; cross (short K/V) and PMA (short Q)."""
    _check_all([dict(impl="reference-chunked", q_lens=SELF, kv_lens=SELF, tq=256, tk=256,
                     causal=c, window=w) for c, w in [(True, None), (False, 7), (True, 9)]] + [
        dict(impl="reference-chunked", q_lens=SELF, kv_lens=CROSS_KV, tq=256, tk=128,
             activation="gelu"),
        dict(impl="reference-chunked", q_lens=PMA_Q, kv_lens=SELF, tq=128, tk=256,
             activation="silu", causal=True)])


# Pallas in interpret mode on CPU (compiled on GPU): tiny shapes, interpret is slow. Each
# activation and each mask runs once (silu: the cross and bf16 cases; gelu_tanh: PMA and
# the interior tiles; identity: a padded head dim).
def test_pallas_matches_float64():
    """Self (masks: causal, window, both), cross with short K/V (a sample without keys),
    PMA (short Q, D = 64, one head), bf16 (16-bit: the tanh.approx form, jnp.tanh in
    interpret mode); head dims the tiles do not take, zero-padded to a power of two
    (kernels.common.padded_head_dim: 8 -> 32, 48 -> 64) and sliced back."""
    _check_all([dict(impl="pallas", q_lens=SELF, kv_lens=SELF, tq=256, tk=256,
                     activation=a, causal=c, window=w, scale=0.25)
                for a, c, w in [("gelu", True, None), ("gelu_tanh", False, 5), ("relu", True, 9)]] + [
        dict(impl="pallas", q_lens=SELF, kv_lens=CROSS_KV, tq=256, tk=128, activation="silu"),
        dict(impl="pallas", q_lens=PMA_Q, kv_lens=SELF, tq=128, tk=256,
             activation="gelu_tanh", d=64, h=1),
        dict(impl="pallas", q_lens=SELF, kv_lens=CROSS_KV, tq=256, tk=128, d=8,
             activation="gelu", scale=0.2),
        dict(impl="pallas", q_lens=SELF, kv_lens=CROSS_KV, tq=256, tk=128, d=48,
             activation="identity", scale=0.2),
        dict(impl="pallas", q_lens=SELF, kv_lens=SELF, tq=256, tk=256, dtype=jnp.bfloat16,
             activation="silu")])


def test_pallas_interior_tiles():
    """16-token tiles over long samples: most tiles are interior (mask skipped), fwd and
    bwd, unmasked and with a causal window."""
    lens = [0, 100, 1, 63, 64, 65, 30]
    _check_all([dict(impl="interior", q_lens=lens, kv_lens=lens, tq=384, tk=384, h=1, d=32,
                     seed=3, activation="gelu_tanh", scale=0.2, causal=c, window=w)
                for c, w in [(False, None), (True, 40)]])


@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_samples_are_isolated(impl):
    """Changing sample 2's q, k and v leaves every other sample's output unchanged."""
    rng = np.random.default_rng(1)
    q, k, v, _, qo, ko = _case(rng, SELF, SELF, 256, 256, 2, 32, jnp.float32)
    f = jax.jit(lambda q, k, v: gdpa(q, k, v, jnp.asarray(qo), jnp.asarray(ko), impl=impl))
    sl = slice(qo[2], qo[3])
    assert_only_slice_changes(f, q, k, v, sl, rng)


def test_no_samples_gives_zeros():
    q = jnp.ones((128, 1, 32), jnp.float32)
    off = jnp.zeros((1,), jnp.int32)
    for impl in ("reference", "pallas"):
        np.testing.assert_array_equal(gdpa(q, q, q, off, off, impl=impl), 0)


def test_bad_inputs_name_the_input():
    q = jnp.zeros((16, 2, 32), jnp.float32)
    off = jnp.array([0, 4, 16], jnp.int32)
    with pytest.raises(ValueError, match="impl"):
        gdpa(q, q, q, off, off, impl="cuda")
    with pytest.raises(ValueError, match="activation"):
        gdpa(q, q, q, off, off, activation="tanh")
    with pytest.raises(ValueError, match="q must be"):
        gdpa(q[0], q, q, off, off)
    with pytest.raises(ValueError, match="k .* and v"):
        gdpa(q, q, q[:8], off, off)
    with pytest.raises(ValueError, match="kv_offsets"):
        gdpa(q, q, q, off, off[:2])
    with pytest.raises(ValueError, match="q_offsets must be integer"):
        gdpa(q, q, q, off.astype(jnp.float32), off)
    with pytest.raises(ValueError, match="window"):
        gdpa(q, q, q, off, off, window=0)
    q130 = jnp.zeros(q.shape[:2] + (130,), q.dtype)  # past the largest padded head dim (128)
    with pytest.raises(ValueError, match="head dim"):
        gdpa(q130, q130, q130, off, off, impl="pallas")


# ---------------------------------------------------------------- GPU, real sizes

def _lognormal_lengths(rng, n, median, cap):
    return np.clip(rng.lognormal(np.log(median), 0.8, n).astype(int), 0, cap)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [8, 24, 96])
def test_gpu_padded_head_dims(d):
    rng = np.random.default_rng(4)
    lens = _lognormal_lengths(rng, 12, 300, 1500)
    lens[:3] = [0, 1, 64]
    t = int(-(-lens.sum() // 128) * 128)
    _check("pallas", lens, lens, t, t, d=d, h=2, dtype=jnp.bfloat16, activation="silu", scale=1 / 1500)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("shape", ["self", "cross", "pma"])
def test_gpu_compiled(shape, d, dtype):
    rng = np.random.default_rng(2)
    lens = _lognormal_lengths(rng, 12, 300, 1500)
    lens[:3] = [0, 1, 64]
    if shape == "self":
        ql, kl, kw = lens, lens, dict(activation="silu", scale=1 / 1500)
    elif shape == "cross":
        ql, kl, kw = lens, np.full(12, 32), dict(activation="gelu", scale=0.05)
    else:
        ql, kl, kw = np.full(12, 16), lens, dict(activation="gelu_tanh", scale=1 / 1500,
                                                 causal=False, window=200)
    tq = int(-(-sum(ql) // 128) * 128 + 128)
    tk = int(-(-sum(kl) // 128) * 128)
    _check("pallas", ql, kl, tq, tk, dtype=dtype, h=3, d=d, **kw)
