"""GEM teacher composition (models/interformer.py) on a tiny synthetic batch."""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gemjax.config import get_config
from gemjax.models.interformer import GEMTeacher, attach_aux_loss
from tiny_teacher import teacher_config, teacher_inputs   # tests/tiny_teacher.py


def test_attach_aux_loss_adds_coef_times_aux_gradient():
    w = jnp.array([0.3, -1.2, 2.0])

    def attached(w):
        y = attach_aux_loss(jnp.sin(w), jnp.sum(w ** 2), 0.5)
        return jnp.sum(y * jnp.array([1.0, 2.0, 3.0]))

    def explicit(w):
        return jnp.sum(jnp.sin(w) * jnp.array([1.0, 2.0, 3.0])) + 0.5 * jnp.sum(w ** 2)

    assert float(attached(w)) == float(jnp.sum(jnp.sin(w) * jnp.array([1.0, 2.0, 3.0])))
    np.testing.assert_allclose(np.asarray(jax.grad(attached)(w)), np.asarray(jax.grad(explicit)(w)),
                               rtol=1e-6)


def test_teacher_logits_depend_on_sequences_and_surface():
    # A smaller teacher than the defaults (one InterFormer layer, one pyramid level): the
    # composition is what is tested here, and compile time is CPU test budget.
    cfg = teacher_config(batch_size=16)
    model = GEMTeacher(cfg, rngs=nnx.Rngs(0))
    batch, acts = teacher_inputs(cfg)
    b = batch.dense.shape[0]
    logits = nnx.jit(lambda m, a, bt: m(a, bt))(model, acts, batch)
    assert logits.shape == (b, cfg.data.synthetic.num_tasks) and np.isfinite(np.asarray(logits)).all()
    # Per-block gradient flow is tested with each layer; here: the sequence side and the
    # surface reach the logits (a composition that dropped either would pass the shape check).
    acts2 = dict(acts)
    acts2["clicks.item"] = acts["clicks.item"] * 2.0
    logits2 = nnx.jit(lambda m, a, bt: m(a, bt))(model, acts2, batch)
    has_clicks = np.asarray(batch.sequences["clicks"].lengths) > 0
    moved = np.abs(np.asarray(logits2) - np.asarray(logits)).max(-1) > 1e-6
    np.testing.assert_array_equal(moved, has_clicks)
    flipped = batch.replace(surface=(batch.surface + 1) % cfg.data.synthetic.num_surfaces)
    logits3 = nnx.jit(lambda m, a, bt: m(a, bt))(model, acts, flipped)
    assert np.abs(np.asarray(logits3) - np.asarray(logits)).max() > 1e-4


def test_ffn_activation_reaches_every_teacher_ffn():
    """model.ffn_activation sets the pyramid's and the InterFormer Sequence Arch's FFNs (and
    nothing else): each FFN's output equals its two Linears around that activation."""
    import pytest
    from gemjax.config import apply_overrides, validate
    base = get_config("tiny")
    model_cfg = dataclasses.replace(base.model, teacher=dataclasses.replace(
        base.model.teacher, interformer_layers=1, pyramid_levels=((16, 2, 1),), num_experts=0,
        ffn_activation="gelu_tanh"))
    cfg = types.SimpleNamespace(data=base.data, model=model_cfg)
    model = GEMTeacher(cfg, rngs=nnx.Rngs(0))
    ffns = [model.interformer.layers[0].ffn] + [
        lv.encoder.blocks[0].ffn for p in model.pyramid.pyramids.values() for lv in p.levels]
    x = jax.random.normal(jax.random.key(1), (5, model_cfg.dim))
    for ffn in ffns:
        assert ffn.activation == "gelu_tanh"
        l0, l1 = ffn.linears
        want = l1(jax.nn.gelu(l0(x), approximate=True))
        exact = l1(jax.nn.gelu(l0(x), approximate=False))
        np.testing.assert_allclose(np.asarray(ffn(x)), np.asarray(want), rtol=1e-6, atol=1e-6)
        assert float(jnp.max(jnp.abs(want - exact))) > 1e-6      # the two forms do differ
    with pytest.raises(ValueError, match="model.teacher.ffn_activation"):
        validate(apply_overrides(get_config("tiny"), "model.kind=teacher,model.ffn_activation=gelu2"))


def test_token_bias_false_drops_the_pyramid_biases_only():
    """model.token_bias=False: no bias on the pyramid's block-attention projections, FFNs and
    pooling attention; the InterFormer and the heads keep theirs."""
    base = get_config("tiny")
    cfgs = [types.SimpleNamespace(data=base.data, model=dataclasses.replace(
        base.model, teacher=dataclasses.replace(
            base.model.teacher, interformer_layers=1, pyramid_levels=((16, 2, 1),), num_experts=0,
            token_bias=tb))) for tb in (True, False)]
    with_b, without = (GEMTeacher(c, rngs=nnx.Rngs(0)) for c in cfgs)
    level = next(iter(without.pyramid.pyramids.values())).levels[0]
    linears = [level.encoder.blocks[0].attn.q_proj, level.encoder.blocks[0].attn.out_proj,
               *level.encoder.blocks[0].ffn.linears, level.pool.k_proj, level.pool.v_proj]
    assert all(lin.bias is None for lin in linears)
    assert without.interformer.layers[0].ffn.linears[0].bias is not None
    count = lambda m: sum(x.size for x in jax.tree.leaves(nnx.state(m, nnx.Param)))
    d, n_pyr = base.model.dim, len(with_b.pyramid.pyramids)
    # per pyramid: 4 self-attention projections (d) + FFN (2d + d) + 4 pooling projections (d)
    assert count(with_b) - count(without) == n_pyr * (4 * d + 3 * d + 4 * d)
