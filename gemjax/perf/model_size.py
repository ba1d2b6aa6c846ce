"""A config's model size without building it: parameter counts and FLOPs per sample.

``param_counts(cfg)`` traces the model constructor under ``nnx.eval_shape``: every
parameter is a ShapeDtypeStruct, nothing is allocated, so a 1B-parameter preset is
counted on a laptop in seconds. Dense parameters are the model's nnx.Param leaves
(the Wukong experts included: leaves under an ``experts`` attribute, the stacked
[E, ...] expert weights); embedding parameters are the sparse tables of the
config's feature schema (vocab x width; they live in the EmbeddingCollection, not
in the model).

``step_flops_per_sample(cfg)`` is gemjax.perf.model_flops' analytic model count of
one train step (3 x forward, valid tokens only) on the config's own source batch,
divided by its samples.

    PYTHONPATH=. python -m gemjax.perf.model_size --config=gem1b

prints both.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Sequence

import jax
import numpy as np
from flax import nnx

from gemjax.config import Config, schema_of


@dataclasses.dataclass(frozen=True)
class ParamCounts:
    """Parameter counts of a config's model: dense (experts included), expert, embedding."""

    dense: int
    experts: int
    embedding: int

    @property
    def outside_experts(self) -> int:
        return self.dense - self.experts


def param_counts(cfg: Config) -> ParamCounts:
    """cfg's ParamCounts, from shapes only (nnx.eval_shape of gemjax.models.gem.build_model)."""
    from gemjax.models.gem import build_model

    model = nnx.eval_shape(lambda: build_model(cfg, nnx.Rngs(0)))
    dense = experts = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param)):
        n = int(np.prod(leaf.shape))
        dense += n
        if any(getattr(k, "key", None) == "experts" for k in path):
            experts += n
    schema = schema_of(cfg)
    embedding = sum(t.vocab * (t.dim or cfg.model.dim) for t in schema.tables)
    return ParamCounts(dense, experts, embedding)


def step_flops_per_sample(cfg: Config, step: int = 0, seed: int = 0) -> float:
    """Analytic model FLOPs of one train step per sample, on batch `step` of cfg's source
    (one shard: the whole global batch on one device). Needs model.kind="teacher"."""
    from gemjax.data.source import make_source
    from gemjax.perf.model_flops import batch_step_flops

    batch, _ = make_source(cfg, seed=seed).shard_batch(step, 0, 1)
    return batch_step_flops(cfg, batch) / batch.dense.shape[0]


def preset_parser(description: str) -> argparse.ArgumentParser:
    """An argument parser with --config (default gem1b) and --override, for parse_preset."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--config", default="gem1b", help="preset")
    ap.add_argument("--override", default="", help="section.field=value,...")
    return ap


def parse_preset(ap: argparse.ArgumentParser, argv: Sequence[str] | None):
    """-> (args, the Config of --config with --override); a bad preset or override exits
    with the parser's error naming it."""
    from gemjax.config import get_config

    args = ap.parse_args(argv)
    try:
        return args, get_config(args.config, args.override or None)
    except ValueError as e:
        ap.error(str(e))


def main(argv: Sequence[str] | None = None) -> None:
    ap = preset_parser("Parameter counts (from shapes) and analytic train-step FLOPs per "
                       "sample of a preset's model.")
    args, cfg = parse_preset(ap, argv)
    p = param_counts(cfg)
    d = cfg.data
    print(f"{cfg.name}: dense parameters {p.dense:,} = {p.dense / 1e6:,.1f}M ({p.experts / 1e6:,.1f}M "
          f"in experts, {p.outside_experts / 1e6:,.1f}M outside), embedding {p.embedding:,} = "
          f"{p.embedding / 1e6:,.1f}M")
    print(f"data: batch {d.batch_size}, sequences log-normal median {d.synthetic.seq_median:g} sigma "
          f"{d.synthetic.seq_sigma:g} cap {d.synthetic.seq_cap}, packed capacity {d.sequence_capacity:,} tokens per "
          f"sequence per step")
    if cfg.model.kind == "teacher":
        f = step_flops_per_sample(cfg)
        print(f"model FLOPs per sample per train step: {f / 1e9:.2f} GFLOP "
              f"({f * d.batch_size / 1e12:.2f} TFLOP a step of {d.batch_size})")


if __name__ == "__main__":
    main()
