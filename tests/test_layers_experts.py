"""Mixture of Wukong experts against a float64 numpy router + per-expert Wukong."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gemjax.layers.experts import WukongExperts, expert_capacity, route_top_k
from test_layers_wukong import np64, randomize_params, wukong_np

N, D, E = 5, 8, 4


@functools.lru_cache(maxsize=None)   # modules are only read by these tests; build each once
def make(top_k=2, capacity_factor=None, cross_layer=False):
    m = WukongExperts(N, D, num_experts=E, top_k=top_k, num_layers=2, fmb_tokens=2,
                      lcb_tokens=3, rank=3, mlp_hidden=(8,), cross_layer_attention=cross_layer,
                      cross_layer_heads=2, capacity_factor=capacity_factor, rngs=nnx.Rngs(0))
    randomize_params(m, 1)
    return m


def expert(m, e):
    graphdef, state = nnx.split(m.experts)
    return nnx.merge(graphdef, jax.tree.map(lambda a: np.asarray(a)[e], state))


def moe_np(x, m, top_k, capacity):
    """Reference: route in float64, queue per expert in sample order, drop past capacity."""
    b = x.shape[0]
    logits = x.reshape(b, -1) @ np64(m.router.kernel) + np64(m.router.bias)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    outs = [wukong_np(x, expert(m, e)) for e in range(E)]
    y = np.zeros_like(outs[0])
    used = np.zeros(E, int)
    dropped = 0
    for i in range(b):
        top = np.argsort(-p[i], kind="stable")[:top_k]
        g = p[i, top] / p[i, top].sum()
        for e, ge in zip(top, g):
            if used[e] < capacity:
                y[i] += ge * outs[e][i]
                used[e] += 1
            else:
                dropped += 1
    sel = np.zeros((b, E))
    for i in range(b):
        sel[i, np.argsort(-p[i], kind="stable")[:top_k]] = 1
    load = sel.sum(0) / (b * top_k)
    return y, {"load_balance_loss": E * np.sum(load * p.mean(0)), "expert_load": load,
               "dropped_fraction": dropped / (b * top_k),
               "router_z_loss": np.mean(np.log(np.exp(logits).sum(-1)) ** 2)}


@pytest.mark.parametrize("top_k,capacity_factor,cross_layer",
                         [(2, None, True), (1, None, False), (2, 0.5, False)])
def test_experts_match_numpy(top_k, capacity_factor, cross_layer):
    m = make(top_k, capacity_factor, cross_layer)
    x = np.random.default_rng(2).normal(size=(12, N, D))
    y, aux = nnx.jit(lambda m, x: m(x))(m, jnp.asarray(x, jnp.float32))
    cap = expert_capacity(12, E, top_k, capacity_factor)
    y_ref, aux_ref = moe_np(x, m, top_k, cap)
    assert y.shape == (12, 5, D)
    np.testing.assert_allclose(np.asarray(y), y_ref, rtol=5e-4, atol=5e-4)
    for k, v in aux_ref.items():
        np.testing.assert_allclose(np.asarray(aux[k]), v, rtol=1e-4, atol=1e-6, err_msg=k)
    if capacity_factor is not None:
        assert cap == 3 and float(aux["dropped_fraction"]) > 0


def test_route_top_k_balanced_loss_is_one_and_capacity_drops_are_counted():
    logits = jnp.log(jnp.eye(4)[jnp.array([0, 1, 2, 3, 0, 1, 2, 3])] * 0.9 + 0.025)
    index, combine, aux = route_top_k(logits, 1, capacity=2)
    assert float(aux["dropped_fraction"]) == 0.0
    np.testing.assert_allclose(np.asarray(aux["expert_load"]), 0.25)
    np.testing.assert_allclose(float(aux["load_balance_loss"]), 1.0, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(index), [[0, 4], [1, 5], [2, 6], [3, 7]])
    np.testing.assert_allclose(np.asarray(combine), 1.0)
    # Everyone wants expert 0 with capacity 2: 6 of 8 assignments dropped, load loss = E.
    index, combine, aux = route_top_k(jnp.tile(jnp.array([[5.0, 0, 0, 0]]), (8, 1)), 1, 2)
    np.testing.assert_allclose(float(aux["dropped_fraction"]), 0.75)
    np.testing.assert_array_equal(np.asarray(index)[0], [0, 1])
    assert np.all(np.asarray(index)[1:] == 8) and np.all(np.asarray(combine)[1:] == 0)
    assert float(aux["load_balance_loss"]) > 3.0


def test_experts_gradients_reach_router_and_every_expert():
    m = make(2, None, True)
    x = jnp.asarray(np.random.default_rng(3).normal(size=(16, N, D)), jnp.float32)

    def loss(m):
        y, aux = m(x)
        return jnp.sum(y * jnp.cos(jnp.arange(y.size).reshape(y.shape))) + aux["load_balance_loss"]

    grads = nnx.jit(nnx.grad(loss))(m)
    _, aux = nnx.jit(lambda m, x: m(x))(m, x)
    assert np.all(np.asarray(aux["expert_load"]) > 0), "test needs every expert chosen"
    for path, g in jax.tree_util.tree_leaves_with_path(nnx.state(grads, nnx.Param)):
        g = np.asarray(g)
        per_expert = g.reshape(E, -1) if "experts" in jax.tree_util.keystr(path) else g[None]
        assert np.all(np.abs(per_expert).max(-1) > 0), f"no gradient at {jax.tree_util.keystr(path)}"


def test_expert_params_carry_the_expert_axis_and_bad_args_fail():
    m = make(2, None, True)
    for path, v in jax.tree_util.tree_leaves_with_path(
            nnx.state(m.experts, nnx.Param), is_leaf=lambda v: isinstance(v, nnx.Variable)):
        assert v.get_metadata()["out_sharding"][0] == "expert", jax.tree_util.keystr(path)
        assert v.shape[0] == E
    with pytest.raises(ValueError, match="top_k"):
        WukongExperts(N, D, num_experts=2, top_k=3, num_layers=1, fmb_tokens=1, lcb_tokens=1,
                      rank=2, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"\[B, 5, 8\]"):
        m(jnp.zeros((2, 4, 8)))


def test_experts_on_a_mesh_shard_params_over_expert_and_match_single_device():
    from jax.sharding import PartitionSpec as P

    from gemjax.parallel.rules import shard_params

    m = make(2, None, True)
    graphdef, params = nnx.split(m)
    x = jnp.asarray(np.random.default_rng(6).normal(size=(16, N, D)), jnp.float32)
    ref, _ = nnx.jit(lambda m, x: m(x))(m, x)
    axes = ("replica", "fsdp", "expert")
    mesh = jax.make_mesh((2, 2, 2), axes, axis_types=(jax.sharding.AxisType.Auto,) * 3)
    placed = shard_params(params, None, mesh)
    fm = placed["experts"]["layers"][0]["fm_proj"]
    assert fm.get_value().sharding.spec[0] == "expert"
    fwd = lambda p, x: nnx.merge(graphdef, p)(x)[0]
    with jax.set_mesh(mesh):
        y_jit = jax.jit(fwd)(placed, x)                                  # expert-sharded
        y_shmap = jax.jit(jax.shard_map(fwd, mesh=mesh, in_specs=(P(), P(axes)),
                                        out_specs=P(axes)))(params, x)   # per batch shard
    np.testing.assert_allclose(np.asarray(y_jit), np.asarray(ref), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(y_shmap), np.asarray(ref), rtol=1e-5, atol=1e-5)
