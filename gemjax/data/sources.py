"""Where a run's batches come from: `make_source(cfg, stream)`.

A source has `shard_batch(step, shard, num_shards) -> (Batch, ShardInfo)` (a pure
function of (seed, stream, step, shard)) and `schema` (gemjax.data.features). The
synthetic planted-teacher stream is the only source so far; the trainer and the
evaluator take theirs from here.
"""

from __future__ import annotations

from gemjax.config import Config
from gemjax.data.features import differences
from gemjax.data.synthetic import SyntheticStream


def make_source(cfg: Config, stream: str = "train", *, seed: int | None = None) -> SyntheticStream:
    """The source of `stream` ("train" | "eval") for cfg; seed None: cfg.train.seed.

    cfg.features, when set, must be the source's schema (ValueError naming the differences).
    """
    source = SyntheticStream(cfg.data, cfg.train.seed if seed is None else seed, stream)
    if cfg.features is not None:
        diffs = differences(source.schema, cfg.features, old="in the stream", new="in config.features")
        if diffs:
            raise ValueError("config.features does not describe the synthetic stream of config.data: "
                             + "; ".join(diffs))
    return source
