"""The gem1b preset: its size (parameters from shapes, analytic FLOPs) pinned, its shape
requirements, and its forward + backward traced without allocating a parameter."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gemjax.config import get_config
from gemjax.data.synthetic import SEQUENCE_FIELDS, SEQUENCES, SPARSE_FEATURES, SyntheticStream
from gemjax.models.gem import build_model
from gemjax.perf import model_size

# gemjax.perf.model_size on the preset: (dense, experts, embedding) parameters and the
# analytic train-step FLOPs of the seed-0 stream's batch 0 (1,024 samples, one shard).
PINNED_PARAMS = (1_253_331_204, 965_176_304, 1_536_162_816)
PINNED_STEP_FLOPS = 51_893_929_390_080


def test_gem1b_shape_requirements():
    cfg = get_config("gem1b")
    d, m, s, t = cfg.data, cfg.model, cfg.data.synthetic, cfg.model.teacher
    assert m.kind == "teacher" and m.dtype == "bfloat16" and m.dim >= 512
    assert t.num_experts >= 2 and t.cls_tokens and t.pma_tokens and t.recent_tokens
    assert len(SEQUENCES) >= 2 and s.seq_median >= 1024 and s.seq_cap >= 8192
    assert d.batch_size >= 1024
    # the packed capacity holds the expected tokens (5% of histories are empty) with slack
    mean_len = s.seq_median * np.exp(s.seq_sigma ** 2 / 2)
    assert 1.0 < d.sequence_capacity / (0.95 * mean_len * d.batch_size) < 1.3


def test_gem1b_parameter_and_flop_counts_are_pinned(capsys):
    cfg = get_config("gem1b")
    p = model_size.param_counts(cfg)
    assert (p.dense, p.experts, p.embedding) == PINNED_PARAMS
    assert p.dense >= 1e9 and p.outside_experts >= 250e6
    flops = model_size.step_flops_per_sample(cfg) * cfg.data.batch_size
    assert round(flops) == PINNED_STEP_FLOPS and flops / cfg.data.batch_size >= 20e9
    model_size.main(["--config=gem1b"])
    out = capsys.readouterr().out
    assert "dense parameters 1,253,331,204 = 1,253.3M (965.2M in experts, 288.2M outside)" in out
    assert f"{flops / cfg.data.batch_size / 1e9:.2f} GFLOP" in out


def test_param_counts_match_a_materialised_model():
    # the shape-only count against the parameters of a built (small) teacher with experts
    cfg = get_config("gem1b", "model.dim=16,model.seq_heads=2,model.wukong_mlp=32,model.head_mlp=16,"
                              "model.fmb_tokens=4,model.lcb_tokens=4,model.fm_rank=4,"
                              "data.vocab_user=1000,data.vocab_item=640")
    model = build_model(cfg, nnx.Rngs(0))
    leaves = jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))
    dense = sum(x.size for _, x in leaves)
    experts = sum(x.size for path, x in leaves if "experts" in jax.tree_util.keystr(path))
    p = model_size.param_counts(cfg)
    assert (p.dense, p.experts) == (dense, experts) and 0 < experts < dense


def test_gem1b_forward_and_backward_trace_from_shapes():
    cfg = get_config("gem1b")
    model = nnx.eval_shape(lambda: build_model(cfg, nnx.Rngs(0)))
    batch, _ = SyntheticStream(cfg.data, 0).shard_batch(0)
    b, d = batch.dense.shape[0], cfg.model.dim
    acts = {f: jax.ShapeDtypeStruct((b, d), jnp.bfloat16) for f in SPARSE_FEATURES}
    for s in SEQUENCES:
        for f in SEQUENCE_FIELDS:
            acts[f"{s}.{f}"] = jax.ShapeDtypeStruct((batch.sequences[s].capacity, d), jnp.bfloat16)
    graph, state = nnx.split(model)

    def loss(state, acts):
        return nnx.merge(graph, state)(acts, batch).astype(jnp.float32).sum()

    grads = jax.eval_shape(jax.grad(loss), state, acts)
    assert jax.tree_util.tree_structure(grads) == jax.tree_util.tree_structure(state)
