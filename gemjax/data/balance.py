"""Base Batch Shuffling (BBS): every rank gets a balanced share of a step's jagged load.

With jagged sequences the ranks of a data-parallel step hold different numbers of
tokens, and the step runs at the pace of the most loaded one. BBS cuts the global
batch of B samples into G = B / s small sub-batches of s samples (s =
data.bbs_sub_batch), sorts them by their sequence tokens (largest first) and
deals them out in snake order (ranks 0, 1, ..., R-1, R-1, ..., 0, 0, 1, ...), so
each of the R ranks gets G / R sub-batches and about 1 / R of the tokens:

    plan = snake_plan(tokens_per_sub_batch, num_ranks)     # [R, G / R] sub-batch ids
    source = train_source(cfg)                              # the loop's train source

Mechanism, no communication: the step's samples are those of the source without
BBS, its R shards (`shard_batch(step, c, R)`, each a pure function of (seed,
step, c, R)). The ranks are cut into `groups` contiguous blocks of K = R / groups
ranks (groups = 1: one block, every rank); sub-batches move only within a block.
Block sub-batch j is samples [j s, (j + 1) s) of the concatenation of the block's
K shards. Every process builds the step's shards of each block it feeds (once per
step, shared by the Feeder threads asking for its ranks: `BalancedSource`), reads
the sub-batches' lengths, computes the block's plan and keeps the sub-batches of
its own ranks. So a step trains on exactly the samples it trains on without BBS,
only their rank changes (the shards are built with twice the packed capacity, so
where the source alone would cut a shard's sequences to fit, only the balanced
rank's packing cuts), and the plan is a pure function of (seed, step, R, groups):
a resumed run replays it. `train_source` picks the blocks by source:

  synthetic  groups = 1: every process builds the whole step (cheap: a pure
             function of the step, P x the host work of its share with P
             processes) and the step is balanced over all R devices;
  parquet    groups = P, the process count: a process's devices are one block
             (gemjax.data.feeding.Feeder: a contiguous run of shards), so each
             process reads only its own devices' rows, as without BBS, and
             balances them over its devices. With one process (one host and its
             GPUs) that is the whole step.

A rank's sub-batches are packed, in plan order, into the rank's static capacity
(the source's shard capacity); a rank whose tokens do not fit loses its longest
sequences' oldest events (gemjax.data.jagged.fit_to_capacity), counted in
seq_truncated_to_capacity.

Rank load (`shard_load`): tokens = the events of every sequence of the shard;
pairs = sum over its samples and sequences of L^2, the (query, key) pairs of a
full self-attention over each sample's events (the quadratic part of the
work). `load_ratio(values)` = max / mean over the ranks; the train loop logs
both ratios of every step in metrics.jsonl (`LoadLog`).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Any, Callable, Mapping

import jax
import numpy as np

from gemjax.data.batch import Batch
from gemjax.data.feeding import merge_infos, merge_shards
from gemjax.data.jagged import Jagged, fit_to_capacity, layout_from_lengths


def snake_plan(keys: np.ndarray, num_ranks: int) -> np.ndarray:
    """[G] sub-batch loads -> [R, G / R] int64 sub-batch ids per rank.

    Sub-batches sorted by load, largest first (ties: lower id first), dealt to ranks
    0..R-1, then R-1..0, and so on. Each rank's ids are in dealing order."""
    keys = np.asarray(keys)
    g = keys.shape[0]
    if num_ranks < 1 or g % num_ranks:
        raise ValueError(f"snake_plan: {g} sub-batches cannot be dealt evenly to {num_ranks} ranks")
    order = np.argsort(-keys, kind="stable")
    rounds = order.reshape(g // num_ranks, num_ranks).copy()
    rounds[1::2] = rounds[1::2, ::-1]              # odd rounds deal R-1 .. 0
    return rounds.T.astype(np.int64)


def identity_plan(num_sub_batches: int, num_ranks: int) -> np.ndarray:
    """[R, G / R]: rank r gets sub-batches r G / R .. (r + 1) G / R - 1 (no balancing)."""
    if num_ranks < 1 or num_sub_batches % num_ranks:
        raise ValueError(f"identity_plan: {num_sub_batches} sub-batches cannot be split evenly "
                         f"over {num_ranks} ranks")
    return np.arange(num_sub_batches, dtype=np.int64).reshape(num_ranks, -1)


def sample_lengths(batch: Batch) -> np.ndarray:
    """[S, B] events per sample of each of the batch's S sequences (one shard's offsets)."""
    return np.stack([np.diff(np.asarray(j.offsets)).astype(np.int64)
                     for j in batch.sequences.values()]) if batch.sequences else np.zeros((0, 0), np.int64)


def shard_load(batch: Batch) -> tuple[int, int]:
    """(tokens, pairs) of one shard (module docstring)."""
    lens = sample_lengths(batch)
    return int(lens.sum()), int((lens * lens).sum())


def load_ratio(values) -> float:
    """max / mean of the ranks' loads (1.0 when all are 0)."""
    v = np.asarray(values, np.float64)
    mean = v.mean()
    return float(v.max() / mean) if mean > 0 else 1.0


def pack_shards(parts: list[tuple[Batch, int, int]],
                capacity: int | Mapping[str, int]) -> tuple[Batch, int]:
    """Sample ranges (batch, lo, hi) -> (one shard holding samples lo..hi-1 of each part,
    in order, every sequence packed into `capacity` tokens (one int, or {sequence name:
    tokens}); sequences cut to fit). A cut sample keeps its most recent events."""
    seqs, n_cut = {}, 0
    caps = capacity
    for name in parts[0][0].sequences:
        capacity = caps[name] if isinstance(caps, Mapping) else caps
        jags = [(p.sequences[name], lo, hi) for p, lo, hi in parts]
        spans = [np.asarray(j.offsets)[[lo, hi]].astype(np.int64) for j, lo, hi in jags]
        lengths = np.concatenate([np.diff(np.asarray(j.offsets)[lo:hi + 1]).astype(np.int64)
                                  for j, lo, hi in jags])
        cut = fit_to_capacity(lengths, capacity)
        n_cut += int((cut < lengths).sum())
        offsets, segment_ids, positions = layout_from_lengths(cut, capacity)
        keep = None
        if (cut < lengths).any():
            total = int(lengths.sum())
            seg = np.repeat(np.arange(lengths.shape[0]), lengths)
            pos_from_end = np.cumsum(lengths)[seg] - 1 - np.arange(total)
            keep = pos_from_end < cut[seg]

        def field(key):
            pieces = [np.asarray(j.values[key])[a:b] for (j, _, _), (a, b) in zip(jags, spans)]
            if keep is not None:
                pieces = [np.concatenate(pieces)[keep]]
            out = np.empty((capacity,) + pieces[0].shape[1:], pieces[0].dtype)
            at = 0
            for v in pieces:                              # one copy, straight into the buffer
                out[at:at + v.shape[0]] = v
                at += v.shape[0]
            out[at:] = 0
            return out

        seqs[name] = Jagged({k: field(k) for k in jags[0][0].values}, offsets, segment_ids, positions)
    flat = [jax.tree.map(lambda x, lo=lo, hi=hi: np.asarray(x)[lo:hi], p.replace(sequences={}))
            for p, lo, hi in parts]
    return merge_shards(flat).replace(sequences=seqs), n_cut


def _slice_info(info: Any, lo: int, hi: int, counters: bool) -> Any:
    """Samples lo..hi-1 of a dataclass info: per-sample arrays sliced, integer counters
    (fields, or a {name: int} field such as SourceInfo.counters) kept (counters=True) or
    zeroed, so a shard's counters are counted once."""
    if not dataclasses.is_dataclass(info):
        return info
    out = {}
    for f in dataclasses.fields(info):
        v = getattr(info, f.name)
        if isinstance(v, np.ndarray):
            out[f.name] = v[lo:hi]
        elif isinstance(v, (int, np.integer)) and not isinstance(v, bool):
            out[f.name] = v if counters else 0
        elif isinstance(v, Mapping):
            out[f.name] = v if counters else type(v)(dict.fromkeys(v, 0))
        else:
            out[f.name] = v
    return type(info)(**out)


def _count_cut(info: Any, n_cut: int) -> Any:
    """info with n_cut more sequences in its seq_truncated_to_capacity counter (a field,
    or a key of its `counters` mapping)."""
    if not n_cut:
        return info
    fields = {f.name for f in dataclasses.fields(info)} if dataclasses.is_dataclass(info) else set()
    if "seq_truncated_to_capacity" in fields:
        return dataclasses.replace(info, seq_truncated_to_capacity=info.seq_truncated_to_capacity + n_cut)
    if isinstance(getattr(info, "counters", None), Mapping):
        counters = type(info.counters)(info.counters)
        counters["seq_truncated_to_capacity"] = counters.get("seq_truncated_to_capacity", 0) + n_cut
        return dataclasses.replace(info, counters=counters)
    return info


class BalancedSource:
    """A source (gemjax.data.source protocol) whose shards are BBS's ranks.

    inner: the source without BBS, built with room to spare (INNER_ROOM); capacity:
    the ranks' packed capacity by rank count (the source's own without BBS); sub_batch:
    s samples per sub-batch; balance: False deals the sub-batches without sorting
    (identity_plan: rank r holds inner shard r); groups: the blocks of ranks balanced
    apart (module docstring; 1: all ranks together). Thread safe (the Feeder's workers
    call shard_batch concurrently); keeps a step's inner shards of a block until each
    of its ranks was built once (a process that builds only some of a block's ranks
    never gets there: then the newest `keep_steps` steps are kept); a step asked for
    again is rebuilt, the same.
    """

    def __init__(self, inner, capacity: Callable[[int], Any], batch_size: int, sub_batch: int,
                 balance: bool = True, keep_steps: int = 16, groups: int = 1):
        if sub_batch < 1 or batch_size % sub_batch:
            raise ValueError(f"data.bbs_sub_batch={sub_batch} must be >= 1 and divide "
                             f"data.batch_size={batch_size}")
        if groups < 1:
            raise ValueError(f"BBS: groups must be >= 1, got {groups}")
        self.inner, self._capacity = inner, capacity
        self.batch_size, self.sub_batch, self.balance = batch_size, sub_batch, balance
        self.num_sub_batches = batch_size // sub_batch
        self.groups = groups
        self._steps: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()
        self._keep = keep_steps

    def __getattr__(self, name):              # schema, counter_names, ... of the inner source
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def local_batch_size(self, num_shards: int) -> int:
        return self.inner.local_batch_size(num_shards)

    def sequence_capacity(self, num_shards: int):
        return self._capacity(num_shards)

    def block(self, shard: int, num_shards: int) -> tuple[int, int]:
        """(lo, K): the block of ranks lo .. lo + K - 1 that shard `shard` is balanced with."""
        if num_shards % self.groups:
            raise ValueError(f"BBS: the {num_shards} devices cannot be cut into {self.groups} "
                             f"equal blocks (one per process)")
        k = num_shards // self.groups
        return shard - shard % k, k

    def inner_shards(self, step: int, num_shards: int, first: int = 0) -> list[tuple[Batch, Any]]:
        """The step's K shards without BBS of the block holding shard `first` (each built
        once per (step, num_shards), cached).

        Threads asking for the same step share the work: each builds the shards no
        other thread has claimed yet (from shard `first` on), then waits for the rest."""
        lo, k = self.block(first, num_shards)
        key = (step, num_shards, lo)
        with self._lock:
            entry = self._steps.get(key)
            if entry is None:
                entry = self._steps[key] = {"claimed": [False] * k, "served": 0,
                                            "done": [threading.Event() for _ in range(k)],
                                            "shards": [None] * k}
                while len(self._steps) > self._keep:
                    self._steps.popitem(last=False)
        for c in [(first - lo + i) % k for i in range(k)]:
            with self._lock:
                if entry["claimed"][c]:
                    continue
                entry["claimed"][c] = True
            try:
                entry["shards"][c] = self.inner.shard_batch(step, lo + c, num_shards)
            finally:
                entry["done"][c].set()
        for c, done in enumerate(entry["done"]):
            done.wait()
            if entry["shards"][c] is None:
                with self._lock:
                    self._steps.pop(key, None)
                raise RuntimeError(f"BBS: building shard {lo + c} of step {step} failed in "
                                   f"another thread")
        return list(entry["shards"])

    def sub_batch_loads(self, step: int, num_shards: int, first: int = 0) -> np.ndarray:
        """[G_K, 2] (tokens, pairs) of the step's sub-batches in the block of shard `first`
        (G_K = K b / s; the whole step's G with groups = 1)."""
        s = self.sub_batch
        out = []
        for batch, _ in self.inner_shards(step, num_shards, first):
            lens = sample_lengths(batch)                             # [S, b]
            per = lens.reshape(lens.shape[0], -1, s)
            out.append(np.stack([per.sum((0, 2)), (per * per).sum((0, 2))], 1))
        return np.concatenate(out)

    def plan(self, step: int, num_shards: int, first: int = 0) -> np.ndarray:
        """[K, G_K / K] block sub-batch ids of each rank of the block holding shard `first`
        at `step` (groups = 1: [R, G / R], every rank)."""
        b = self.local_batch_size(num_shards)
        if b % self.sub_batch:
            raise ValueError(f"BBS: data.bbs_sub_batch={self.sub_batch} must divide the "
                             f"{b} samples of each of the {num_shards} devices")
        _, k = self.block(first, num_shards)
        if not self.balance:
            return identity_plan(k * b // self.sub_batch, k)
        return snake_plan(self.sub_batch_loads(step, num_shards, first)[:, 0], k)

    def shard_batch(self, step: int, shard: int, num_shards: int) -> tuple[Batch, Any]:
        if not 0 <= shard < num_shards:
            raise ValueError(f"shard {shard} out of range for {num_shards} shards")
        first, ranks = self.block(shard, num_shards)
        ids = self.plan(step, num_shards, first=shard)[shard - first]
        shards = self.inner_shards(step, num_shards, first=shard)
        per = self.local_batch_size(num_shards) // self.sub_batch     # sub-batches per inner shard
        parts, infos = [], []
        for j in ids:
            c, k = divmod(int(j), per)
            lo, hi = k * self.sub_batch, (k + 1) * self.sub_batch
            parts.append((shards[c][0], lo, hi))
            # the inner shard's counters go with its first sub-batch
            infos.append(_slice_info(shards[c][1], lo, hi, counters=k == 0))
        with self._lock:                             # every rank built: drop the block's shards
            entry = self._steps.get((step, num_shards, first))
            if entry is not None:
                entry["served"] += 1
                if entry["served"] >= ranks:
                    del self._steps[(step, num_shards, first)]
        batch, n_cut = pack_shards(parts, self.sequence_capacity(num_shards))
        return batch, _count_cut(merge_infos(infos), n_cut)


# The inner shards' capacity over the ranks': a shard the source would cut to its capacity
# is built whole (its draws, so its samples, do not depend on the capacity) and only the
# rank's packing cuts, after balancing.
INNER_ROOM = 2.0


# data.source -> whether each process balances only its own devices (module docstring)
PER_PROCESS = {"synthetic": False, "parquet": True}


def train_source(cfg, seed: int | None = None, processes: int | None = None):
    """The train loop's source: make_source(cfg, "train"), with data.bbs a BalancedSource
    over the same stream built with INNER_ROOM x its capacity, balanced over every
    device (synthetic) or over each process's devices (parquet; processes: the
    process count, None: jax.process_count()). ValueError naming data.bbs for a
    source BBS cannot balance."""
    from gemjax.data.source import make_source

    d = cfg.data
    if getattr(d, "bbs", False) and d.source not in PER_PROCESS:
        raise ValueError(f"data.bbs=true: Base Batch Shuffling balances the "
                         f"{' and '.join(PER_PROCESS)} sources, not data.source={d.source!r}; "
                         f"set data.bbs=false")
    plain = make_source(cfg, "train", seed=seed)
    if not getattr(d, "bbs", False):
        return plain
    roomy = dataclasses.replace(cfg, data=dataclasses.replace(
        d, capacity_slack=INNER_ROOM * d.capacity_slack))
    groups = (jax.process_count() if processes is None else processes) if PER_PROCESS[d.source] else 1
    return BalancedSource(make_source(roomy, "train", seed=seed), plain.sequence_capacity,
                          d.batch_size, d.bbs_sub_batch, groups=groups)


class LoadLog:
    """Per-step rank loads for metrics.jsonl: `wrap(make_shard)` records each shard's
    (tokens, pairs) as the Feeder builds it; `step_done(step)` takes the step's loads
    (the shards this process built); `row()` gives, over the steps since the last row,
    the mean and the largest of each step's max / mean ratios and each rank's mean
    tokens (`load_tokens_per_rank`, in shard order), and starts the next window."""

    def __init__(self, num_shards: int):
        self.num_shards = num_shards
        self._loads: dict[tuple[int, int], tuple[int, int]] = {}
        self._steps: list[np.ndarray] = []      # [R, 2] (tokens, pairs) per finished step
        self._lock = threading.Lock()           # the Feeder's threads record, the loop takes

    def wrap(self, make_shard):
        def make(step: int, shard: int, num_shards: int):
            batch, info = make_shard(step, shard, num_shards)
            load = shard_load(batch)
            with self._lock:
                self._loads[(step, shard)] = load
            return batch, info
        return make

    def step_done(self, step: int) -> None:
        with self._lock:
            keys = sorted(k for k in self._loads if k[0] == step)
            loads = [self._loads.pop(k) for k in keys]
        if loads:
            self._steps.append(np.asarray(loads, np.float64))

    def row(self) -> dict:
        steps, self._steps = self._steps, []
        if not steps or len({s.shape for s in steps}) != 1:
            return {}
        r = np.asarray([[load_ratio(s[:, 0]), load_ratio(s[:, 1])] for s in steps])
        return {"load_tokens_max_over_mean": float(r[:, 0].mean()),
                "load_pairs_max_over_mean": float(r[:, 1].mean()),
                "load_tokens_max_over_mean_worst": float(r[:, 0].max()),
                "load_pairs_max_over_mean_worst": float(r[:, 1].max()),
                "load_tokens_per_rank": [float(x) for x in np.mean(steps, axis=0)[:, 0]]}
