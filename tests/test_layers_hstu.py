"""HSTU blocks (gemjax.layers.hstu) against a padded dense reference: each sample on its
own [L, d] matrix with a lower-triangular mask, written once for numpy (float64, the
forward) and jnp (float32, the gradients), over samples of length 0, 1 and lengths
crossing 16 / 32-token tiles, with padding rows after the last sample."""

import math

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


def _block_ref(xp, x, valid, p, heads, dqk, dv, scale, rope=True, bias=None):
    """x [B, L, d] (samples left-aligned, valid [B, L] bool) through one block, dense
    over [B, H, L, L] with a causal mask on the valid keys; bias(p) [B, H, L, L] or None
    is added to the logits."""
    b, n, _ = x.shape
    a = _silu(xp, _ln(xp, x, p["norm_s"], p["norm_b"]) @ p["w1"] + p["b1"])
    hv, hq = heads * dv, heads * dqk
    u, v = a[..., :hv], a[..., hv:2 * hv].reshape(b, n, heads, dv)
    q = a[..., 2 * hv:2 * hv + hq].reshape(b, n, heads, dqk)
    k = a[..., 2 * hv + hq:].reshape(b, n, heads, dqk)
    if rope:
        q, k = _rope(xp, q), _rope(xp, k)
    s = xp.einsum("bihd,bjhd->bhij", q, k)
    if bias is not None:
        s = s + bias(p)
    mask = np.tril(np.ones((n, n), bool))[None] & valid[:, None, :]          # [B, L(q), L(k)]
    w = _silu(xp, s) * scale * xp.asarray(mask[:, None].astype(np.float64 if xp is np
                                                                  else np.float32))
    o = xp.einsum("bhij,bjhd->bihd", w, v).reshape(b, n, hv)
    return x + (_ln(xp, o, p["an_s"], p["an_b"]) * u) @ p["w2"] + p["b2"]


def _encoder_ref(xp, x, offsets, blocks, heads, dqk, dv, scale, rope=True, bias=None, n=None):
    """x [T, d] packed -> [T, d]: the samples padded to [B, n (default max L), d], padding
    rows 0; bias(p) as _block_ref's, built for that n."""
    lens = np.diff(offsets)
    n = max(int(lens.max()), 1) if n is None else n
    valid = np.arange(n)[None, :] < lens[:, None]                             # [B, L]
    rows = np.where(valid, offsets[:-1, None] + np.arange(n)[None, :], x.shape[0])   # [B, L]
    xpad = xp.concatenate([x, xp.zeros((1, x.shape[1]), x.dtype)])[rows]      # [B, L, d]
    for p in blocks:
        xpad = _block_ref(xp, xpad, valid, p, heads, dqk, dv, scale, rope, bias)
    out = xp.zeros((x.shape[0] + 1, x.shape[1]), x.dtype)
    flat = rows[valid]
    if xp is np:
        out[flat] = xpad[valid]
    else:
        out = out.at[flat].set(xpad[valid])
    return out[:-1]


def _params(blk, cast):
    g = lambda a: cast(a[...])
    out = {"norm_s": g(blk.norm.scale), "norm_b": g(blk.norm.bias), "w1": g(blk.uvqk.kernel),
           "b1": g(blk.uvqk.bias), "an_s": g(blk.attn_norm.scale), "an_b": g(blk.attn_norm.bias),
           "w2": g(blk.out_proj.kernel), "b2": g(blk.out_proj.bias)}
    if blk.rel_bias is not None:
        out["w_pos"] = g(blk.rel_bias.w_pos)
        if blk.rel_bias.w_time is not None:
            out["w_time"] = g(blk.rel_bias.w_time)
    return out


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


# --- relative attention bias (rel_bias="position" / "position+time", the dense path) ---

def _bias_index(offsets, times, n, max_len, buckets):
    """Per-pair indices, by loops over each sample's (i, j): distance min(i - j, max_len - 1)
    [n, n] and (times given) the log bucket of t_i - t_j [B, n, n]."""
    dist = np.zeros((n, n), np.int64)
    for i in range(n):
        for j in range(i + 1):
            dist[i, j] = min(i - j, max_len - 1)
    if times is None:
        return dist, None
    lens = np.diff(offsets)
    tb = np.zeros((len(lens), n, n), np.int64)
    for b, (o, ln) in enumerate(zip(offsets[:-1], lens)):
        for i in range(ln):
            for j in range(i + 1):
                gap = max(abs(int(times[o + i]) - int(times[o + j])), 1)
                tb[b, i, j] = min(int(math.floor(math.log(gap) / 0.301)), buckets - 1)
    return dist, tb


def _bias_fn(xp, dist, tb):
    def bias(p):
        out = p["w_pos"][:, dist][None]                                         # [1, H, n, n]
        if tb is not None:
            out = out + xp.moveaxis(p["w_time"][:, tb], 0, 1)                  # [B, H, n, n]
        return out
    return bias


def _times(jag, seed):
    """int64 timestamps rising within each sample, gaps from 0 to ~1e7 (past the last bucket)."""
    rng = np.random.default_rng(seed)
    gaps = np.floor(10.0 ** rng.uniform(-0.5, 7, jag.capacity)).astype(np.int64)
    t = np.cumsum(gaps) + 1_000_000_000
    t[int(jag.offsets[-1]):] = 0
    return t


def _rab_setup(rel_bias, rope, max_len, seed, buckets=20):
    jag = pack([np.arange(n, dtype=np.int32) for n in LENGTHS], capacity=CAPACITY)
    enc = HSTUEncoder(6, num_layers=2, num_heads=2, scale=1.0 / 40, rope=rope, rel_bias=rel_bias,
                      max_len=max_len, time_buckets=buckets, rngs=nnx.Rngs(seed))
    _randomize(enc, seed)
    x = np.random.default_rng(seed + 1).standard_normal((CAPACITY, 6)).astype(np.float32)
    x[int(jag.offsets[-1]):] = 0
    times = _times(jag, seed + 2) if rel_bias == "position+time" else None
    dist, tb = _bias_index(np.asarray(jag.offsets), times, max_len, max_len, buckets)
    return enc, jag, x, times, dist, tb


# max_len 33: the longest sample exactly (a block edge); 40: padded past it
@pytest.mark.parametrize("rel_bias,rope,max_len", [("position", False, 33), ("position", True, 40),
                                                   ("position+time", False, 33)])
def test_rel_bias_forward_matches_dense_float64(rel_bias, rope, max_len):
    enc, jag, x, times, dist, tb = _rab_setup(rel_bias, rope, max_len, seed=4)
    got = np.asarray(enc(jnp.asarray(x), jag, None,
                         None if times is None else jnp.asarray(times)))
    blocks = [_params(b, lambda a: np.asarray(a, np.float64)) for b in enc.blocks]
    want = _encoder_ref(np, x.astype(np.float64), np.asarray(jag.offsets), blocks, 2, 3, 3,
                        1.0 / 40, rope, _bias_fn(np, dist, tb), n=max_len)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    assert not got[int(jag.offsets[-1]):].any()
    # the bias matters: zeroing it changes the output
    blocks0 = [{**p, "w_pos": 0 * p["w_pos"], **({"w_time": 0 * p["w_time"]} if "w_time" in p
                                                  else {})} for p in blocks]
    off = _encoder_ref(np, x.astype(np.float64), np.asarray(jag.offsets), blocks0, 2, 3, 3,
                       1.0 / 40, rope, _bias_fn(np, dist, tb), n=max_len)
    assert np.abs(off - want).max() > 1e-3


def test_rel_bias_gradients_match_dense_reference():
    """position+time (both bias tables) with RoPE off: every parameter's gradient."""
    enc, jag, x, times, dist, tb = _rab_setup("position+time", False, 33, seed=7)
    graphdef, state = nnx.split(enc)
    w = jnp.asarray(np.random.default_rng(9).standard_normal(x.shape), jnp.float32)
    off = np.asarray(jag.offsets)
    tj = None if times is None else jnp.asarray(times)

    def ours(state, x):
        return jnp.sum(nnx.merge(graphdef, state)(x, jag, None, tj) * w)

    def ref(blocks, x):
        return jnp.sum(_encoder_ref(jnp, x, off, blocks, 2, 3, 3, 1.0 / 40, False,
                                    _bias_fn(jnp, dist, tb), n=33) * w)

    g_state, g_x = jax.jit(jax.grad(ours, argnums=(0, 1)))(state, jnp.asarray(x))
    r_blocks, r_x = jax.jit(jax.grad(ref, argnums=(0, 1)))(
        [_params(b, jnp.asarray) for b in enc.blocks], jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(g_x), np.asarray(r_x), rtol=1e-4, atol=1e-5)
    assert not np.asarray(g_x)[int(off[-1]):].any()
    g_mod = nnx.merge(graphdef, g_state)
    for i, blk in enumerate(g_mod.blocks):
        mine = _params(blk, np.asarray)
        assert set(mine) == set(r_blocks[i])
        for name, want in r_blocks[i].items():
            want = np.asarray(want)
            np.testing.assert_allclose(mine[name], want, rtol=1e-4,
                                       atol=2e-5 * np.abs(want).max(), err_msg=f"block {i} {name}")
        assert np.abs(mine["w_pos"]).max() > 0


def test_rel_bias_none_is_the_gdpa_path_and_bad_inputs_are_refused():
    """rel_bias="none" holds no bias parameters; bad rel_bias / max_len / times are refused."""
    blk = HSTUBlock(6, num_heads=2, rngs=nnx.Rngs(0))
    assert blk.rel_bias is None
    with pytest.raises(ValueError, match="rel_bias must be one of"):
        HSTUBlock(6, num_heads=2, rel_bias="time", max_len=8, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="needs max_len"):
        HSTUBlock(6, num_heads=2, rel_bias="position", rngs=nnx.Rngs(0))
    jag = pack([np.arange(n, dtype=np.int32) for n in (2, 3)], capacity=8)
    x = jnp.zeros((8, 6))
    with pytest.raises(ValueError, match="needs times"):
        HSTUBlock(6, num_heads=2, rel_bias="position+time", max_len=4, rngs=nnx.Rngs(0))(x, jag)
    with pytest.raises(ValueError, match="times given"):
        HSTUBlock(6, num_heads=2, rel_bias="position", max_len=4, rngs=nnx.Rngs(0))(
            x, jag, None, jnp.zeros(8))
