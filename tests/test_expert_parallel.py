"""Expert parallelism: WukongExperts exchanging tokens with all_to_all over the `expert` axis.

Under `jax.shard_map` each device keeps only its [E/ep, ...] expert shard and routes
its own samples; the layer (and the whole trainer) must equal the plain
single-device layer forward and backward. References are computed without any
exchange: the plain layer on one device (capacity None), the plain layer applied
to each device's shard on its own and a float64 numpy count of per-device queue
overflow (with a capacity factor). The whole trainer with EP against the one-device trainer:
tests/test_sharded_aux_loss.py.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from gemjax.layers.experts import WukongExperts, expert_capacity, set_mesh_axes
from gemjax.train.equivalence import max_rel_diff
from gemjax.parallel.mesh import build_mesh
from gemjax.parallel.rules import param_shardings
from gemjax.train.step import (CHECK_VMA, expert_param_mask, expert_parallel_axes,
                               gather_param)
from test_layers_wukong import randomize_params

N, D, E, B = 5, 8, 4, 32


def make(top_k=2, capacity_factor=None):
    m = WukongExperts(N, D, num_experts=E, top_k=top_k, num_layers=1, fmb_tokens=2,
                      lcb_tokens=3, rank=3, mlp_hidden=(8,), capacity_factor=capacity_factor,
                      rngs=nnx.Rngs(0))
    randomize_params(m, 1)
    return nnx.split(m)        # graphdef, nnx.State (Variables keep their logical names)


def sharded_layer(graphdef, state, mesh, ep=True):
    """jit((params placed by the rules, x [B, N, D] over every axis) -> (y, dropped [devices]))
    the way the trainer runs it: gather params except the EP dim, expert axes set."""
    specs = jax.tree.map(lambda s: s.spec, param_shardings(state, mesh).to_pure_dict())
    params = state.to_pure_dict()
    is_expert = expert_param_mask(graphdef, params)
    ep_axes = expert_parallel_axes(mesh, specs, is_expert) if ep else None
    local_dims = jax.tree.map(lambda e: (0,) if e and ep_axes else (), is_expert)
    axes = mesh.axis_names

    def local(p, x):
        full = jax.tree.map(gather_param, p, specs, local_dims)
        y, aux = set_mesh_axes(nnx.merge(graphdef, full), expert_axes=ep_axes)(x)
        return y, aux["dropped_fraction"][None]

    fn = jax.shard_map(local, mesh=mesh, in_specs=(specs, P(axes)), out_specs=(P(axes), P(axes)),
                       check_vma=CHECK_VMA)
    placed = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), params, specs)
    return jax.jit(fn), placed, ep_axes, NamedSharding(mesh, P(axes))


@pytest.mark.parametrize("spec", ["replica=2,fsdp=2,expert=2", "fsdp=2,expert=4"])
def test_ep_layer_matches_one_device_forward_and_backward(spec):
    mesh = build_mesh(spec)
    graphdef, state = make(top_k=2)
    params = state.to_pure_dict()
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.normal(size=(B, N, D)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(B, N, D)), jnp.float32)   # a generic cotangent for y

    def loss_one(p, x):
        return jnp.sum(nnx.merge(graphdef, p)(x)[0] * w)

    y1 = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x)[0])(params, x)
    g1 = jax.jit(jax.grad(loss_one, argnums=(0, 1)))(params, x)

    fn, placed, ep_axes, x_sh = sharded_layer(graphdef, state, mesh)
    assert ep_axes == ("expert",)
    xs = jax.device_put(x, x_sh)
    jaxpr = str(jax.make_jaxpr(fn)(placed, xs))
    assert jaxpr.count("all_to_all") == 2          # dispatch + combine (the layer checks E/ep)
    y = fn(placed, xs)[0]
    g = jax.jit(jax.grad(lambda p, x: jnp.sum(fn(p, x)[0] * w), argnums=(0, 1)))(placed, xs)
    assert max_rel_diff(y, y1) < 1e-5
    assert max_rel_diff(g[1], g1[1]) < 1e-5                                       # d loss / d x
    n_expert = 0
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g[0]), jax.tree.leaves(g1[0])):
        assert a.shape == b.shape, jax.tree_util.keystr(path)
        assert np.max(np.abs(np.asarray(b))) > 0, jax.tree_util.keystr(path)   # a real gradient
        assert max_rel_diff(a, b) < 1e-5, (jax.tree_util.keystr(path), max_rel_diff(a, b))
        n_expert += "experts" in jax.tree_util.keystr(path)
    assert n_expert > 0 and len(jax.tree.leaves(g[0])) > n_expert       # experts and router


def overflow_np(params, x, top_k, capacity):
    """float64: dropped assignments of x [b, N, D] queued per expert in sample order."""
    r = params["router"]
    logits = np.asarray(x, np.float64).reshape(len(x), -1) @ np.asarray(r["kernel"], np.float64) \
        + np.asarray(r["bias"], np.float64)
    top = np.argsort(-logits, axis=-1, kind="stable")[:, :top_k]
    counts = np.bincount(top.ravel(), minlength=E)
    return int(np.sum(np.maximum(counts - capacity, 0)))


def test_ep_capacity_is_per_device_and_overflow_is_counted():
    """With a capacity factor each device queues its own samples (C = ceil(cf k B_local / E)),
    so EP equals the plain layer run on each shard alone, and drops more than the
    global queue (C = ceil(cf k B / E)) when a device crowds an expert."""
    mesh = build_mesh("replica=2,fsdp=2,expert=2")
    cf, k, ndev = 1.0, 1, mesh.size
    graphdef, state = make(top_k=k, capacity_factor=cf)
    params = state.to_pure_dict()
    x = jnp.asarray(np.random.default_rng(5).normal(size=(B, N, D)), jnp.float32)
    fn, placed, ep_axes, x_sh = sharded_layer(graphdef, state, mesh)
    y, dropped = fn(placed, jax.device_put(x, x_sh))
    b_loc = B // ndev
    c_loc, c_glob = expert_capacity(b_loc, E, k, cf), expert_capacity(B, E, k, cf)
    assert (c_loc, c_glob) == (1, 8)
    plain = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x))
    shards = [plain(params, x[d * b_loc:(d + 1) * b_loc]) for d in range(ndev)]
    assert max_rel_diff(y, jnp.concatenate([s[0] for s in shards])) < 1e-5
    want = [overflow_np(params, x[d * b_loc:(d + 1) * b_loc], k, c_loc) / (b_loc * k)
            for d in range(ndev)]
    np.testing.assert_allclose(np.asarray(dropped), want, atol=1e-7)
    np.testing.assert_allclose(np.asarray(dropped), [float(s[1]["dropped_fraction"]) for s in shards],
                               atol=1e-7)
    glob = float(plain(params, x)[1]["dropped_fraction"])
    np.testing.assert_allclose(glob, overflow_np(params, x, k, c_glob) / (B * k), atol=1e-7)
    assert np.mean(want) > glob     # per-device queues drop what a global queue would keep


def collective_axes(hlo: str, op: str) -> list[tuple[frozenset, str]]:
    """(mesh axes of its replica groups, result shape) of every `op` ("all-to-all",
    "all-gather") in compiled HLO text whose groups print as mesh[...] {axes}."""
    out = []
    for line in hlo.splitlines():
        if not re.search(rf"\b{op}(-start)?\(", line):
            continue
        m = re.search(r"replica_groups=mesh\[[^\]]*\]\s*\{([^}]*)\}", line)
        assert m, f"unparsed replica groups: {line.strip()[:200]}"
        shape = line.split("=", 1)[1].split(op)[0].strip()
        out.append((frozenset(re.findall(r"'(\w+)'", m.group(1))), shape))
    return out


def expert_weight_gathers(hlo: str) -> list[str]:
    """Result shapes of all-gathers over a group with `expert` that build float [E, ...]
    arrays: the gathered (non-EP) path's expert weights."""
    return [s for a, s in collective_axes(hlo, "all-gather")
            if "expert" in a and re.match(rf"\(?b?f\d+\[{E},", s)]


def test_hlo_detector_sees_gathered_experts_without_ep():
    """The HLO check of the trainer test can fail: without EP the layer's compiled
    program all-gathers [E, ...] expert weights over `expert` and has no all-to-all."""
    mesh = build_mesh("replica=2,fsdp=2,expert=2")
    graphdef, state = make()
    x = jnp.zeros((B, N, D), jnp.float32)
    texts = {}
    for ep in (True, False):
        fn, placed, _, x_sh = sharded_layer(graphdef, state, mesh, ep=ep)
        texts[ep] = fn.lower(placed, jax.device_put(x, x_sh)).compile().as_text()
    assert expert_weight_gathers(texts[False])
    assert not collective_axes(texts[False], "all-to-all")
    assert not expert_weight_gathers(texts[True])
    assert {a for a, _ in collective_axes(texts[True], "all-to-all")} == {frozenset({"expert"})}


def test_ep_bad_use_fails_with_a_clear_error():
    graphdef, state = make()
    params = state.to_pure_dict()
    x = jnp.zeros((B, N, D), jnp.float32)
    with pytest.raises(ValueError, match="only inside shard_map"):
        set_mesh_axes(nnx.merge(graphdef, params), expert_axes="expert")(x)
    assert nnx.merge(graphdef, params).expert_axes is None     # set on that model only
    mesh = build_mesh("replica=2,fsdp=2,expert=2")
    replicated = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, P())), params)

    def local(p, x):      # experts left whole [E, ...] while claiming EP
        return set_mesh_axes(nnx.merge(graphdef, p), expert_axes="expert")(x)[0]

    fn = jax.shard_map(local, mesh=mesh, in_specs=(P(), P(mesh.axis_names)),
                       out_specs=P(mesh.axis_names), check_vma=CHECK_VMA)
    with pytest.raises(ValueError, match=r"leading dim E/ep=2, got leading dims \[4\]"):
        jax.jit(fn)(replicated, x)
    with pytest.raises(ValueError, match="axis_name"):
        set_mesh_axes(nnx.merge(graphdef, params), expert_axes=())


# The smallest full teacher with a mixture of 4 experts (top-2, no capacity drops), load-
# balancing loss off. tests/test_sharded_aux_loss.py trains it with that loss on, on the EP
# mesh, against one device, and checks the EP step's collectives (HLO detectors above).
TEACHER = ("model.kind=teacher,model.num_experts=4,model.top_k=2,model.lb_coef=0,"
           "model.interformer_layers=1,model.pyramid_levels=16:none:1,model.attention=softmax,"
           "model.head_towers=shared,model.cls_tokens=1,model.pma_tokens=0,model.recent_tokens=1,"
           "model.qk_norm=false,model.rope=false,model.cross_layer_attention=false,"
           "data.batch_size=32,data.seq_cap=16")
