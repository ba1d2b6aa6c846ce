"""HSTU blocks (gemjax.layers.hstu) against a padded dense reference: each sample on its
own [L, d] matrix with a lower-triangular mask, written once for numpy (float64, the
forward) and jnp (float32, the gradients), over samples of length 0, 1 and lengths
crossing 16 / 32-token tiles, with padding rows after the last sample."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gemjax.data.jagged import pack
from gemjax.layers.hstu import HSTUBlock, HSTUEncoder

LENGTHS = (0, 1, 17, 33, 5, 0, 3)
CAPACITY = 64 + 32            # 59 tokens: 37 padding rows


def _silu(xp, x):
    return x / (1 + xp.exp(-x))


def _ln(xp, x, scale, bias):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / xp.sqrt(var + 1e-6) * scale + bias


def _rope(xp, x, theta=10_000.0):
    """x [B, L, H, D]: rotate-half RoPE on the first even channels, position = row."""
    d = x.shape[-1] - x.shape[-1] % 2
    half = d // 2
    freq = theta ** (-np.arange(half) * 2.0 / d)
    ang = np.arange(x.shape[1])[:, None] * freq[None, :]
    c, s = xp.asarray(np.cos(ang))[:, None, :], xp.asarray(np.sin(ang))[:, None, :]
    x1, x2 = x[..., :half], x[..., half:d]
    return xp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, x[..., d:]], axis=-1)


def _block_ref(xp, x, valid, p, heads, dqk, dv, scale):
    """x [B, L, d] (samples left-aligned, valid [B, L] bool) through one block, dense
    over [B, H, L, L] with a causal mask on the valid keys."""
    b, n, _ = x.shape
    a = _silu(xp, _ln(xp, x, p["norm_s"], p["norm_b"]) @ p["w1"] + p["b1"])
    hv, hq = heads * dv, heads * dqk
    u, v = a[..., :hv], a[..., hv:2 * hv].reshape(b, n, heads, dv)
    q = _rope(xp, a[..., 2 * hv:2 * hv + hq].reshape(b, n, heads, dqk))
    k = _rope(xp, a[..., 2 * hv + hq:].reshape(b, n, heads, dqk))
    s = xp.einsum("bihd,bjhd->bhij", q, k)
    mask = np.tril(np.ones((n, n), bool))[None] & valid[:, None, :]          # [B, L(q), L(k)]
    w = _silu(xp, s) * scale * xp.asarray(mask[:, None].astype(np.float64 if xp is np
                                                                  else np.float32))
    o = xp.einsum("bhij,bjhd->bihd", w, v).reshape(b, n, hv)
    return x + (_ln(xp, o, p["an_s"], p["an_b"]) * u) @ p["w2"] + p["b2"]


def _encoder_ref(xp, x, offsets, blocks, heads, dqk, dv, scale):
    """x [T, d] packed -> [T, d]: the samples padded to [B, max L, d], padding rows 0."""
    lens = np.diff(offsets)
    n = max(int(lens.max()), 1)
    valid = np.arange(n)[None, :] < lens[:, None]                             # [B, L]
    rows = np.where(valid, offsets[:-1, None] + np.arange(n)[None, :], x.shape[0])   # [B, L]
    xpad = xp.concatenate([x, xp.zeros((1, x.shape[1]), x.dtype)])[rows]      # [B, L, d]
    for p in blocks:
        xpad = _block_ref(xp, xpad, valid, p, heads, dqk, dv, scale)
    out = xp.zeros((x.shape[0] + 1, x.shape[1]), x.dtype)
    flat = rows[valid]
    if xp is np:
        out[flat] = xpad[valid]
    else:
        out = out.at[flat].set(xpad[valid])
    return out[:-1]


def _params(blk, cast):
    g = lambda a: cast(a[...])
    return {"norm_s": g(blk.norm.scale), "norm_b": g(blk.norm.bias), "w1": g(blk.uvqk.kernel),
            "b1": g(blk.uvqk.bias), "an_s": g(blk.attn_norm.scale), "an_b": g(blk.attn_norm.bias),
            "w2": g(blk.out_proj.kernel), "b2": g(blk.out_proj.bias)}


def _randomize(module, seed):
    """Non-trivial norm parameters and biases (they start at 1 / 0)."""
    _, state = nnx.split(module)
    rng = np.random.default_rng(seed)
    leaves, tree = jax.tree.flatten(state)
    leaves = [jnp.asarray(np.asarray(v) + 0.3 * rng.standard_normal(np.shape(v)), jnp.float32)
              for v in leaves]
    nnx.update(module, jax.tree.unflatten(tree, leaves))


def _setup(dim=6, heads=2, layers=2, seed=0):
    jag = pack([np.arange(n, dtype=np.int32) for n in LENGTHS], capacity=CAPACITY)
    enc = HSTUEncoder(dim, num_layers=layers, num_heads=heads, scale=1.0 / 40, rngs=nnx.Rngs(seed))
    _randomize(enc, seed)
    x = np.random.default_rng(seed + 1).standard_normal((CAPACITY, dim)).astype(np.float32)
    x[int(jag.offsets[-1]):] = 0
    return enc, jag, x


@pytest.mark.parametrize("dim,heads", [(6, 2), (8, 2)])     # head width 3 (odd: one channel unrotated), 4
def test_encoder_forward_matches_dense_float64(dim, heads):
    enc, jag, x = _setup(dim, heads)
    got = np.asarray(enc(jnp.asarray(x), jag))
    blocks = [_params(b, lambda a: np.asarray(a, np.float64)) for b in enc.blocks]
    d = dim // heads
    want = _encoder_ref(np, x.astype(np.float64), np.asarray(jag.offsets), blocks, heads, d, d,
                        1.0 / 40)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    assert not got[int(jag.offsets[-1]):].any()
    # a length-1 sample sees only itself: SiLU(q.k) * scale * v of its own token
    one = int(jag.offsets[1])
    assert np.abs(got[one] - x[one]).max() > 1e-3


def test_encoder_gradients_match_dense_reference():
    enc, jag, x = _setup(6, 2, seed=3)
    graphdef, state = nnx.split(enc)
    w = jnp.asarray(np.random.default_rng(9).standard_normal(x.shape), jnp.float32)
    off = np.asarray(jag.offsets)

    def ours(state, x):
        return jnp.sum(nnx.merge(graphdef, state)(x, jag) * w)

    def ref(blocks, x):
        return jnp.sum(_encoder_ref(jnp, x, off, blocks, 2, 3, 3, 1.0 / 40) * w)

    g_state, g_x = jax.jit(jax.grad(ours, argnums=(0, 1)))(state, jnp.asarray(x))
    blocks = [_params(b, jnp.asarray) for b in enc.blocks]
    r_blocks, r_x = jax.jit(jax.grad(ref, argnums=(0, 1)))(blocks, jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(g_x), np.asarray(r_x), rtol=1e-4, atol=1e-5)
    assert not np.asarray(g_x)[int(off[-1]):].any()
    g_mod = nnx.merge(graphdef, g_state)
    for i, blk in enumerate(g_mod.blocks):
        mine = _params(blk, np.asarray)
        for name, want in r_blocks[i].items():
            want = np.asarray(want)     # float32 sums over ~60 tokens: error relative to the largest
            np.testing.assert_allclose(mine[name], want, rtol=1e-4,
                                       atol=2e-5 * np.abs(want).max(), err_msg=f"block {i} {name}")


def test_block_dropout_only_with_a_key_and_distinct_widths():
    """No key: deterministic; a key: the gated output is dropped (a different output);
    qk_dim != v_dim runs (Q / K / V padded to one width for the kernel) and matches the
    reference."""
    jag = pack([np.arange(n, dtype=np.int32) for n in LENGTHS], capacity=CAPACITY)
    blk = HSTUBlock(8, num_heads=2, qk_dim=3, v_dim=5, scale=0.1, dropout=0.5, rngs=nnx.Rngs(1))
    _randomize(blk, 1)
    x = np.random.default_rng(2).standard_normal((CAPACITY, 8)).astype(np.float32)
    x[int(jag.offsets[-1]):] = 0
    a, b = blk(jnp.asarray(x), jag), blk(jnp.asarray(x), jag)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    c = blk(jnp.asarray(x), jag, jax.random.key(0))
    assert np.abs(np.asarray(c) - np.asarray(a)).max() > 1e-3
    want = _encoder_ref(np, x.astype(np.float64), np.asarray(jag.offsets),
                        [_params(blk, lambda v: np.asarray(v, np.float64))], 2, 3, 5, 0.1)
    np.testing.assert_allclose(np.asarray(a), want, rtol=2e-5, atol=2e-5)
