"""Wukong and MLP checked against float64 numpy versions of their equations."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gemjax.layers.mlp import MLP
from gemjax.layers.wukong import Wukong, WukongLayer


def randomize_params(module, seed):
    """Replace every parameter (LN scales and biases included) by random values."""
    rng = np.random.default_rng(seed)
    state = nnx.state(module, nnx.Param)
    leaves, treedef = jax.tree.flatten(state)
    new = [jnp.asarray(0.5 * rng.normal(size=x.shape) + (np.asarray(x) == 1), x.dtype)
           for x in leaves]
    nnx.update(module, jax.tree.unflatten(treedef, new))


def np64(p):
    return np.asarray(p[...], np.float64)


def ln_np(x, ln, eps=1e-6):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * np64(ln.scale) + np64(ln.bias)


def mlp_np(x, mlp: MLP):
    n = len(mlp.linears)
    for i, lin in enumerate(mlp.linears):
        x = x @ np64(lin.kernel) + np64(lin.bias)
        if i < n - 1:
            if len(mlp.norms):
                x = ln_np(x, mlp.norms[i])
            x = np.maximum(x, 0.0)
    return x


def wukong_layer_np(x, layer: WukongLayer):
    """X_{i+1} = LN(concat(FMB(X), LCB(X)) + residual(X)), written out plainly."""
    b, n, d = x.shape
    parts = []
    if layer.fmb_tokens:
        y = np64(layer.fm_proj)
        inter = np.stack([x[i] @ (x[i].T @ y) for i in range(b)])           # [B, n, k]
        h = ln_np(inter.reshape(b, -1), layer.fmb_norm)
        parts.append(mlp_np(h, layer.fmb_mlp).reshape(b, layer.fmb_tokens, d))
    if layer.lcb_tokens:
        w = np64(layer.lcb_weight)
        parts.append(np.stack([w @ x[i] for i in range(b)]))
    res = x if layer.residual_proj is None else np.stack(
        [np64(layer.residual_proj) @ x[i] for i in range(b)])
    return ln_np(np.concatenate(parts, 1) + res, layer.out_norm)


def cross_attention_np(x, mem, att):
    """Multi-head softmax attention, x [B, n, d] over mem [B, m, d]."""
    lin = lambda p, v: v @ np64(p.kernel) + np64(p.bias)
    b, n, d = x.shape
    h, dh = att.num_heads, att.head_dim
    q = lin(att.q_proj, x).reshape(b, n, h, dh)
    k = lin(att.k_proj, mem).reshape(b, -1, h, dh)
    v = lin(att.v_proj, mem).reshape(b, -1, h, dh)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(dh)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return lin(att.out_proj, np.einsum("bhqk,bkhd->bqhd", p, v).reshape(b, n, d))


def wukong_np(x, model: Wukong):
    history = [x]
    for i, layer in enumerate(model.layers):
        if i and len(model.cross_layer):
            x = x + cross_attention_np(x, np.concatenate(history, 1), model.cross_layer[i - 1])
        x = wukong_layer_np(x, layer)
        history.append(x)
    return x


@pytest.mark.parametrize("n,f,l", [(6, 4, 2), (5, 2, 4), (4, 0, 3), (3, 2, 0)])
def test_wukong_layer_matches_numpy(n, f, l):
    d, k = 8, 3
    layer = WukongLayer(n, d, fmb_tokens=f, lcb_tokens=l, rank=k, mlp_hidden=(16, 12),
                        rngs=nnx.Rngs(0))
    randomize_params(layer, 1)
    x = np.random.default_rng(2).normal(size=(3, n, d))
    got = np.asarray(nnx.jit(lambda m, x: m(x))(layer, jnp.asarray(x, jnp.float32)))
    assert got.shape == (3, f + l, d)
    np.testing.assert_allclose(got, wukong_layer_np(x, layer), rtol=2e-4, atol=2e-4)
    assert (layer.residual_proj is None) == (n == f + l)


@pytest.mark.parametrize("cross_layer", [False, True])
def test_wukong_stack_matches_numpy_and_grads_reach_every_param(cross_layer):
    model = Wukong(7, 8, num_layers=3, fmb_tokens=3, lcb_tokens=2, rank=4, mlp_hidden=(16,),
                   cross_layer_attention=cross_layer, cross_layer_heads=2, rngs=nnx.Rngs(0))
    assert len(model.cross_layer) == (2 if cross_layer else 0)
    randomize_params(model, 3)
    x = np.random.default_rng(4).normal(size=(2, 7, 8))
    ref = wukong_np(x, model)
    got = nnx.jit(lambda m, x: m(x))(model, jnp.asarray(x, jnp.float32))
    assert got.shape == (2, 5, 8) and model.out_tokens == 5
    np.testing.assert_allclose(np.asarray(got), ref, rtol=5e-4, atol=5e-4)

    r = jnp.asarray(np.random.default_rng(5).normal(size=got.shape), jnp.float32)
    grads = nnx.jit(nnx.grad(lambda m: jnp.sum(m(jnp.asarray(x, jnp.float32)) * r)))(model)
    for path, g in jax.tree_util.tree_leaves_with_path(nnx.state(grads, nnx.Param)):
        assert float(jnp.abs(g).max()) > 0, f"no gradient reaches {jax.tree_util.keystr(path)}"


def test_wukong_bf16_close_to_f32():
    kw = dict(num_layers=2, fmb_tokens=4, lcb_tokens=4, rank=4, mlp_hidden=(32,))
    m32 = Wukong(8, 16, **kw, rngs=nnx.Rngs(0))
    m16 = Wukong(8, 16, **kw, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(1).normal(size=(4, 8, 16)), jnp.float32)
    fwd = nnx.jit(lambda m, x: m(x))
    y32, y16 = fwd(m32, x), fwd(m16, x)
    assert y16.dtype == jnp.bfloat16
    assert float(jnp.abs(y16.astype(jnp.float32) - y32).max()) < 0.15


def test_mlp_matches_numpy_with_layer_norm():
    mlp = MLP(5, (7, 6), 3, layer_norm=True, rngs=nnx.Rngs(0))
    randomize_params(mlp, 6)
    x = np.random.default_rng(7).normal(size=(2, 4, 5))
    np.testing.assert_allclose(np.asarray(mlp(jnp.asarray(x, jnp.float32))), mlp_np(x, mlp),
                               rtol=2e-4, atol=2e-4)


def test_bad_inputs_name_the_input():
    layer = WukongLayer(4, 8, fmb_tokens=2, lcb_tokens=2, rank=2, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="num_tokens=4"):
        layer(jnp.zeros((2, 5, 8)))
    with pytest.raises(ValueError, match="fmb_tokens"):
        WukongLayer(4, 8, fmb_tokens=0, lcb_tokens=0, rank=2, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="in_features"):
        MLP(3, (4,), 2, rngs=nnx.Rngs(0))(jnp.zeros((2, 4)))
    with pytest.raises(ValueError, match="activation"):
        MLP(3, (4,), 2, activation="swish9", rngs=nnx.Rngs(0))
