"""Jagged self-attention and SequenceEncoder: numpy per-sample references, isolation,
padding invariance, empty samples, gradients, pooling helpers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gemjax.data.jagged import pack
from gemjax.layers.attention import JaggedSelfAttention, rope
from gemjax.layers.sequence import SequenceEncoder, last_tokens, mean_pool

LENGTHS = [5, 0, 9, 1, 4, 7]
D, H = 16, 2


def seqs(lengths=LENGTHS, d=D, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=(n, d)).astype(np.float32) for n in lengths]


def np64(p):
    return np.asarray(p[...], np.float64)


def rope_np(x, pos, theta=10_000.0):
    half = x.shape[-1] // 2
    freq = theta ** (-np.arange(half) / half)
    ang = pos[:, None] * freq[None]
    c, s = np.cos(ang)[:, None], np.sin(ang)[:, None]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * c - x2 * s, x1 * s + x2 * c], -1)


def attention_np(x, m: JaggedSelfAttention, kind, causal=False, window=None, block=None,
                 use_rope=False, qk_norm=False):
    """One sample's attention, dense float64: x [L, D] -> [L, D]."""
    n = x.shape[0]
    lin = lambda p, v: v @ np64(p.kernel) + np64(p.bias)
    q, k, v = (lin(p, x).reshape(n, H, D // H) for p in (m.q_proj, m.k_proj, m.v_proj))
    if qk_norm:
        rms = lambda t, nrm: t / np.sqrt((t ** 2).mean(-1, keepdims=True) + 1e-6) * np64(nrm.scale)
        q, k = rms(q, m.q_norm), rms(k, m.k_norm)
    pos = np.arange(n)
    if use_rope:
        q, k = rope_np(q, pos), rope_np(k, pos)
    s = np.einsum("qhd,khd->hqk", q, k)
    diff = pos[:, None] - pos[None, :]
    allowed = np.ones((n, n), bool)
    if causal:
        allowed &= diff >= 0
    if window is not None:
        allowed &= (diff < window) if causal else (np.abs(diff) < window)
    if block is not None:
        allowed &= (pos[:, None] // block) == (pos[None, :] // block)
    if kind == "gdpa":
        p = np.where(allowed, s / (1 + np.exp(-s)), 0.0) / max(n, 1)
    else:
        s = np.where(allowed, s / np.sqrt(D // H), -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p = p / p.sum(-1, keepdims=True)
    o = np.einsum("hqk,khd->qhd", p, v).reshape(n, D)
    return lin(m.out_proj, o)


CASES = [
    dict(attention="softmax"),
    dict(attention="softmax", causal=True),
    dict(attention="softmax", window=3),
    dict(attention="softmax", causal=True, window=2, rope=True, qk_norm=True),
    dict(attention="gdpa"),
    dict(attention="gdpa", causal=True, qk_norm=True),
    dict(attention="block", block=4),
]


@pytest.mark.parametrize("kw", CASES, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_attention_matches_numpy_per_sample(kw):
    m = JaggedSelfAttention(D, H, rngs=nnx.Rngs(0), **kw)
    if kw.get("qk_norm"):
        for nrm in (m.q_norm, m.k_norm):
            nrm.scale[...] = jnp.asarray(np.random.default_rng(1).uniform(0.5, 1.5, D // H),
                                         jnp.float32)
    xs = seqs()
    j = pack(xs, capacity=32)
    got = np.asarray(nnx.jit(lambda m, x, j: m(x, j))(m, jnp.asarray(j.values), j))
    off = j.offsets
    for i, x in enumerate(xs):
        if len(x) == 0:
            continue
        ref = attention_np(x.astype(np.float64), m, kw["attention"], kw.get("causal", False),
                           kw.get("window"), kw.get("block"),
                           kw.get("rope", False) or kw["attention"] == "block",
                           kw.get("qk_norm", False))
        np.testing.assert_allclose(got[off[i]:off[i + 1]], ref, rtol=1e-4, atol=1e-4,
                                   err_msg=f"sample {i}")
    assert np.all(got[off[-1]:] == 0), "padding rows must be 0"


def test_rope_scores_depend_only_on_relative_position():
    rng = np.random.default_rng(0)
    q, k = (jnp.asarray(rng.normal(size=(1, 1, 8)), jnp.float32) for _ in range(2))
    score = lambda a, b: float(jnp.sum(rope(q, jnp.array([a])) * rope(k, jnp.array([b]))))
    assert score(7, 3) == pytest.approx(score(104, 100), abs=1e-4)
    assert score(7, 3) != pytest.approx(score(7, 5), abs=1e-3)


def encoder(attention="softmax", **kw):
    return SequenceEncoder(D, num_layers=2, num_heads=H, attention=attention, rngs=nnx.Rngs(0),
                           **kw)


run = nnx.jit(lambda m, x, j: m(x, j))


@pytest.mark.parametrize("attention,kw", [("softmax", dict(causal=True)),
                                          ("gdpa", dict(qk_norm=True, rope=True)),
                                          ("block", dict(block=4))])
def test_encoder_isolation_padding_invariance_empty_samples(attention, kw):
    model = encoder(attention, **kw)
    xs = seqs()
    j32, j64 = pack(xs, capacity=32), pack(xs, capacity=64)
    x64 = np.asarray(j64.values).copy()
    x64[j64.offsets[-1]:] = 7.0                       # garbage in padding rows must not matter
    y32 = np.asarray(run(model, jnp.asarray(j32.values), j32))
    y64 = np.asarray(run(model, jnp.asarray(x64), j64))
    n = j32.offsets[-1]
    np.testing.assert_allclose(y32[:n], y64[:n], rtol=1e-5, atol=1e-5)
    assert np.all(y32[n:] == 0) and np.all(y64[n:] == 0)
    assert np.isfinite(y32).all()

    # Changing sample 2's tokens changes sample 2's outputs and nobody else's.
    xs2 = list(xs)
    xs2[2] = xs[2] * np.linspace(0.5, 2.0, D, dtype=np.float32)
    j2 = pack(xs2, capacity=32)
    y2 = np.asarray(run(model, jnp.asarray(j2.values), j2))
    off = j32.offsets
    for i in range(len(xs)):
        sl = slice(off[i], off[i + 1])
        if i == 2:
            assert np.abs(y2[sl] - y32[sl]).max() > 1e-3
        else:
            np.testing.assert_array_equal(y2[sl], y32[sl], err_msg=f"sample {i} changed")

    # A sample encoded alone gives what it gives inside the batch.
    alone = pack([xs[2]], capacity=16)
    ya = np.asarray(run(model, jnp.asarray(alone.values), alone))
    np.testing.assert_allclose(ya[:len(xs[2])], y32[off[2]:off[3]], rtol=1e-5, atol=1e-5)


def test_encoder_all_empty_batch():
    j = pack(seqs([0, 0, 0]), capacity=16)
    y = run(encoder("gdpa"), jnp.asarray(j.values), j)
    assert y.shape == (16, D) and np.all(np.asarray(y) == 0)
    assert np.all(np.asarray(mean_pool(y, j)) == 0)
    assert np.all(np.asarray(last_tokens(y, j, 3)) == 0)


@pytest.mark.parametrize("attention", ["softmax", "gdpa"])
def test_encoder_gradients_reach_every_parameter(attention):
    model = encoder(attention, qk_norm=True)
    j = pack(seqs(), capacity=32)
    r = jnp.asarray(np.random.default_rng(3).normal(size=(32, D)), jnp.float32)
    loss = lambda m: jnp.sum(m(jnp.asarray(j.values), j) * r)
    grads = nnx.jit(nnx.grad(loss))(model)
    for path, g in jax.tree_util.tree_leaves_with_path(nnx.state(grads, nnx.Param)):
        assert float(jnp.abs(g).max()) > 0, f"no gradient reaches {jax.tree_util.keystr(path)}"


def test_encoder_bf16_runs_close_to_f32():
    j = pack(seqs(), capacity=32)
    y32 = run(encoder("softmax"), jnp.asarray(j.values), j)
    y16 = run(encoder("softmax", dtype=jnp.bfloat16), jnp.asarray(j.values), j)
    assert y16.dtype == jnp.bfloat16
    assert float(jnp.abs(y16.astype(jnp.float32) - y32).max()) < 0.2


def test_pooling_helpers_match_numpy():
    xs = seqs([3, 0, 1, 6])
    j = pack(xs, capacity=16)
    x = jnp.asarray(j.values)
    lt = np.asarray(last_tokens(x, j, 2))
    mp = np.asarray(mean_pool(x, j))
    for i, s in enumerate(xs):
        for slot in range(2):
            want = s[len(s) - 1 - slot] if slot < len(s) else np.zeros(D)
            np.testing.assert_allclose(lt[i, slot], want, rtol=1e-6)
        np.testing.assert_allclose(mp[i], s.mean(0) if len(s) else np.zeros(D), rtol=1e-5,
                                   atol=1e-6)


def test_bad_inputs_name_the_input():
    j = pack(seqs([2, 3]), capacity=16)
    with pytest.raises(ValueError, match="capacity"):
        encoder()(jnp.zeros((8, D)), j)
    with pytest.raises(ValueError, match="attention"):
        encoder("flash9")
    with pytest.raises(ValueError, match="num_heads"):
        JaggedSelfAttention(D, 3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="block"):
        JaggedSelfAttention(D, H, attention="block", causal=True, rngs=nnx.Rngs(0))
