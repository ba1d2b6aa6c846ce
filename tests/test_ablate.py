"""experiments/ablate.py: the variant table builds the intended configs and models, bad
names are refused, one variant trains through the script's run function; the teacher's
ModelConfig fields parse from override strings."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

from gemjax.config import field_paths, get_config
from gemjax.models.gem import build_model
from experiments import ablate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What each variant must change in the full model's ModelConfig, written out by hand.
EXPECTED = {
    "full": {},
    "no_sequences": {"kind": "gem", "use_sequences": False},
    "no_pma": {"teacher.pma_tokens": 0},
    "no_cross_layer": {"teacher.cross_layer_attention": False},
    "no_experts": {"teacher.num_experts": 0},
    "softmax_attention": {"attention": "softmax"},
    "gdpa_attention": {"attention": "gdpa"},
}


def _model_diff(a, b):
    da, db = field_paths(a.model), field_paths(b.model)
    return {k: db[k] for k in da if da[k] != db[k]}


@pytest.mark.parametrize("preset", ["tiny", "small", "h200"])
def test_every_variant_changes_exactly_its_component(preset):
    assert set(ablate.VARIANTS) == set(EXPECTED)
    full = ablate.full_config(preset)
    assert (full.model.kind, full.model.teacher.num_experts, full.model.attention) == ("teacher", 4, "block")
    assert full.model.use_sequences and full.model.teacher.pma_tokens > 0 and full.model.teacher.cross_layer_attention
    for name in ablate.VARIANTS:
        cfg = ablate.variant_config(full, name, seed=3, steps=7)
        assert _model_diff(full, cfg) == EXPECTED[name], name
        assert cfg.data == full.data
        assert (cfg.train.seed, cfg.train.steps, cfg.train.baselines) == (3, 7, False)


def test_variant_configs_build_the_intended_models():
    # small (two Wukong layers, so cross-layer attention exists); shapes only, no compile.
    full = ablate.full_config("small")
    models = {name: nnx.eval_shape(lambda c=ablate.variant_config(full, name, 0): build_model(c, nnx.Rngs(0)))
              for name in ablate.VARIANTS}
    layer = lambda n: models[n].interformer.layers[0]
    assert type(models["no_sequences"]).__name__ == "GEMv0"
    assert all(type(m).__name__ == "GEMTeacher" for n, m in models.items() if n != "no_sequences")
    assert layer("full").cross.pma is not None and layer("no_pma").cross.pma is None
    assert layer("full").use_experts and not layer("no_experts").use_experts
    assert layer("full").interaction.num_experts == 4
    assert len(layer("no_experts").interaction.cross_layer) == full.model.wukong_layers - 1 > 0
    no_cl = ablate.variant_config(full, "no_experts", 0)
    no_cl = dataclasses.replace(no_cl, model=dataclasses.replace(no_cl.model, teacher=dataclasses.replace(
        no_cl.model.teacher, cross_layer_attention=False)))
    assert len(nnx.eval_shape(lambda: build_model(no_cl, nnx.Rngs(0))).interformer.layers[0]
               .interaction.cross_layer) == 0
    assert {n: layer(n).self_attn.attention for n in ("full", "softmax_attention", "gdpa_attention")} == \
        {"full": "block", "softmax_attention": "softmax", "gdpa_attention": "gdpa"}


def test_override_string_reaches_the_teacher():
    cfg = get_config("tiny", "model.kind=teacher,model.num_experts=3,model.top_k=2,"
                             "model.pyramid_levels=16:2:1/8:2:0/16:none:1,model.capacity_factor=1.5,"
                             "model.interformer_layers=1,model.cls_tokens=0,model.head_towers=shared")
    m = cfg.model.teacher
    assert m.pyramid_levels == ((16, 2, 1), (8, 2, 0), (16, None, 1))
    assert (m.num_experts, m.top_k, m.capacity_factor, m.cls_tokens) == (3, 2, 1.5, 0)
    model = nnx.eval_shape(lambda: build_model(cfg, nnx.Rngs(0)))
    assert [lv.pooled for lv in model.pyramid.pyramids["clicks"].levels] == [2, 2, None]
    assert [lv.block for lv in model.pyramid.pyramids["clicks"].levels] == [16, 8, 16]
    assert len(model.interformer.layers) == 1
    ex = model.interformer.layers[0].interaction
    assert (ex.num_experts, ex.top_k, ex.capacity_factor) == (3, 2, 1.5)
    assert model.interformer.out_tokens == m.summary_tokens + m.pma_tokens + m.recent_tokens
    assert get_config("tiny", "model.capacity_factor=none,model.pyramid_levels=none").model \
        == get_config("tiny").model


@pytest.mark.parametrize("bad, needle", [
    ("model.pyramid_levels=16:2", "3 ':'-separated fields"),
    ("model.pyramid_levels=16:none:1/16:none:1", "model.teacher.pyramid_levels"),
    ("model.pyramid_levels=16:x:1", "model.teacher.pyramid_levels"),
    ("model.num_experts=2,model.top_k=3", "model.teacher.top_k"),
    ("model.cls_tokens=0,model.pma_tokens=0,model.recent_tokens=0", "model.teacher.pma_tokens"),
    ("model.capacity_factor=0", "model.teacher.capacity_factor"),
    ("model.head_towers=per_task", "model.teacher.head_towers"),
    ("model.seq_attention=gdpa", "no field 'seq_attention'"),
])
def test_bad_teacher_overrides_name_the_field(bad, needle):
    with pytest.raises(ValueError, match=needle):
        get_config("tiny", bad)


def test_variant_names_and_seeds_are_checked():
    assert ablate.parse_variants(["all"]) == list(ablate.VARIANTS)
    assert ablate.parse_variants(["gdpa_attention", "no_pma"]) == ["full", "no_pma", "gdpa_attention"]
    assert ablate.parse_variants(["gdpa_attention", "no_pma"], with_full=False) == ["no_pma", "gdpa_attention"]
    assert "full" not in ablate.parse_variants(["all"], with_full=False)
    with pytest.raises(ValueError, match="no_pmaa"):
        ablate.parse_variants(["no_pma", "no_pmaa"])
    with pytest.raises(ValueError, match="bogus"):
        ablate.variant_config(ablate.full_config("tiny"), "bogus", 0)
    with pytest.raises(ValueError, match="--seeds"):
        ablate.parse_seeds(["0", "x"])
    with pytest.raises(ValueError, match="--seeds"):
        ablate.parse_seeds(["1", "1"])
    r = subprocess.run([sys.executable, "-m", "experiments.ablate",
                        "--variants=full,no_sequence", "--workdir=/nonexistent/never"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "--variants: unknown ['no_sequence']" in r.stderr


def test_interformer_max_len_follows_the_pyramid():
    # 2 sequences; tiny: seq_cap 32, block 32, default levels pool each block to 4.
    assert ablate.interformer_max_len(ablate.full_config("tiny")) == 2 * 4
    cfg = ablate.full_config("tiny", "data.seq_cap=100,model.pyramid_levels=16:3:1/5:2:1/8:none:1")
    assert ablate.interformer_max_len(cfg) == 2 * (-(-(7 * 3) // 5) * 2)


def test_table_pairs_deltas_by_seed():
    rng = np.random.default_rng(0)
    ne = {(v, s): float(rng.uniform(0.7, 0.9)) for v in ("full", "no_pma") for s in (0, 1, 2)}
    runs = [{"variant": v, "seed": s, "summary": {"eval_ne": x, "eval_auc": 0.7, "bayes_ne": 0.6 + s}}
            for (v, s), x in ne.items()]
    rows = {r["variant"]: r for r in ablate.table(runs[::-1], ["full", "no_pma", "no_experts"])}
    assert set(rows) == {"full", "no_pma"}
    d = np.array([ne["no_pma", s] - ne["full", s] for s in (0, 1, 2)])
    np.testing.assert_allclose([rows["no_pma"]["delta_ne_mean"], rows["no_pma"]["delta_ne_std"]],
                               [d.mean(), d.std(ddof=1)], rtol=1e-12)
    x = np.array([ne["no_pma", s] for s in (0, 1, 2)])
    np.testing.assert_allclose([rows["no_pma"]["eval_ne_mean"], rows["no_pma"]["eval_ne_std"]],
                               [x.mean(), x.std(ddof=1)], rtol=1e-12)
    assert rows["full"]["delta_ne_mean"] == 0 and rows["full"]["bayes_ne_mean"] == pytest.approx(1.6)
    assert "no_pma" in ablate.format_table(list(rows.values()), 7, "tiny")


def test_one_variant_trains_two_steps_and_reruns_reuse(tmp_path):
    # A trimmed teacher (one InterFormer layer, one pyramid level without layers, no
    # experts, s_sum of one recent token only): compile time is CPU budget.
    full = ablate.full_config("tiny", "model.interformer_layers=1,model.pyramid_levels=16:none:0,"
                                      "model.cls_tokens=0,model.pma_tokens=0,model.recent_tokens=1")
    cfg = ablate.variant_config(full, "no_experts", seed=1, steps=2)
    mesh = Mesh(np.array(jax.devices()[:1]), ("batch",))
    wd, lines = str(tmp_path / "no_experts"), []
    summary = ablate.run(cfg, wd, log=lines.append, mesh=mesh)
    assert summary["steps"] == 2 and summary["model"] == "teacher"
    assert np.isfinite(summary["eval_ne"]) and 0 < summary["bayes_ne"] < summary["eval_ne"] + 1
    with open(os.path.join(wd, "summary.json")) as f:
        assert json.load(f)["eval_ne"] == summary["eval_ne"]
    assert ablate.finished(cfg, wd) == summary        # what --table_only tabulates
    with pytest.raises(ValueError, match="another config"):
        ablate.finished(ablate.variant_config(full, "no_experts", seed=1, steps=3), wd)
    assert ablate.finished(cfg, str(tmp_path / "absent")) is None
    lines.clear()
    assert ablate.run(cfg, wd, log=lines.append, mesh=mesh) == summary
    assert any("reusing" in line for line in lines)
    other = ablate.variant_config(full, "no_experts", seed=2, steps=2)
    with pytest.raises(ValueError, match="another config"):
        ablate.run(other, wd, log=lines.append, mesh=mesh)
