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
the evaluator, the equivalence runs and the export take theirs from it): the
synthetic planted-teacher stream, whose `schema` (gemjax.data.features) must be
the config's.
"""

from __future__ import annotations

import dataclasses
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


def make_source(cfg, stream: str = "train", *, seed: int | None = None):
    """The source of `stream` ("train" | "eval") for a gemjax.config.Config; seed None:
    cfg.train.seed. cfg.features, when set, must describe the source (ValueError naming
    each difference, gemjax.data.features.differences)."""
    from gemjax.data.features import differences
    from gemjax.data.synthetic import SyntheticStream
    source = SyntheticStream(cfg.data, cfg.train.seed if seed is None else seed, stream)
    if cfg.features is not None:
        diffs = differences(source.schema, cfg.features, old="in the stream", new="in config.features")
        if diffs:
            raise ValueError("config.features does not describe the synthetic stream of config.data: "
                             + "; ".join(diffs))
    return source
