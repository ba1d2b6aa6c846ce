"""The source protocol: what the Feeder and the train loop read batches from.

A source cuts every global step into `num_shards` shards (one per device of the
mesh, numbered globally) and builds shard `shard` of step `step` as

    batch, info = source.shard_batch(step, shard, num_shards)

a pure function of (the source's seed, step, shard, num_shards): the same call
gives the same bytes in any process, at any time, in any order, from any
thread. Resuming at step k therefore replays exactly the uninterrupted run, and
a run resumed on another mesh reads a defined stream (`feeding.regroup` packs K
source shards onto any device count dividing K, so those meshes see the same
samples). `batch` is a `Batch` of numpy arrays with

    sparse[f]   [b] int32        b = local_batch_size(num_shards)
    dense       [b, F] float32
    sequences   {name: Jagged}   capacity T = sequence_capacity(num_shards)
                                 (the same for every step and shard: jit sees one shape)
    labels, label_mask [b, K] float32;  surface [b] int32;  weights [b] float32

and `info` holds the side outputs of the shard. Fallback counters (inputs the
source repaired instead of refusing: truncated sequences, clamped ids, filled
NaNs, ...) are read through `fallback_counters(info)`, which understands both
`SourceInfo` (counters in a dict) and older dataclass infos whose integer fields
are counters (`synthetic.ShardInfo`). `SourceInfo` also exposes the two counters
the train loop reads by attribute (`seq_truncated_to_cap`,
`seq_truncated_to_capacity`), and `feeding.merge_infos` merges it (counters
summed key by key, `rows` concatenated).

`make_source(cfg, stream)` is the one place a run's source is chosen (the trainer,
the evaluator, the equivalence runs and the export take theirs from it), by
cfg.data.source:
  "synthetic"  the planted-teacher stream, whose `schema` (gemjax.features)
               must be the config's; with data.drift.every > 0 the drifting stream
               (gemjax.data.drift, stream "train" of seed train.seed) instead, in
               time order: "train" reads its steps from data.drift.start on (run
               step i is stream step drift_start + i), "eval" its data.eval_batches
               steps after the run's training, from drift_start + train.steps (the
               future the run never trained on), "valid" is refused, and so is
               data.drift.new_id_rate > 0 (raw ids past the tables need an id admission:
               gemjax.train.online);
  "parquet"    a `gemjax.data.parquet.ParquetSource` over the files of
               data.train_path (order data.order) or data.eval_path (file order),
               columns from cfg.features (`parquet.columns_from_schema`). With
               data.eval_batches = 0 the eval stream is `OneEpoch`: every eval row
               once, the rows past the end of the last batch masked out. With
               data.negatives = N > 0 the train files hold positives only and the
               train stream is `gemjax.data.negatives.ResampledNegatives`:
               data.batch_size / (1 + N) positives a step, each followed by N
               negatives drawn per epoch.
`eval_steps(source, cfg)` is the eval stream's number of batches, and
`counter_names(source)` the fallback counters its infos carry (the train loop
sums them into metrics.jsonl).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Iterable, Mapping, Protocol, runtime_checkable

import numpy as np

from gemjax.data.batch import Batch


@runtime_checkable
class Source(Protocol):
    """A sharded, seeded batch source (see the module docstring)."""

    def local_batch_size(self, num_shards: int) -> int:
        """b, the samples of one shard (global batch / num_shards)."""
        ...

    def sequence_capacity(self, num_shards: int) -> int | Mapping[str, int]:
        """Static packed token capacity of a shard's sequences: one int for every
        sequence, or {sequence name: capacity}; a multiple of 128."""
        ...

    def shard_batch(self, step: int, shard: int, num_shards: int) -> tuple[Batch, Any]:
        """(Batch of numpy arrays, info) for shard `shard` of global step `step`."""
        ...


def capacity_of(source: Source, num_shards: int, name: str) -> int:
    """The packed capacity of sequence `name` in one shard of `source`."""
    cap = source.sequence_capacity(num_shards)
    return int(cap[name]) if isinstance(cap, Mapping) else int(cap)


class Counters(dict):
    """{counter name: int}; `a + b` sums key by key, and `0 + a` is `a` (so `sum()` works)."""

    def __add__(self, other):
        if isinstance(other, int) and other == 0:
            return Counters(self)
        if not isinstance(other, Mapping):
            return NotImplemented
        out = Counters(self)
        for k, v in other.items():
            out[k] = out.get(k, 0) + int(v)
        return out

    __radd__ = __add__


@dataclasses.dataclass
class SourceInfo:
    """Side outputs of one shard: fallback counters and the ids of the samples served.

    counters  {name: int} repaired inputs in this shard (a `Counters`)
    rows      [b] int64 the source's id of each sample (for a file source: the
              row's number in the source's global file order), in batch order
    """

    counters: Counters
    rows: np.ndarray

    @property
    def seq_truncated_to_cap(self) -> int:
        """Sequences longer than their cap (oldest events dropped)."""
        return int(self.counters.get("seq_truncated_to_cap", 0))

    @property
    def seq_truncated_to_capacity(self) -> int:
        """Sequences cut further so the packed batch fits its capacity."""
        return int(self.counters.get("seq_truncated_to_capacity", 0))


def fallback_counters(info: Any) -> dict[str, int]:
    """{counter: int} of one shard's info: a SourceInfo's counters, or the integer
    fields of another dataclass info (e.g. synthetic.ShardInfo); {} otherwise."""
    if isinstance(info, SourceInfo):
        return {k: int(v) for k, v in info.counters.items()}
    if dataclasses.is_dataclass(info) and not isinstance(info, type):
        return {f.name: int(getattr(info, f.name)) for f in dataclasses.fields(info)
                if isinstance(getattr(info, f.name), (int, np.integer))
                and not isinstance(getattr(info, f.name), bool)}
    return {}


def sum_counters(infos: Iterable[Any]) -> dict[str, int]:
    """Fallback counters summed over several shards' infos."""
    total: dict[str, int] = {}
    for info in infos:
        for k, v in fallback_counters(info).items():
            total[k] = total.get(k, 0) + v
    return total


class OneEpoch:
    """Every row of a time-ordered file source once: `num_steps` = ceil(N / B) steps;
    rows of the last step past row N (the source wraps to the start) carry
    label_mask 0 and weight 0, so metrics count each row once."""

    def __init__(self, source):
        if getattr(source, "order", None) != "time":
            raise ValueError("OneEpoch reads a time-ordered source (order='time')")
        self.source = source
        self.num_steps = -(-source.num_rows // source.batch_size)
        self.counter_names = tuple(getattr(source, "counter_names", ()))

    def local_batch_size(self, num_shards: int) -> int:
        return self.source.local_batch_size(num_shards)

    def sequence_capacity(self, num_shards: int):
        return self.source.sequence_capacity(num_shards)

    def shard_batch(self, step: int, shard: int, num_shards: int) -> tuple[Batch, Any]:
        batch, info = self.source.shard_batch(step, shard, num_shards)
        b = self.source.local_batch_size(num_shards)
        past = step * self.source.batch_size + shard * b + np.arange(b) >= self.source.num_rows
        if past.any():
            batch = batch.replace(label_mask=np.where(past[:, None], 0, batch.label_mask).astype(np.float32),
                                  weights=np.where(past, 0, batch.weights).astype(np.float32))
        return batch, info


def eval_steps(source, cfg) -> int:
    """Batches of an eval pass over `source`: its `num_steps` (OneEpoch), else
    cfg.data.eval_batches."""
    return int(getattr(source, "num_steps", 0) or cfg.data.eval_batches)


def counter_names(source) -> tuple[str, ...]:
    """The fallback counters every shard info of `source` carries (beyond the sequence
    truncation counters every source reports); () if it declares none."""
    return tuple(getattr(source, "counter_names", ()))


def valid_files(d) -> str:
    """data.valid_path of a DataConfig as read: a bare file name (no directory part, no glob)
    is that file in data.train_path's directory (the directory itself when train_path is
    one); anything else as given."""
    path = d.valid_path
    if not path or os.path.dirname(path) or any(ch in path for ch in "*?["):
        return path
    base = d.train_path if os.path.isdir(d.train_path) else os.path.dirname(d.train_path)
    return os.path.join(base, path)


def make_source(cfg, stream: str = "train", *, seed: int | None = None):
    """The source of `stream` ("train" | "eval" | "valid") for a gemjax.config.Config
    (module docstring); seed None: cfg.train.seed. "valid": the validation rows of model
    selection, read like the eval rows (data.valid_path, `valid_files`); on the synthetic
    source a held-out stream seeded apart from train and eval. Synthetic: cfg.features,
    when set, must describe the stream (ValueError naming each difference,
    gemjax.features.differences). Parquet: ValueError / FileNotFoundError naming
    the path, file or column that does not fit cfg.features."""
    if stream not in ("train", "eval", "valid"):
        raise ValueError(f"stream must be 'train', 'eval' or 'valid', got {stream!r}")
    if stream == "valid" and not cfg.data.valid_path:
        raise ValueError("the validation stream needs data.valid_path (data.valid_path=synthetic "
                         "for the synthetic source)")
    seed = cfg.train.seed if seed is None else seed
    d = cfg.data
    if d.source == "parquet":
        from gemjax.data.parquet import ParquetSource, columns_from_schema
        if cfg.features is None:
            raise ValueError("data.source=parquet needs config.features, the feature schema of "
                             "the files")
        columns = columns_from_schema(cfg.features)
        path, field = {"train": (d.train_path, "data.train_path"),
                       "eval": (d.eval_path, "data.eval_path"),
                       "valid": (valid_files(d), "data.valid_path")}[stream]
        if not path:
            raise ValueError(f"data.source=parquet needs {field}")
        if stream == "train" and d.negatives:     # positives-only rows, negatives per epoch
            from gemjax.data.negatives import resample
            positives = dataclasses.replace(d, negatives=0, batch_size=d.batch_size // (1 + d.negatives))
            return resample(make_source(dataclasses.replace(cfg, data=positives), seed=seed), cfg)
        try:
            source = ParquetSource(path, columns, d.batch_size, seed,
                                   order=d.order if stream == "train" else "time",
                                   window=d.shuffle_window, nan=d.nan,
                                   capacity_slack=d.capacity_slack,
                                   dense_max_abs=d.dense_max_abs)
        except (ValueError, FileNotFoundError) as e:
            hint = ("; the validation rows of model selection (train.select_metric): write "
                    "them, or pass train.select_metric= and train.patience=0 to train without "
                    "selection") if stream == "valid" else ""
            raise type(e)(f"{field}={path}: {e}{hint}") from None
        return OneEpoch(source) if stream != "train" and d.eval_batches == 0 else source
    if d.source != "synthetic":
        raise ValueError(f"data.source must be synthetic or parquet, got {d.source!r}")
    from gemjax.features import differences
    from gemjax.data.synthetic import SyntheticStream
    if d.drift.every > 0:
        source = _drifting(cfg, stream, seed)
    else:
        source = SyntheticStream(d, seed, stream)
    if cfg.features is not None:
        diffs = differences(source.schema, cfg.features, old="in the stream", new="in config.features")
        if diffs:
            raise ValueError("config.features does not describe the synthetic stream of config.data: "
                             + "; ".join(diffs))
    return source


def _drifting(cfg, stream: str, seed: int):
    """make_source's drifting stream (module docstring)."""
    from gemjax.data.drift import DriftingStream, StreamFrom
    d = cfg.data
    if stream == "valid":
        raise ValueError("data.drift.every > 0: the drifting stream has no validation rows "
                         "(data.valid_path must be empty)")
    if d.drift.new_id_rate:
        raise ValueError(f"data.drift.every > 0 with data.drift.new_id_rate={d.drift.new_id_rate}: raw ids "
                         f"past the tables need an id admission (gemjax.train.online); use "
                         f"data.drift.new_id_rate=0")
    drifting = DriftingStream(d, seed, "train")
    if stream == "train":
        return StreamFrom(drifting, d.drift.start)
    return StreamFrom(drifting, d.drift.start + cfg.train.steps)
