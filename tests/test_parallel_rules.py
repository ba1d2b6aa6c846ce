"""Logical-axis rules: spec resolution, flag overrides, constraints and param sharding on 8 CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from gemjax.parallel import rules as pr
from gemjax.parallel.mesh import build_mesh


@pytest.fixture(scope="module")
def mesh():
    return build_mesh("replica=2,fsdp=2,expert=2")


def test_parse_rules_overrides_and_errors():
    r = pr.parse_rules("mlp=fsdp+expert, embed=, batch=replica")
    assert r["mlp"] == ("fsdp", "expert") and r["embed"] == () and r["batch"] == ("replica",)
    assert r["expert"] == pr.DEFAULT_RULES["expert"]
    for bad in ("mlp", "1x=fsdp", "mlp=fsdp+fsdp"):
        with pytest.raises(ValueError, match="--logical_rules"):
            pr.parse_rules(bad)


def test_logical_to_spec_resolution(mesh):
    # activations: batch takes every axis, embed then has nothing left
    assert pr.logical_to_spec(("batch", "embed"), mesh=mesh, shape=(16, 8)) == P(("replica", "fsdp", "expert"), None)
    # batch of 2 only divides by replica; embed then takes fsdp
    assert pr.logical_to_spec(("batch", "embed"), mesh=mesh, shape=(2, 8)) == P("replica", "fsdp")
    # dense kernel: FSDP on the first dim; the second dim cannot reuse fsdp
    assert pr.logical_to_spec(("embed", "mlp"), mesh=mesh, shape=(8, 6)) == P("fsdp", None)
    # odd first dim: fsdp moves to the divisible dim
    assert pr.logical_to_spec(("embed", "mlp"), mesh=mesh, shape=(3, 6)) == P(None, "fsdp")
    assert pr.logical_to_spec(("expert", "embed", "mlp"), mesh=mesh, shape=(2, 4, 4)) == P("expert", "fsdp", None)
    # axes missing from the mesh are dropped
    small = build_mesh("fsdp=8")
    assert pr.logical_to_spec(("batch", None), mesh=small) == P("fsdp", None)
    with pytest.raises(ValueError, match="'nonsense' has no rule"):
        pr.logical_to_spec(("nonsense",), mesh=mesh)
    with pytest.raises(ValueError, match="rank 1"):
        pr.logical_to_spec(("batch", "embed"), mesh=mesh, shape=(4,))


def test_fsdp_spec_largest_divisible_dim(mesh):
    assert pr.fsdp_spec((3, 10, 4), mesh) == P(None, "fsdp", None)
    assert pr.fsdp_spec((3, 5), mesh) == P()
    assert pr.fsdp_spec((), mesh) == P()
    assert pr.fsdp_spec((8, 8), mesh) == P("fsdp", None)


def test_with_logical_constraint_values_and_layout(mesh):
    x = np.random.default_rng(0).normal(size=(16, 8)).astype(np.float32)

    @jax.jit
    def f(a):
        h = pr.with_logical_constraint(jnp.tanh(a) * 2.0, ("batch", "embed"))
        return pr.with_logical_constraint(h.sum(axis=1), ("batch",))

    with jax.set_mesh(mesh):
        y = f(x)
    np.testing.assert_allclose(np.asarray(y), (np.tanh(x.astype(np.float64)) * 2).sum(1), rtol=1e-5)
    assert y.sharding.spec == P(("replica", "fsdp", "expert"))
    # without a mesh it is the identity
    z = pr.with_logical_constraint(jnp.asarray(x), ("batch", "embed"))
    np.testing.assert_array_equal(np.asarray(z), x)


class _Model(nnx.Module):
    def __init__(self, rngs):
        init = nnx.initializers.lecun_normal()
        self.up = nnx.Linear(8, 12, rngs=rngs, kernel_metadata={"out_sharding": ("embed", "mlp")})
        self.down = nnx.Linear(12, 4, rngs=rngs, kernel_metadata={"out_sharding": ("mlp", "embed")})
        self.experts = nnx.Param(init(rngs.params(), (2, 8, 6)), out_sharding=("expert", "embed", "mlp"))
        self.plain = nnx.Param(init(rngs.params(), (5, 6)))  # no metadata -> FSDP fallback


def test_shard_params_uses_metadata_then_fsdp(mesh):
    with nnx.use_eager_sharding(False):
        model = _Model(nnx.Rngs(0))
    _, state = nnx.split(model)
    placed = pr.shard_params(state, None, mesh)
    specs = {"/".join(map(str, k)): v.get_value().sharding.spec for k, v in nnx.to_flat_state(placed)}
    assert specs["up/kernel"] == P("fsdp", None)
    assert specs["down/kernel"] == P("fsdp", None)  # (mlp, embed): mlp takes fsdp first
    assert specs["experts"] == P("expert", "fsdp", None)
    assert specs["plain"] == P(None, "fsdp")
    assert specs["up/bias"] == P("fsdp")  # 12 divisible by 2
    assert specs["down/bias"] == P("fsdp")
    # values unchanged
    for (k, a), (_, b) in zip(nnx.to_flat_state(state), nnx.to_flat_state(placed)):
        np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()))


def test_sharded_forward_matches_float64_numpy(mesh):
    with nnx.use_eager_sharding(False):
        model = _Model(nnx.Rngs(1))
    graphdef, state = nnx.split(model)
    state = pr.shard_params(state, pr.parse_rules("embed=,mlp=fsdp+expert"), mesh)
    specs = {"/".join(map(str, k)): v.get_value().sharding.spec for k, v in nnx.to_flat_state(state)}
    assert specs["up/kernel"] == P(None, ("fsdp", "expert")) and specs["down/kernel"] == P(("fsdp", "expert"), None)
    x = np.random.default_rng(2).normal(size=(16, 8)).astype(np.float32)

    @jax.jit
    def fwd(state, x):
        m = nnx.merge(graphdef, state)
        x = pr.with_logical_constraint(x, ("batch", "embed"))
        return m.down(jax.nn.relu(m.up(x)))

    with jax.set_mesh(mesh):
        y = fwd(state, x)
    flat = {"/".join(map(str, k)): np.asarray(v.get_value(), np.float64) for k, v in nnx.to_flat_state(state)}
    h = np.maximum(x.astype(np.float64) @ flat["up/kernel"] + flat["up/bias"], 0)
    ref = h @ flat["down/kernel"] + flat["down/bias"]
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5, atol=1e-5)


def test_shardings_of_abstract_state_and_optimizer_state(mesh):
    import optax

    def make():
        return nnx.Linear(8, 12, rngs=nnx.Rngs(0), kernel_metadata={"out_sharding": ("mlp", "embed")})

    with nnx.use_eager_sharding(False):
        _, abstract = nnx.split(nnx.eval_shape(make))  # no arrays allocated: shardings for a sharded init
        sh = pr.param_shardings(abstract, mesh)
        assert sh["kernel"].spec == P("fsdp", None) and sh["bias"].spec == P("fsdp")
        opt = nnx.Optimizer(make(), optax.adam(1e-3), wrt=nnx.Param)
    _, opt_state = nnx.split(opt)
    specs = {"/".join(map(str, k)): s.spec for k, s in nnx.to_flat_state(pr.param_shardings(opt_state, mesh))}
    # Adam moments inherit the kernel's logical names, so they shard like the kernel
    assert specs["opt_state/0/mu/kernel"] == P("fsdp", None) == specs["opt_state/0/nu/kernel"]
    assert specs["opt_state/0/count"] == P()
