"""jagged_attention vs the float64 per-sample numpy softmax formula, forward and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import jagged_attention
from kernels.jagged_attention import jagged_attention_reference, jagged_attention_reference_dense
from test_kernels_common import (assert_only_slice_changes, check_against, np_attention,
                                 offsets_of, random_qkv, run_vjp)

SELF = [0, 1, 63, 64, 65, 3]
CROSS_KV = [5, 0, 17, 32, 1, 33]


def _check(impl, q_lens, kv_lens, tq, tk, *, dtype=jnp.float32, h=2, d=32, seed=0,
           sm_scale=None, **kw):
    rng = np.random.default_rng(seed)
    q, k, v, do = random_qkv(rng, tq, tk, h, d, dtype, scale=1.0)
    qo, ko = offsets_of(q_lens), offsets_of(kv_lens)
    args = (jnp.asarray(qo), jnp.asarray(ko))
    if impl == "reference-chunked":
        fn = lambda q, k, v: jagged_attention_reference(q, k, v, *args, sm_scale=sm_scale,
                                                        chunk=48, **kw)
    elif impl == "dense":
        fn = lambda q, k, v: jagged_attention_reference_dense(q, k, v, *args, sm_scale=sm_scale, **kw)
    else:
        fn = lambda q, k, v: jagged_attention(q, k, v, *args, sm_scale=sm_scale, impl=impl, **kw)
    got = run_vjp(jax.jit(fn), q, k, v, do)
    scale = d ** -0.5 if sm_scale is None else sm_scale
    want = np_attention(q, k, v, do, qo, ko, mode="softmax", scale=scale, **kw)
    check_against(got, want, dtype, f"jagged_attention[{impl}] {kw}", q_end=qo[-1])


@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, 7), (True, 9)])
@pytest.mark.parametrize("impl", ["reference-chunked", "dense"])
def test_reference(impl, causal, window):
    _check(impl, SELF, SELF, 256, 256, causal=causal, window=window)


def test_reference_cross():
    _check("reference-chunked", SELF, CROSS_KV, 256, 128, sm_scale=0.3)


@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (True, 5), (False, 9)])
def test_pallas(causal, window):
    _check("pallas", SELF, SELF, 256, 256, causal=causal, window=window)


def test_pallas_cross_with_empty_key_samples():
    _check("pallas", SELF, CROSS_KV, 256, 128, sm_scale=0.3)


@pytest.mark.parametrize("d", [8, 24])
def test_pallas_pads_head_dims_with_the_real_scale(d):
    """D zero-padded to a power of two; the default scale stays 1/sqrt(real D)."""
    _check("pallas", SELF, SELF, 256, 256, d=d, causal=True)


def test_pallas_bf16_d64():
    _check("pallas", SELF, SELF, 256, 256, dtype=jnp.bfloat16, d=64, h=1, causal=True)


@pytest.mark.parametrize("causal,window", [(True, None)])  # window: test_kernels_gdpa
def test_pallas_interior_tiles(causal, window):
    """16-token tiles over long samples: most tiles are interior (mask skipped), fwd and bwd."""
    from kernels.dispatch import jagged_attention_pallas
    lens = [0, 100, 1, 63, 64, 65, 30]
    rng = np.random.default_rng(3)
    q, k, v, do = random_qkv(rng, 384, 384, 1, 32, jnp.float32, scale=1.0)
    qo = ko = offsets_of(lens)
    tiles = dict(bq=16, bk=16, bq_dkv=32, bk_dkv=16)
    kw = dict(causal=causal, window=window)
    fn = lambda q, k, v: jagged_attention_pallas(q, k, v, jnp.asarray(qo), jnp.asarray(ko),
                                                 **kw, **tiles)
    got = run_vjp(jax.jit(fn), q, k, v, do)
    want = np_attention(q, k, v, do, qo, ko, mode="softmax", scale=32 ** -0.5, **kw)
    check_against(got, want, jnp.float32, f"softmax interior {tiles} {kw}", q_end=qo[-1])


@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_samples_are_isolated(impl):
    rng = np.random.default_rng(1)
    q, k, v, _ = random_qkv(rng, 256, 256, 2, 32, jnp.float32)
    off = jnp.asarray(offsets_of(SELF))
    f = jax.jit(lambda q, k, v: jagged_attention(q, k, v, off, off, impl=impl))
    sl = slice(int(off[3]), int(off[4]))
    assert_only_slice_changes(f, q, k, v, sl, rng)


def test_bad_inputs_name_the_input():
    q = jnp.zeros((16, 2, 32), jnp.float32)
    off = jnp.array([0, 4, 16], jnp.int32)
    with pytest.raises(ValueError, match="impl"):
        jagged_attention(q, q, q, off, off, impl="triton")
    with pytest.raises(ValueError, match="q and k must agree|must agree"):
        jagged_attention(q, q[:, :1], q[:, :1], off, off)
    with pytest.raises(ValueError, match="dtypes differ"):
        jagged_attention(q, q.astype(jnp.bfloat16), q, off, off)
    with pytest.raises(ValueError, match="causal"):
        jagged_attention(q, q, q, off, off, causal=1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal,window", [(False, None), (True, 128)])
def test_gpu_compiled(d, dtype, causal, window):
    rng = np.random.default_rng(3)
    lens = np.clip(rng.lognormal(np.log(300), 0.8, 12).astype(int), 0, 1500)
    lens[:3] = [0, 1, 65]
    t = int(-(-sum(lens) // 128) * 128 + 128)
    _check("pallas", lens, lens, t, t, dtype=dtype, h=3, d=d, causal=causal, window=window)
