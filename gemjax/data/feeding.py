"""Host-to-mesh feeding: per-device shards -> validated -> global arrays on the mesh.

Each device along the mesh's batch axis gets its own shard (its own packed jagged
buffers with local offsets); this process builds the shards of its addressable
devices, checks them, and assembles global arrays sharded over the batch axis.
Background threads prepare the next batches while the device computes.
"""

from __future__ import annotations

import collections
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from gemjax.data.batch import Batch, id_features


def validate_batch(batch: Batch, check_ids: Callable[[dict], None] | None = None,
                   id_fields: dict[str, tuple[str, ...]] | None = None, where: str = "batch") -> None:
    """Host-side input checks; raises ValueError naming the offending input."""
    dense = np.asarray(batch.dense)
    if not np.isfinite(dense).all():
        bad = np.argwhere(~np.isfinite(dense))[0]
        raise ValueError(f"{where}: dense feature {bad[1]} of sample {bad[0]} is {dense[tuple(bad)]} "
                         f"(NaN/Inf); clean the input or impute it before feeding")
    labels = np.asarray(batch.labels)
    if not np.isin(labels, (0.0, 1.0)).all():
        raise ValueError(f"{where}: labels must be 0 or 1, got values {np.unique(labels)[:5]}")
    for name, seq in batch.sequences.items():
        off = np.asarray(seq.offsets)
        if off[0] != 0 or (np.diff(off) < 0).any() or off[-1] > seq.capacity:
            raise ValueError(f"{where}: sequence {name!r} has invalid offsets (must start at 0, be "
                             f"non-decreasing and end <= capacity {seq.capacity})")
    if check_ids is not None:
        feats = id_features(batch, id_fields or {})
        for name, seq in batch.sequences.items():      # only real tokens are checked
            n = int(np.asarray(seq.offsets)[-1])
            for f in (id_fields or {}).get(name, ()):
                feats[f"{name}.{f}"] = np.asarray(feats[f"{name}.{f}"])[:n]
        check_ids(feats)


def concat_shards(shards: list[Batch]) -> Batch:
    """Stack per-device shards along the leading axis (offsets stay shard-local)."""
    return jax.tree.map(lambda *xs: np.concatenate(xs, axis=0), *shards)


class Feeder:
    """Global batches for `step` on `mesh`, from `make_shard(step, shard, num_shards)`.

    make_shard returns (Batch of numpy arrays, info); info objects are kept in
    `last_infos` (for counters such as truncations).
    """

    def __init__(self, make_shard: Callable[[int, int, int], tuple[Batch, Any]], mesh: Mesh,
                 axis: str = "batch", check_ids: Callable | None = None,
                 id_fields: dict | None = None, prefetch: int = 2, workers: int = 1):
        self.make_shard, self.mesh, self.axis = make_shard, mesh, axis
        self.check_ids, self.id_fields = check_ids, id_fields
        self.sharding = NamedSharding(mesh, P(axis))
        devs = list(mesh.devices.flat)
        self.num_shards = len(devs)
        self.local_shards = [i for i, d in enumerate(devs) if d.process_index == jax.process_index()]
        self.prefetch, self.workers = max(prefetch, workers), max(workers, 1)

    def host_batch(self, step: int):
        """(Batch of this process's shards concatenated, [info per shard], real tokens)."""
        shards, infos = [], []
        for s in self.local_shards:
            b, info = self.make_shard(step, s, self.num_shards)
            validate_batch(b, self.check_ids, self.id_fields, where=f"step {step} shard {s}")
            shards.append(b)
            infos.append(info)
        tokens = sum(int(np.asarray(seq.offsets)[-1]) for b in shards for seq in b.sequences.values())
        return concat_shards(shards), infos, tokens

    def to_device(self, batch: Batch) -> Batch:
        return jax.tree.map(lambda x: jax.make_array_from_process_local_data(self.sharding, x), batch)

    def batches(self, start: int, stop_step: int):
        """Yields (step, device Batch, infos, tokens) for step in [start, stop_step), in order.

        `workers` threads build host batches up to `prefetch` steps ahead (numpy
        releases the GIL in most of the generation work).
        """
        pool = ThreadPoolExecutor(self.workers, thread_name_prefix="gemjax-feed")
        ahead: collections.deque = collections.deque()
        nxt = start
        try:
            for step in range(start, stop_step):
                while nxt < stop_step and len(ahead) < max(self.prefetch, 1):
                    ahead.append(pool.submit(self.host_batch, nxt))
                    nxt += 1
                batch, infos, tokens = ahead.popleft().result()
                yield step, self.to_device(batch), infos, tokens
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
