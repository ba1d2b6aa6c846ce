"""gemjax.precision.policy: region membership from where a linear sits, the defaults
(heads and the last layer in model.dtype), bad names rejected, precision="bf16" leaving
the model untouched, and FP8 linears really lowering to FP8 GEMMs in the train step."""

import dataclasses
import re

import pytest
from flax import nnx

from gemjax.config import get_config
from gemjax.models.gem import build_model
from gemjax.models.interformer import GEMTeacher
from gemjax.precision.policy import (Fp8DotGeneral, Policy, fp8_linears, linear_regions,
                                     region_of)


def _model(overrides):
    cfg = get_config("tiny", overrides)
    return cfg, nnx.eval_shape(lambda: build_model(cfg, nnx.Rngs(0)))


def test_regions_and_default_exclusions():
    _, m = _model("model.kind=teacher,model.precision=fp8,model.interformer_layers=2")
    regions = {"/".join(map(str, p)): r for p, r in linear_regions(m).items()}
    fp8 = set(fp8_linears(m))
    assert regions["head/tower/0/linears/0"] == ("heads", False)
    assert regions["interformer/layers/0/self_attn/q_proj"] == ("attn_proj", False)
    assert regions["interformer/layers/0/interaction/layers/0/fmb_mlp/linears/0"] == ("wukong", False)
    assert regions["interformer/layers/0/ffn/linears/1"] == ("interformer", False)
    assert regions["interformer/layers/1/ffn/linears/1"] == ("interformer", True)
    assert regions["interformer/final_cross/x_summary/linears/0"] == ("interformer", True)
    assert regions["dense_proj"] == ("inputs", False)
    assert region_of(("interformer", "layers", 0, "interaction", "router")) == "router"
    assert any(p.startswith("pyramid/") and r == ("sequence", False) for p, r in regions.items())
    # default: fp8 = every linear of wukong / interformer / attn_proj / sequence outside the
    # heads and the last layer
    want = {p for p, (r, last) in regions.items()
            if r in ("wukong", "interformer", "attn_proj", "sequence") and not last}
    assert fp8 == want and len(fp8) > 20
    assert not any(p.startswith(("head", "interformer/layers/1", "interformer/final_cross"))
                   for p in fp8)
    # the exclusions are configurable: nothing excluded puts the heads' linears in FP8 too
    _, m2 = _model("model.kind=teacher,model.precision=fp8,model.fp8_exclude=,"
                   "model.fp8_regions=heads+wukong")
    assert set(fp8_linears(m2)) == {p for p, (r, _) in regions.items() if r in ("heads", "wukong")}


def test_bad_names_rejected():
    m = get_config("tiny").model
    for field, value, msg in [("format", "fp16", "model.precision.format"),
                              ("regions", "wukong+mlp", "model.precision.regions: unknown names \\['mlp'\\]"),
                              ("exclude", "heads+first", "model.precision.exclude"),
                              ("scaling", "mx", "model.precision.scaling"),
                              ("wgrad_dtype", "fp16", "model.precision.wgrad_dtype"),
                              ("fast_accum", "all", "model.precision.fast_accum"),
                              ("amax_history", 0, "model.precision.amax_history"),
                              ("margin", -1, "model.precision.margin")]:
        with pytest.raises(ValueError, match=msg):
            Policy.from_model_config(dataclasses.replace(
                m, precision=dataclasses.replace(m.precision, **{field: value})))
    fast = dataclasses.replace(m, precision=dataclasses.replace(m.precision, format="fp8",
                                                                fast_accum="forward"))
    assert Policy.from_model_config(fast).recipe.fast_accum == "forward"


def test_bf16_leaves_the_model_untouched():
    cfg, m = _model("model.kind=teacher")
    bare = nnx.eval_shape(lambda: GEMTeacher(cfg, rngs=nnx.Rngs(0)))
    assert nnx.graphdef(m) == nnx.graphdef(bare) and fp8_linears(m) == []
    assert not any(isinstance(n, nnx.Linear) and isinstance(n.dot_general, Fp8DotGeneral)
                   for _, n in nnx.iter_graph(m))


def test_fp8_linears_lower_to_fp8_gemms():
    """The lowered train step holds, per FP8 linear, one E4M3 x E4M3 forward, one
    E5M2 x E4M3 dgrad and one E4M3 x E5M2 wgrad GEMM, and no other FP8 GEMM."""
    from gemjax.data.feeding import Feeder
    from gemjax.data.synthetic import SyntheticStream
    from gemjax.train.step import Trainer

    import jax
    import jax.numpy as jnp

    cfg = get_config("tiny", "model.kind=teacher,model.dtype=bfloat16,model.precision=fp8")
    tr = Trainer.create(cfg)
    assert not tr.fp8_meta_keys()         # current scaling: no amax histories in the state
    # init_state's shapes, dtypes and shardings: lowering reads no values, and drawing the
    # teacher's params eagerly costs more than the lowering
    params = nnx.split(nnx.eval_shape(lambda: build_model(cfg, nnx.Rngs(0))), nnx.Param)[1].to_pure_dict()
    shapes = {"step": jax.ShapeDtypeStruct((), jnp.int32), "params": params,
              "opt_state": jax.eval_shape(tr.tx.init, params),
              "tables": jax.eval_shape(tr.coll.init, jax.random.key(1))}
    state = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes,
                         tr.state_shardings())
    feeder = Feeder(SyntheticStream(cfg.data, 0).shard_batch, tr.mesh)
    batch = feeder.to_device(feeder.host_batch(0)[0])
    text = tr.make_train_step().lower(state, batch).as_text()
    dots = re.findall(r"stablehlo\.dot_general .*?: \(tensor<[0-9x]*x(\w+)>, tensor<[0-9x]*x(\w+)>\)",
                      text)
    fp8 = [d for d in dots if "f8" in d[0] or "f8" in d[1]]
    n = len(fp8_linears(nnx.eval_shape(lambda: build_model(cfg, nnx.Rngs(0)))))
    assert n > 20 and len(fp8) == 3 * n
    assert fp8.count(("f8E4M3FN", "f8E4M3FN")) == n
    assert fp8.count(("f8E5M2", "f8E4M3FN")) == n and fp8.count(("f8E4M3FN", "f8E5M2")) == n
