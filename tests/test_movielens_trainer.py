"""The MovieLens-1M ranking recipe of docs/results.md on a small fake MovieLens:
its converter command on the fake files tests/test_converters.py writes, then its train
command, 2 steps, for each model the README names (the GEM teacher, Wukong + sequence
encoder, Wukong alone, logistic regression) through gemjax.train.loop.train, each
evaluated on every test row and checkpointed (the schema has no dense feature).
"""

import dataclasses
import json
import math
import os
import re
import shlex
import subprocess
import sys

import jax
import numpy as np
import pyarrow.parquet as pq
import pytest
from jax.sharding import Mesh

from gemjax.config import apply_overrides, get_config
from gemjax.features import FeatureSchema
from tests.test_converters import write_ml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA_OUT = "/tmp/gemjax-data/ml-1m"          # the README's converter --out
# the README's model variants: the override that replaces model.kind=teacher
VARIANTS = {"teacher": "model.kind=teacher", "gem": "model.kind=gem",
            "wukong": "model.kind=gem,model.use_sequences=false", "lr": "model.kind=lr"}


def _readme_commands():
    """(converter words, train words) of docs/results.md's MovieLens ranking block."""
    text = open(os.path.join(ROOT, "docs", "results.md")).read()
    data = text[text.index("\n## MovieLens-1M ranking\n"):]
    block = next(b for b in re.findall(r"```bash\n(.*?)```", data, re.S) if "movielens_rank" in b)
    lines = [" ".join(ln.split()) for ln in block.replace("\\\n", " ").splitlines() if ln.strip()]
    (conv,) = [shlex.split(ln) for ln in lines if "experiments.convert_movielens" in ln]
    (run,) = [shlex.split(ln) for ln in lines if ln.startswith("./run train")]
    for variant in VARIANTS.values():
        assert f"`{variant}`" in data or variant == VARIANTS["teacher"], variant
    return conv, run


@pytest.fixture(scope="module")
def fake_ranking(tmp_path_factory):
    """The README's converter command on the fake MovieLens: (ranking dir, train words)."""
    conv, run = _readme_commands()
    src, out = tmp_path_factory.mktemp("ml-1m"), tmp_path_factory.mktemp("conv")
    write_ml(src)
    assert conv[:3] == ["python", "-m", "experiments.convert_movielens"]
    args = [a.replace(DATA_OUT, str(out)) for a in conv[3:]] + [f"--data_dir={src}"]
    r = subprocess.run([sys.executable, "-m", conv[2]] + args, cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return out / "ranking", [a.replace(DATA_OUT, str(out)) for a in run]


def _config(words, variant):
    """The README's train command (its preset, --features, --seed, --override) with this
    variant's model override, 2 steps of 8 samples; the teacher with one InterFormer layer
    (the preset's second repeats the first: the recipe's schema meets the same modules)."""
    flags = dict(w[2:].split("=", 1) for w in words[2:])
    cfg = get_config(flags["config"])
    schema = FeatureSchema.from_dict(json.load(open(flags["features"])))
    cfg = dataclasses.replace(cfg, features=schema)
    override = flags["override"].replace(VARIANTS["teacher"], VARIANTS[variant])
    assert override != flags["override"] or variant == "teacher"
    cfg = apply_overrides(cfg, override)
    return apply_overrides(cfg, {
        "train.seed": flags["seed"], "train.steps": "2", "train.eval_every": "2",
        "train.checkpoint_every": "2", "train.log_every": "1", "train.warmup_steps": "1",
        "train.tensorboard": "false", "data.batch_size": "8",
        **({"model.interformer_layers": "1"} if variant == "teacher" else {})})


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_readme_movielens_ranking_recipe_trains_each_model(fake_ranking, variant, tmp_path):
    from gemjax.train.loop import train
    ranking, words = fake_ranking
    cfg = _config(words, variant)
    assert cfg.data.source == "parquet" and cfg.data.eval_batches == 0
    assert cfg.features.dense == () and cfg.model.kind == VARIANTS[variant].split(",")[0][11:]
    mesh = Mesh(np.array(jax.devices()[:1]), ("batch",))
    summary = train(cfg, str(tmp_path / "run"), log=lambda s: None, mesh=mesh)

    test = pq.read_table(ranking / "test.parquet").to_pydict()
    rows = [json.loads(ln) for ln in open(tmp_path / "run" / "metrics.jsonl")]
    (ev,) = [r for r in rows if r["kind"] == "eval"]
    assert ev["step"] == 2 and ev["count"] == len(test["label"]) == 5 * 5   # 5 users, 1 + 4 each
    assert math.isfinite(summary["eval_ne"]) and 0.0 <= summary["eval_auc"] <= 1.0
    assert summary["bayes_ne"] is None
    assert os.listdir(tmp_path / "run" / "checkpoints") == ["2"]   # saved with no dense feature
