"""Base Batch Shuffling (BBS): every rank gets a balanced share of a step's jagged load.

With jagged sequences the ranks of a data-parallel step hold different numbers of
tokens, and the step runs at the pace of the most loaded one. BBS cuts the global
batch of B samples into G = B / s small sub-batches of s samples (s =
data.bbs_sub_batch), sorts them by their sequence tokens (largest first) and
deals them out in snake order (ranks 0, 1, ..., R-1, R-1, ..., 0, 0, 1, ...), so
each of the R ranks gets G / R sub-batches and about 1 / R of the tokens:

    plan = snake_plan(tokens_per_sub_batch, num_ranks)     # [R, G / R] sub-batch ids
    source = train_source(cfg)                              # the loop's train source

Mechanism, no communication: sub-batch j of step t is the planted stream's shard
j of G (`shard_batch(t, j, G)`, generated with room for every event, so no
sub-batch is cut), a pure function of (seed, t, j). Every process generates the
step's G sub-batches (in one thread, once per step: `BalancedSource` caches the
newest steps), reads their lengths, computes the same plan and keeps the
sub-batches of its own ranks. The step's samples are the G sub-batches whatever
the plan and the rank count; only their placement changes. With one process
(one host and its GPUs) the process generates the global batch as without BBS;
with P processes each generates all of it (P x the host work of its share).

A rank's sub-batches are packed, in plan order, into the rank's static capacity
(the config's capacity over R ranks); a rank whose tokens do not fit loses its
longest sequences' oldest events (gemjax.data.jagged.fit_to_capacity), counted
in seq_truncated_to_capacity.

Rank load (`shard_load`): tokens = the events of every sequence of the shard;
pairs = sum over its samples and sequences of L^2, the (query, key) pairs of a
full self-attention over each sample's events (the quadratic part of the
work). `load_ratio(values)` = max / mean over the ranks; the train loop logs
both ratios of every step in metrics.jsonl (`LoadLog`).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import threading
from typing import Any, Callable

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


def pack_shards(parts: list[Batch], capacity: int) -> tuple[Batch, int]:
    """Sub-batches -> (one shard of every sequence packed into `capacity` tokens, sequences
    cut to fit). Samples in `parts` order; a sample cut keeps its most recent events."""
    seqs, n_cut = {}, 0
    for name in parts[0].sequences:
        jags = [p.sequences[name] for p in parts]
        lengths = np.concatenate([np.diff(np.asarray(j.offsets)).astype(np.int64) for j in jags])
        ends = [int(np.asarray(j.offsets)[-1]) for j in jags]
        cut = fit_to_capacity(lengths, capacity)
        n_cut += int((cut < lengths).sum())
        offsets, segment_ids, positions = layout_from_lengths(cut, capacity)
        keep = None
        if (cut < lengths).any():
            total = int(lengths.sum())
            seg = np.repeat(np.arange(lengths.shape[0]), lengths)
            pos_from_end = np.cumsum(lengths)[seg] - 1 - np.arange(total)
            keep = pos_from_end < cut[seg]

        def field(*vals):
            v = np.concatenate([np.asarray(x)[:n] for x, n in zip(vals, ends)])
            if keep is not None:
                v = v[keep]
            out = np.zeros((capacity,) + v.shape[1:], v.dtype)
            out[:v.shape[0]] = v
            return out

        values = {k: field(*[j.values[k] for j in jags]) for k in jags[0].values}
        seqs[name] = Jagged(values, offsets, segment_ids, positions)
    merged = merge_shards([p.replace(sequences={}) for p in parts])
    return merged.replace(sequences=seqs), n_cut


class BalancedSource:
    """A source (gemjax.data.source protocol) whose shards are BBS's ranks.

    inner: the uncut sub-batch source (shard j of num_sub_batches is sub-batch j);
    capacity: rank capacity as a function of the rank count; sub_batch: s samples per
    sub-batch; balance: False deals the same sub-batches without sorting
    (identity_plan), the reference BBS is compared with. Thread safe (the Feeder's
    workers call shard_batch concurrently); keeps the newest `keep_steps` steps.
    """

    def __init__(self, inner, capacity: Callable[[int], int], batch_size: int, sub_batch: int,
                 balance: bool = True, keep_steps: int = 64):
        if sub_batch < 1 or batch_size % sub_batch:
            raise ValueError(f"data.bbs_sub_batch={sub_batch} must be >= 1 and divide "
                             f"data.batch_size={batch_size}")
        self.inner, self._capacity = inner, capacity
        self.batch_size, self.sub_batch, self.balance = batch_size, sub_batch, balance
        self.num_sub_batches = batch_size // sub_batch
        self._steps: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()
        self._keep = keep_steps

    def __getattr__(self, name):              # schema, counter_names, ... of the inner source
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def local_batch_size(self, num_shards: int) -> int:
        if self.batch_size % num_shards:
            raise ValueError(f"data.batch_size={self.batch_size} is not divisible by the "
                             f"{num_shards} batch shards (devices)")
        return self.batch_size // num_shards

    def sequence_capacity(self, num_shards: int) -> int:
        return self._capacity(num_shards)

    def sub_batches(self, step: int) -> list[tuple[Batch, Any]]:
        """The step's G sub-batches (generated once, cached)."""
        with self._lock:
            entry = self._steps.get(step)
            if entry is None:
                entry = self._steps[step] = {"ready": threading.Event(), "parts": None}
                mine = True
                while len(self._steps) > self._keep:
                    self._steps.popitem(last=False)
            else:
                mine = False
        if mine:
            try:
                entry["parts"] = [self.inner.shard_batch(step, j, self.num_sub_batches)
                                  for j in range(self.num_sub_batches)]
            finally:
                entry["ready"].set()
        entry["ready"].wait()
        if entry["parts"] is None:
            with self._lock:
                self._steps.pop(step, None)
            raise RuntimeError(f"BBS: building the sub-batches of step {step} failed in another thread")
        return entry["parts"]

    def plan(self, step: int, num_shards: int) -> np.ndarray:
        """[R, G / R] sub-batch ids of each rank at `step`."""
        if self.num_sub_batches % num_shards:
            raise ValueError(f"BBS: the {self.num_sub_batches} sub-batches (data.batch_size / "
                             f"data.bbs_sub_batch) cannot be dealt evenly to {num_shards} devices")
        if not self.balance:
            return identity_plan(self.num_sub_batches, num_shards)
        tokens = [shard_load(b)[0] for b, _ in self.sub_batches(step)]
        return snake_plan(np.asarray(tokens), num_shards)

    def shard_batch(self, step: int, shard: int, num_shards: int) -> tuple[Batch, Any]:
        if not 0 <= shard < num_shards:
            raise ValueError(f"shard {shard} out of range for {num_shards} shards")
        parts = self.sub_batches(step)
        ids = self.plan(step, num_shards)[shard]
        batch, n_cut = pack_shards([parts[i][0] for i in ids], self.sequence_capacity(num_shards))
        info = merge_infos([parts[i][1] for i in ids])
        if n_cut and hasattr(info, "seq_truncated_to_capacity"):
            info = dataclasses.replace(info, seq_truncated_to_capacity=info.seq_truncated_to_capacity + n_cut)
        return batch, info


def train_source(cfg, seed: int | None = None):
    """The train loop's source: make_source(cfg, "train"), or with data.bbs its
    BalancedSource (synthetic stream only; sub-batches generated with room for every
    event: capacity s x data.seq_cap tokens per sequence)."""
    from gemjax.data.source import make_source

    d = cfg.data
    if not getattr(d, "bbs", False):
        return make_source(cfg, "train", seed=seed)
    if d.source != "synthetic":
        raise ValueError(f"data.bbs needs data.source=synthetic (its sub-batches are a pure "
                         f"function of the step), got {d.source!r}")
    plain = make_source(cfg, "train", seed=seed)
    mean_len = min(d.seq_median * math.exp(d.seq_sigma ** 2 / 2), d.seq_cap)
    # sub-batch capacity = slack * batch * mean / G >= s * seq_cap: no sub-batch is ever cut
    roomy = dataclasses.replace(cfg, data=dataclasses.replace(
        d, capacity_slack=1.0001 * d.seq_cap / mean_len, bbs=False))
    inner = make_source(roomy, "train", seed=seed)
    return BalancedSource(inner, plain.sequence_capacity, d.batch_size, d.bbs_sub_batch)


class LoadLog:
    """Per-step rank loads for metrics.jsonl: `wrap(make_shard)` records each shard's
    (tokens, pairs) as the Feeder builds it; `step_done(step)` takes the step's ratios
    (max / mean over the shards this process built); `row()` gives the mean and max
    of the ratios of the steps since the last row, and starts the next window."""

    def __init__(self, num_shards: int):
        self.num_shards = num_shards
        self._loads: dict[tuple[int, int], tuple[int, int]] = {}
        self._ratios: list[tuple[float, float]] = []

    def wrap(self, make_shard):
        def make(step: int, shard: int, num_shards: int):
            batch, info = make_shard(step, shard, num_shards)
            self._loads[(step, shard)] = shard_load(batch)
            return batch, info
        return make

    def step_done(self, step: int) -> None:
        loads = [self._loads.pop(k) for k in [k for k in list(self._loads) if k[0] == step]]
        if loads:
            self._ratios.append((load_ratio([t for t, _ in loads]), load_ratio([p for _, p in loads])))

    def row(self) -> dict:
        r = np.asarray(self._ratios, np.float64).reshape(-1, 2)
        self._ratios = []
        if not r.size:
            return {}
        return {"load_tokens_max_over_mean": float(r[:, 0].mean()),
                "load_pairs_max_over_mean": float(r[:, 1].mean()),
                "load_tokens_max_over_mean_worst": float(r[:, 0].max()),
                "load_pairs_max_over_mean_worst": float(r[:, 1].max())}
