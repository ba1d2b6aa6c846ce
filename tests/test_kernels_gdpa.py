"""gdpa vs the float64 per-sample numpy formula: forward and all gradients, every impl."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import gdpa
from kernels.gdpa import gdpa_reference, gdpa_reference_dense
from test_kernels_common import (assert_only_slice_changes, check_against, np_attention,
                                 offsets_of, random_qkv, run_vjp)

# lengths around the 64-token tile: 0, 1, block-1, block, block+1; all-padding tail
SELF = [0, 1, 63, 64, 65, 3]             # 196 tokens in capacity 256
CROSS_KV = [5, 0, 17, 32, 1, 33]          # short K/V per sample (sample 1: no keys)
PMA_Q = [16, 16, 16, 16, 16, 16]          # short learned queries, long K/V


def _case(rng, q_lens, kv_lens, tq, tk, h, d, dtype):
    q, k, v, do = random_qkv(rng, tq, tk, h, d, dtype)
    return q, k, v, do, offsets_of(q_lens), offsets_of(kv_lens)


def _check(impl, q_lens, kv_lens, tq, tk, *, dtype=jnp.float32, h=2, d=32, seed=0, **kw):
    q, k, v, do, qo, ko = _case(np.random.default_rng(seed), q_lens, kv_lens, tq, tk, h, d, dtype)
    if impl == "reference-chunked":
        fn = lambda q, k, v: gdpa_reference(q, k, v, jnp.asarray(qo), jnp.asarray(ko), chunk=48, **kw)
    elif impl == "dense":
        fn = lambda q, k, v: gdpa_reference_dense(q, k, v, jnp.asarray(qo), jnp.asarray(ko), **kw)
    else:
        fn = lambda q, k, v: gdpa(q, k, v, jnp.asarray(qo), jnp.asarray(ko), impl=impl, **kw)
    got = run_vjp(jax.jit(fn), q, k, v, do)
    want = np_attention(q, k, v, do, qo, ko, mode="gdpa", **kw)
    for g in got:
        assert g.dtype == dtype
    check_against(got, want, dtype, f"gdpa[{impl}] {kw}", q_end=qo[-1])


@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh", "relu", "identity"])
@pytest.mark.parametrize("impl", ["reference-chunked", "dense"])
def test_reference_self(impl, activation):
    _check(impl, SELF, SELF, 256, 256, activation=activation, scale=0.3)


@pytest.mark.parametrize("causal,window", [(True, None), (False, 7), (True, 9)])
def test_reference_masks(causal, window):
    _check("reference-chunked", SELF, SELF, 256, 256, causal=causal, window=window)


def test_reference_cross_and_pma():
    _check("reference-chunked", SELF, CROSS_KV, 256, 128, activation="gelu")
    _check("reference-chunked", PMA_Q, SELF, 128, 256, activation="silu", causal=True)


# Pallas in interpret mode on CPU (compiled on GPU): tiny shapes, interpret is slow.
@pytest.mark.parametrize("activation,causal,window", [
    ("silu", False, None), ("gelu", True, None), ("gelu_tanh", False, 5),
    ("relu", True, 9), ("identity", False, None)])
def test_pallas_self(activation, causal, window):
    _check("pallas", SELF, SELF, 256, 256, activation=activation, causal=causal, window=window,
           scale=0.25)


def test_pallas_cross_short_kv():
    _check("pallas", SELF, CROSS_KV, 256, 128, activation="silu")


def test_pallas_pma_short_q():
    _check("pallas", PMA_Q, SELF, 128, 256, activation="gelu_tanh", d=64, h=1)


@pytest.mark.parametrize("d", [8, 24, 48])
def test_pallas_pads_head_dims_the_tiles_do_not_take(d):
    """D zero-padded to a power of two (kernels.common.padded_head_dim), sliced back."""
    _check("pallas", SELF, CROSS_KV, 256, 128, d=d, activation="gelu", scale=0.2)


@pytest.mark.parametrize("activation", ["silu"])
def test_pallas_bf16(activation):  # 16-bit: the tanh.approx form (jnp.tanh in interpret mode)
    _check("pallas", SELF, SELF, 256, 256, dtype=jnp.bfloat16, activation=activation)


@pytest.mark.parametrize("causal,window", [(False, None), (True, 40)])
def test_pallas_interior_tiles(causal, window):
    """16-token tiles over long samples: most tiles are interior (mask skipped), fwd and bwd."""
    from kernels.dispatch import gdpa_pallas
    lens = [0, 100, 1, 63, 64, 65, 30]
    q, k, v, do, qo, ko = _case(np.random.default_rng(3), lens, lens, 384, 384, 1, 32,
                                jnp.float32)
    tiles = dict(bq=16, bk=16, bq_dkv=16, bk_dkv=32)
    kw = dict(activation="gelu_tanh", scale=0.2, causal=causal, window=window)
    fn = lambda q, k, v: gdpa_pallas(q, k, v, jnp.asarray(qo), jnp.asarray(ko), **kw, **tiles)
    got = run_vjp(jax.jit(fn), q, k, v, do)
    check_against(got, np_attention(q, k, v, do, qo, ko, mode="gdpa", **kw), jnp.float32,
                  f"gdpa interior {tiles} {kw}", q_end=qo[-1])


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
