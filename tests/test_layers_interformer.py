"""InterFormer: jagged cross-attention vs float64 numpy, and the layer stack's
isolation, padding invariance, empty samples and gradient flow."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gemjax.data.jagged import pack
from gemjax.layers.attention import JaggedCrossAttention
from gemjax.layers.interformer import InterFormer

D, H, N = 16, 2, 5
LENGTHS = [6, 0, 11, 1]


def np64(p):
    return np.asarray(p[...], np.float64)


def seqs(lengths=LENGTHS, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=(n, D)).astype(np.float32) for n in lengths]


@pytest.mark.parametrize("attention", ["gdpa", "softmax"])
def test_jagged_cross_attention_matches_numpy(attention):
    m = JaggedCrossAttention(D, H, kv_dim=8, attention=attention, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    q_list = [rng.normal(size=(n, D)) for n in (3, 2, 0, 4)]
    kv_list = [rng.normal(size=(n, 8)) for n in (5, 0, 2, 7)]
    jq, jk = pack([a.astype(np.float32) for a in q_list], 16), pack(
        [a.astype(np.float32) for a in kv_list], 16)
    got = np.asarray(nnx.jit(lambda m, a, b, c, d: m(a, b, c, d))(
        m, jnp.asarray(jq.values), jnp.asarray(jq.offsets), jnp.asarray(jk.values),
        jnp.asarray(jk.offsets)))
    lin = lambda p, v: v @ np64(p.kernel) + np64(p.bias)
    for i, (qs, ks) in enumerate(zip(q_list, kv_list)):
        rows = got[jq.offsets[i]:jq.offsets[i + 1]]
        if len(ks) == 0:
            assert np.all(rows == 0), "queries without keys must give 0"
            continue
        q = lin(m.q_proj, qs).reshape(len(qs), H, D // H)
        k = lin(m.k_proj, ks).reshape(len(ks), H, D // H)
        v = lin(m.v_proj, ks).reshape(len(ks), H, D // H)
        s = np.einsum("qhd,khd->hqk", q, k)
        if attention == "gdpa":
            p = s / (1 + np.exp(-s)) / len(ks)
        else:
            s = s / np.sqrt(D // H)
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
        ref = lin(m.out_proj, np.einsum("hqk,khd->qhd", p, v).reshape(len(qs), D))
        np.testing.assert_allclose(rows, ref, rtol=1e-4, atol=1e-4, err_msg=f"sample {i}")
    assert np.all(got[jq.offsets[-1]:] == 0)


@functools.lru_cache(maxsize=None)
def model(experts: bool, seq_attention: str = "softmax"):
    kw = dict(num_experts=2, top_k=1) if experts else {}
    return InterFormer(N, D, num_layers=1, num_heads=H, summary_tokens=3, cls_tokens=2,
                       pma_tokens=2, recent_tokens=2, mlp_hidden=(8,), rank=4,
                       cross_layer_attention=True, qk_norm=True, seq_attention=seq_attention,
                       block=4, rngs=nnx.Rngs(0), **kw)


run = nnx.jit(lambda m, x, s, j: m(x, s, j))


def test_interformer_isolation_padding_invariance_empty():
    experts = True
    m = model(True, "block")   # one model for all InterFormer tests: compiles dominate CPU time
    xs = seqs()
    x = jnp.asarray(np.random.default_rng(2).normal(size=(4, N, D)), jnp.float32)
    j16, j32 = pack(xs, capacity=32), pack(xs, capacity=64)
    out16, aux = run(m, x, jnp.asarray(j16.values), j16)
    out32, _ = run(m, x, jnp.asarray(j32.values), j32)
    assert out16.shape == (4, 3 + 2 + 2 + 2, D) and m.out_tokens == 9
    assert np.isfinite(np.asarray(out16)).all()
    np.testing.assert_allclose(np.asarray(out16), np.asarray(out32), rtol=1e-5, atol=1e-5)
    assert bool(aux) == experts

    # Sample 2's sequence changes: only sample 2's summary moves. Same for sample 0's x.
    xs2 = list(xs)
    xs2[2] = xs[2][::-1] * 1.5
    j2 = pack(xs2, capacity=32)
    out2, _ = run(m, x, jnp.asarray(j2.values), j2)
    x3 = x.at[0].multiply(-1.0)
    out3, _ = run(m, x3, jnp.asarray(j16.values), j16)
    for changed, o in ((2, out2), (0, out3)):
        diff = np.abs(np.asarray(o) - np.asarray(out16)).max(axis=(1, 2))
        assert diff[changed] > 1e-3
        np.testing.assert_array_equal(np.delete(diff, changed), 0.0)


def test_interformer_gradients_reach_every_parameter():
    m = model(True, "block")
    xs = seqs()
    j = pack(xs, capacity=32)
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.normal(size=(4, N, D)), jnp.float32)
    r = jnp.asarray(rng.normal(size=(4, 9, D)), jnp.float32)

    def loss(m):
        out, aux = m(x, jnp.asarray(j.values), j)
        return jnp.sum(out * r) + aux["load_balance_loss"]

    grads = nnx.jit(nnx.grad(loss))(m)
    for path, g in jax.tree_util.tree_leaves_with_path(nnx.state(grads, nnx.Param)):
        name = jax.tree_util.keystr(path)
        g = np.asarray(g)
        if "experts" in name:   # top-1 of 2 experts over 4 samples: an expert may go unused
            continue
        assert np.abs(g).max() > 0, f"no gradient reaches {name}"
    expert_g = [np.abs(np.asarray(g)).sum() for p, g in jax.tree_util.tree_leaves_with_path(
        nnx.state(grads, nnx.Param)) if "experts" in jax.tree_util.keystr(p)]
    assert expert_g and max(expert_g) > 0


def test_interformer_bad_inputs():
    m = model(True, "block")
    j = pack(seqs(), capacity=32)
    with pytest.raises(ValueError, match="samples"):
        m(jnp.zeros((3, N, D)), jnp.asarray(j.values), j)
    with pytest.raises(ValueError, match="cls_tokens"):
        InterFormer(N, D, num_layers=1, num_heads=H, cls_tokens=0, pma_tokens=0, recent_tokens=0,
                    rngs=nnx.Rngs(0))
