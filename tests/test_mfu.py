"""FLOP accounting: analytic counts vs XLA's cost analysis and brute-force pair counts; MFU formulas."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gemjax.train import mfu as M
from kernels.common import pair_mask


def _rand(*shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


def test_dense_and_mlp_match_xla_exactly():
    x, w = _rand(24, 40), _rand(40, 56, seed=1)
    assert M.xla_flops(lambda x, w: x @ w, x, w) == M.dense_flops(24, 40, 56) == 2 * 24 * 40 * 56
    ws = [_rand(40, 64, seed=2), _rand(64, 32, seed=3), _rand(32, 8, seed=4)]

    def mlp(x, ws):  # matmuls only: XLA's count must equal the analytic one
        for w in ws:
            x = x @ w
        return x

    assert M.xla_flops(mlp, x, ws) == M.mlp_flops(24, (40, 64, 32, 8))


def test_train_step_is_three_forwards():
    x, ws = _rand(32, 64), [_rand(64, 128, seed=1), _rand(128, 64, seed=2)]

    def fwd(ws, x):
        return (x @ ws[0]) @ ws[1]

    def step(ws, x, g):  # loss linear in the output with a random cotangent g: no extra matmuls
        return jax.value_and_grad(lambda ws, x: jnp.vdot(fwd(ws, x), g), argnums=(0, 1))(ws, x)

    analytic = M.train_step_flops(M.mlp_flops(32, (64, 128, 64)))
    xla = M.xla_flops(step, ws, x, _rand(32, 64, seed=3))
    assert analytic <= xla <= analytic * 1.02, (analytic, xla)


@pytest.mark.parametrize("f, l, hidden", [(4, 3, (64,)), (6, 0, ()), (0, 5, ())])
def test_wukong_layer_matches_xla(f, l, hidden):
    from gemjax.layers.wukong import WukongLayer
    b, n, d, k = 4, 48, 32, 16  # contractions long enough that matmuls dominate
    layer = WukongLayer(n, d, fmb_tokens=f, lcb_tokens=l, rank=k, mlp_hidden=hidden, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(layer)
    x = _rand(b, n, d)
    xla = M.xla_flops(lambda s, x: nnx.merge(graphdef, s)(x), state, x)
    analytic = M.wukong_layer_flops(b, n, d, fmb_tokens=f, lcb_tokens=l, rank=k, mlp_hidden=hidden)
    # XLA also counts norms, biases, relu: a little above the matmul count, never below
    assert analytic <= xla <= analytic * 1.12, (analytic, xla)
    # and the matmul-only count of the FMB by hand: X^T Y and X (X^T Y) are 2 B n d k each
    if f:
        assert M.wukong_layer_flops(b, n, d, fmb_tokens=f, lcb_tokens=0, rank=k, mlp_hidden=hidden) - \
            M.wukong_layer_flops(b, n, d, fmb_tokens=0, lcb_tokens=f, rank=k) == \
            4 * b * n * d * k + M.mlp_flops(b, (n * k, *hidden, f * d)) - 2 * b * f * n * d


def test_wukong_stack_sums_layers():
    kw = dict(fmb_tokens=3, lcb_tokens=2, rank=4, mlp_hidden=(16,))
    total = M.wukong_flops(8, 7, 16, num_layers=3, **kw)
    assert total == M.wukong_layer_flops(8, 7, 16, **kw) + 2 * M.wukong_layer_flops(8, 5, 16, **kw)


def test_attention_flops_match_xla_per_sample_dense():
    h, d = 2, 16
    lq, lk = [5, 0, 17, 2], [9, 3, 4, 3]  # (XLA rewrites 1x1 dots as reductions; length 1 is covered below)
    qs = [_rand(n, h, d, seed=i) for i, n in enumerate(lq)]
    ks = [_rand(n, h, d, seed=10 + i) for i, n in enumerate(lk)]

    def per_sample(qs, ks):  # each sample on its own exact-length dense attention
        outs = []
        for q, k in zip(qs, ks):
            if q.shape[0] == 0 or k.shape[0] == 0:
                continue
            s = jnp.einsum("qhd,khd->hqk", q, k)
            outs.append(jnp.einsum("hqk,khd->qhd", s, k))
        return outs

    assert M.xla_flops(per_sample, qs, ks) == M.attention_flops(lq, lk, heads=h, head_dim=d)
    assert M.attention_flops(lq, lk, heads=h, head_dim=d) == 4 * h * d * sum(a * b for a, b in zip(lq, lk))


@pytest.mark.parametrize("causal, window, block", [
    (False, None, None), (True, None, None), (True, 3, None), (False, 4, None), (False, None, 8),
    (True, None, 8), (True, 5, 8)])
def test_valid_pairs_match_brute_force_mask(causal, window, block):
    rng = np.random.default_rng(hash((causal, window, block)) % 2**32)
    lengths = [0, 1, 7, 8, 9, 16, 17] + list(rng.integers(0, 30, size=5))
    kv = lengths if (causal or block) else list(rng.integers(0, 30, size=len(lengths)))
    # brute force: explicit loops over positions, the kernels' mask convention
    brute = 0
    for a, b in zip(lengths, kv):
        for i in range(a):
            for j in range(b):
                ok = (not causal or j <= i)
                if window is not None:
                    ok &= (i - j < window) if causal else (abs(i - j) < window)
                if block is not None:
                    ok &= (i // block == j // block)
                brute += ok
    assert M.valid_pairs(lengths, kv, causal=causal, window=window, block=block) == brute
    if block is None and window is not None:  # also agrees with the kernels' own mask builder
        qo, ko = np.concatenate([[0], np.cumsum(lengths)]), np.concatenate([[0], np.cumsum(kv)])
        m = pair_mask(jnp.asarray(qo, jnp.int32), jnp.asarray(ko, jnp.int32), int(qo[-1]) + 3, int(ko[-1]) + 2,
                      causal, window)
        assert int(np.asarray(m).sum()) == brute


def test_valid_pairs_errors_and_empty():
    assert M.valid_pairs([]) == 0 and M.valid_pairs([0, 0]) == 0
    with pytest.raises(ValueError, match="must match"):
        M.valid_pairs([1, 2], [1])
    with pytest.raises(ValueError, match=">= 0"):
        M.valid_pairs([-1])
    assert M.embedding_flops(1000, 64) == 0


def test_mfu_local_mfu_scaling_ratio_by_hand():
    assert M.mfu(989e12, 2.0, 4, 989e12) == pytest.approx(0.125)
    # two layers: 3e12 FLOPs in 0.01 s (MFU 0.3033) and 1e12 in 0.01 s (0.1011); weights 3/4, 1/4
    peak = 989e12
    per = [3e12 / (0.01 * peak), 1e12 / (0.01 * peak)]
    assert M.local_mfu([3e12, 1e12], [0.01, 0.01], peak) == pytest.approx(0.75 * per[0] + 0.25 * per[1])
    assert M.scaling_ratio(0.2, 0.25) == pytest.approx(0.8)
    for bad in [(1.0, 0.0, 1, 1.0), (1.0, 1.0, 0, 1.0), (1.0, 1.0, 1, 0.0)]:
        with pytest.raises(ValueError, match="mfu"):
            M.mfu(*bad)
    with pytest.raises(ValueError, match="local_mfu"):
        M.local_mfu([1.0], [0.0], 1.0)


def test_peak_table_and_overrides():
    assert M.peak_flops("NVIDIA H200", "bf16") == 989e12
    assert M.peak_flops("NVIDIA H200", "fp8") == 1979e12
    assert M.peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert M.peak_flops("cpu", override=1e11) == 1e11
    with pytest.raises(ValueError, match="no peak FLOP/s for device kind 'cpu'"):
        M.peak_flops("cpu")
    with pytest.raises(ValueError, match="no 'fp8' peak"):
        M.peak_flops("NVIDIA A100-SXM4-80GB", "fp8")
    assert M.measure_peak_flops(n=64, repeats=1) > 0


def test_time_fn_and_local_mfu_report_with_a_fake_clock():
    ticks = iter(np.arange(0.0, 100.0, 0.5))  # every clock read advances 0.5 s -> each call "takes" 0.5 s
    calls = []

    def layer(x):
        calls.append(1)  # traced once; the jitted call runs without re-tracing
        return x * 2

    assert M.time_fn(layer, jnp.ones(4), warmup=1, iters=3, clock=lambda: next(ticks)) == 0.5
    assert len(calls) == 1
    fake = {"a": 2.0, "b": 1.0}
    report = M.local_mfu_report([("a", "fa", (), 8.0), ("b", "fb", (), 2.0)], peak=10.0,
                                timer=lambda fn, *args: fake[{"fa": "a", "fb": "b"}[fn]])
    assert [r["mfu"] for r in report["layers"]] == [pytest.approx(0.4), pytest.approx(0.2)]
    assert report["local_mfu"] == pytest.approx(0.8 * 0.4 + 0.2 * 0.2)
