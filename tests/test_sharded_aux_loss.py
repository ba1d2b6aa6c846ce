"""The experts' router aux under a sharded batch equals the one-device figures, and so
does its gradient (issue 5: every sharded path gives the one-device loss and params).

Inside the trainer's shard_map the model sees one batch shard; its batch axes
(`experts.set_mesh_axes`) make route_top_k psum its per-shard sums, and the teacher attaches the global
load-balancing loss on every shard with weight coef * aux_loss_scale = coef / N, so
its gradient is added once. References: a float64 numpy evaluation of the formulas
on the whole batch (forward, drops per shard queue, and the analytic gradient
E/B * p (f - p.f) of the load-balancing loss w.r.t. the logits), and the one-device
trainer with the loss on.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from gemjax.layers.experts import aux_loss_scale, route_top_k, set_mesh_axes
from gemjax.models.interformer import attach_aux_loss
from gemjax.train.equivalence import max_rel_diff
from gemjax.parallel.mesh import build_mesh
from test_expert_parallel import TEACHER as EP_TEACHER

E, K, B = 6, 2, 64
COEF = 0.3


def aux_np(logits, top_k, capacity, shards):
    """float64 figures of the whole batch; drops queued per shard (earlier samples first)."""
    x = np.asarray(logits, np.float64)
    b, e = x.shape
    z = x - x.max(-1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
    lse = np.log(np.exp(z).sum(-1)) + x.max(-1)
    top = np.argsort(-p, axis=-1, kind="stable")[:, :top_k]
    f = np.bincount(top.ravel(), minlength=e) / (b * top_k)
    dropped = sum(np.maximum(np.bincount(t.ravel(), minlength=e) - capacity, 0).sum()
                  for t in np.split(top, shards))
    lb = e * np.sum(f * p.mean(0))
    grad_lb = e / b * p * (f[None, :] - (p @ f)[:, None])        # d lb / d logits [B, E]
    return {"load_balance_loss": lb, "router_z_loss": np.mean(lse ** 2),
            "dropped_fraction": dropped / (b * top_k), "expert_load": f}, grad_lb


@pytest.mark.parametrize("spec,check_vma,cap", [("replica=2,fsdp=2,expert=2", False, None),
                                                ("fsdp=8", False, 2),
                                                ("replica=2,fsdp=4", True, None)])
def test_global_router_aux_and_its_gradient_equal_the_whole_batch_formula(spec, check_vma, cap):
    mesh = build_mesh(spec)
    axes, n = mesh.axis_names, mesh.size
    b_loc = B // n
    capacity = b_loc if cap is None else cap
    rng = np.random.default_rng(7)
    logits = jnp.asarray(rng.normal(size=(B, E)) * 2.0 + np.linspace(0, 2, E), jnp.float32)
    # cotangent of the main loss, of the aux part's size so neither hides the other
    w = jnp.asarray(rng.normal(size=(B, E)) * 1e-3, jnp.float32)
    want, grad_lb = aux_np(logits, K, capacity, n)

    def aux_of(x):
        return route_top_k(x, K, capacity, axes)[2]

    def injected(x):          # the teacher's pattern: attach on every shard, main loss psum'd
        lb = route_top_k(x, K, capacity, axes)[2]["load_balance_loss"]
        y = attach_aux_loss(x, lb, COEF * aux_loss_scale(x, axes))
        return jax.lax.psum(jnp.sum(y * w_local(x)), axes)

    def w_local(x):           # this shard's rows of w
        i = jax.lax.axis_index(axes)
        return jax.lax.dynamic_slice_in_dim(w, i * b_loc, b_loc)

    smap = lambda f, out: jax.shard_map(f, mesh=mesh, in_specs=P(axes), out_specs=out,  # noqa
                                        check_vma=check_vma)
    x = jax.device_put(logits, NamedSharding(mesh, P(axes)))

    def figures(x):           # one program: the aux figures, d aux / d logits, the injected grad
        return (smap(aux_of, P())(x),
                jax.grad(lambda x: smap(aux_of, P())(x)["load_balance_loss"])(x),
                jax.grad(smap(injected, P()))(x))

    got, g_out, g_inj = jax.jit(figures)(x)
    for name, v in want.items():
        np.testing.assert_allclose(np.asarray(got[name]), v, rtol=2e-6, atol=1e-7, err_msg=name)
    if cap is not None:
        assert want["dropped_fraction"] > 0        # the capacity really drops here
    assert want["load_balance_loss"] > 1.05        # not the balanced value 1.0
    # d aux / d logits through the shard_map output: psum's transpose routes it per shard
    assert max_rel_diff(g_out, grad_lb) < 1e-5
    # the injected gradient: w + COEF * d lb once (not N times, not a per-shard lb)
    w64 = np.asarray(w, np.float64)
    assert max_rel_diff(g_inj, w64 + COEF * grad_lb) < 1e-5
    assert max_rel_diff(w64 + n * COEF * grad_lb, w64 + COEF * grad_lb) > 0.1   # N-fold would fail


def test_per_shard_aux_without_batch_axes_and_bad_axes():
    """Without batch axes each shard reports its own figures (a different, biased
    load-balancing loss): the reference above can tell them apart. Axes that are not
    manual shard_map axes fail with a message naming them."""
    mesh = build_mesh("fsdp=8")
    logits = jnp.asarray(np.random.default_rng(3).normal(size=(B, E)) * 2.0, jnp.float32)
    want, _ = aux_np(logits, K, B // 8, 8)
    per_shard = jax.jit(jax.shard_map(
        lambda x: route_top_k(x, K, B // 8)[2]["load_balance_loss"][None], mesh=mesh,
        in_specs=P("fsdp"), out_specs=P("fsdp"), check_vma=False))(logits)
    assert abs(float(np.mean(per_shard)) - want["load_balance_loss"]) > 1e-3
    assert aux_loss_scale(logits) == 1.0
    with pytest.raises(ValueError, match=r"batch_axes\(\('fsdp',\)\).*not manual axes"):
        route_top_k(logits, K, B, ("fsdp",))
    with pytest.raises(ValueError, match="axis_name"):
        set_mesh_axes(nnx.Module(), batch_axes=())


# test_expert_parallel's smallest full teacher (4 experts, top-2, no capacity drops) with
# the load-balancing loss ON (lb_coef 0.05, 5x the default, so a wrong scale shows).
TEACHER = EP_TEACHER.replace("model.lb_coef=0,", "model.lb_coef=0.05,")
assert TEACHER != EP_TEACHER


@pytest.mark.slow
def test_trainer_with_load_balancing_loss_matches_one_device():
    """3 train steps with lb_coef > 0 on replica=2,fsdp=2,expert=2 (EP on: the trainer's
    default there; the batch, and so the global aux, over all 3 axes) equal one device:
    losses, the global parameter scale and every router / expert leaf within 1e-5. Other
    leaves within 5e-5: zero-initialised biases after Adam carry float32 reduction-order
    noise of the sharded sums (measured up to 2.5e-5 here with lb_coef 0.05 and 1.2e-5
    with lb_coef 0, on a pyramid bias the router does not touch; key biases, true
    gradient 0, see equivalence.KEY_BIAS). Before the global aux (per-shard loss,
    attached N times) router leaves differed O(1). The expert weights are placed over
    `expert`, the compiled step all_to_alls over `expert` and never all-gathers the
    expert weights over it (tables are replicated here, so no other collective touches
    that axis), while FSDP still gathers. The global aux over fsdp=8's batch axis: the
    formula test above; the experts a mesh without `expert` gathers whole:
    test_gathered_experts_match_one_device below."""
    from gemjax.train.equivalence import KEY_BIAS, global_rel_diff, train_steps
    from test_expert_parallel import collective_axes, expert_weight_gathers

    spec = "replica=2,fsdp=2,expert=2"
    single = train_steps(None, 3, overrides=TEACHER, evaluate=False)
    assert max_rel_diff(single["init_params"], single["params"]) > 1e-3   # the steps do train
    moe = lambda t: t["interformer"]["layers"][0]["interaction"]         # noqa: E731
    res = train_steps(spec, 3, overrides=TEACHER, tables0=single["init_tables"], hlo=True,
                      evaluate=False)
    np.testing.assert_allclose(res["losses"], single["losses"], rtol=1e-5)
    assert max_rel_diff(moe(res["params"]), moe(single["params"])) < 1e-5
    keep = lambda t: [v for k, v in jax.tree_util.tree_leaves_with_path(t)   # noqa: E731
                      if not any(b in jax.tree_util.keystr(k) for b in KEY_BIAS)]
    assert global_rel_diff(keep(res["params"]), keep(single["params"])) < 1e-5
    assert max_rel_diff(res["params"], single["params"], skip=KEY_BIAS) < 5e-5
    assert max_rel_diff(res["tables"], single["tables"]) < 1e-5
    assert set(res["plans"].values()) == {"replicated"}
    specs = moe(res["shardings"]["params"])["experts"]
    assert all(s.startswith("P('expert'") for s in jax.tree.leaves(specs)), specs
    text = res["hlo"]
    a2a = collective_axes(text, "all-to-all")
    assert len([a for a, _ in a2a if a == {"expert"}]) >= 4, a2a   # dispatch + combine, fwd + bwd
    # (the replicated tables' sparse update gathers ids and [32, 8] activation grads over
    # every axis, `expert` included; those are not expert weights)
    assert not expert_weight_gathers(text)
    gathers = collective_axes(text, "all-gather")
    assert [a for a, s in gathers if a == {"fsdp"} and s.startswith("f32[")]  # FSDP gathers


def test_gathered_experts_match_one_device():
    """On a mesh without `expert` (fsdp=8) the trainer's rule finds no EP axes, so each
    shard gathers the whole [E, ...] expert weights (sharded over fsdp) and routes its
    own samples: the layer's output and its gradients w.r.t. every param and the input
    equal the one-device layer's (test_expert_parallel.sharded_layer runs it the way the
    trainer does)."""
    from test_expert_parallel import B as EB, D as ED, N as EN, make, sharded_layer
    mesh = build_mesh("fsdp=8")
    graphdef, state = make(top_k=2)
    params = state.to_pure_dict()
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.normal(size=(EB, EN, ED)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(EB, EN, ED)), jnp.float32)   # a generic cotangent for y
    fn, placed, ep_axes, x_sh = sharded_layer(graphdef, state, mesh)
    assert ep_axes is None
    assert any("fsdp" in str(a.sharding.spec) for a in jax.tree.leaves(placed["experts"]))

    def loss_and_y(apply):
        def loss(p, x):
            y = apply(p, x)
            return jnp.sum(y * w), y
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))

    (l1, y1), g1 = loss_and_y(lambda p, x: nnx.merge(graphdef, p)(x)[0])(params, x)
    (l, y), g = loss_and_y(lambda p, x: fn(p, x)[0])(placed, jax.device_put(x, x_sh))
    assert max_rel_diff(y, y1) < 1e-5 and abs(float(l) - float(l1)) <= 1e-5 * abs(float(l1))
    assert max_rel_diff(g[1], g1[1]) < 1e-5                                       # d loss / d x
    n_expert = 0
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g[0]), jax.tree.leaves(g1[0])):
        assert np.max(np.abs(np.asarray(b))) > 0, jax.tree_util.keystr(path)   # a real gradient
        assert max_rel_diff(a, b) < 1e-5, (jax.tree_util.keystr(path), max_rel_diff(a, b))
        n_expert += "experts" in jax.tree_util.keystr(path)
    assert n_expert > 0 and len(jax.tree.leaves(g[0])) > n_expert       # experts and router
