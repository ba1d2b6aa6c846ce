"""Host-to-mesh feeding: per-device shards -> validated -> global arrays on the mesh.

Each device of the mesh gets its own shard (its own packed jagged buffers with
local offsets); the global arrays are sharded over the batch axes (default: every
mesh axis, in mesh order), so shard i lives on ``mesh.devices.flat[i]``. This
process builds the shards of its addressable devices only, checks them, and
assembles the global arrays. ``Feeder.batches`` builds every (step, shard) in a
pool of ``workers`` threads (numpy releases the GIL in its bulk work), starts each
shard's host-to-device copy in that thread (``device_put`` to the shard's own
device: no host-side concatenation of shards, the transfer overlaps the next
shards' generation), and assembles each step's global arrays in a pool thread too,
so the consumer's thread (the train loop's, which launches the step) only takes
them. By default a shard travels as ONE byte buffer (gemjax.data.packing: one
transfer instead of one per leaf) that one jitted function unpacks on the mesh
into the arrays a per-leaf copy gives (``make_array_from_single_device_arrays``
per leaf); ``pack=False``, or GEMJAX_FEED_PACK=0 in the environment, copies leaf
by leaf.

``regroup`` feeds a mesh of n devices from a stream cut into K shards (K a
multiple of n): device i gets source shards [i K/n, (i+1) K/n) packed into one
buffer (``merge_shards``), so meshes of different sizes see the same samples.
"""

from __future__ import annotations

import collections
import dataclasses
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from gemjax.data import packing
from gemjax.data.batch import Batch, id_features
from gemjax.data.jagged import Jagged, layout_from_lengths

ENV_PACK = "GEMJAX_FEED_PACK"


def pack_default() -> bool:
    """Feeder's `pack` default: $GEMJAX_FEED_PACK ("1" or unset: packed, "0": per leaf)."""
    v = os.environ.get(ENV_PACK, "1").strip()
    if v not in ("0", "1"):
        raise ValueError(f"${ENV_PACK}={v!r}: expected 1 (one packed copy per shard) or 0 "
                         f"(one copy per leaf)")
    return v == "1"


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


def merge_shards(shards: list[Batch]) -> Batch:
    """Pack several device shards into ONE device batch (samples in order, global offsets).

    Per-sample leaves [B_i, ...] are concatenated to [sum B_i, ...]; each sequence's
    real tokens are packed end to end into capacity sum(T_i) (padding zero,
    segment ids B on padding).
    """
    if not shards:
        raise ValueError("merge_shards: no shards")
    seqs = {}
    for name in shards[0].sequences:
        parts = [b.sequences[name] for b in shards]
        ends = [int(np.asarray(j.offsets)[-1]) for j in parts]
        lengths = np.concatenate([np.diff(np.asarray(j.offsets)) for j in parts])
        cap = sum(j.capacity for j in parts)
        offsets, segment_ids, positions = layout_from_lengths(lengths, cap)

        def pack_field(*vals):
            out = np.zeros((cap,) + np.shape(vals[0])[1:], np.asarray(vals[0]).dtype)
            total = sum(ends)
            out[:total] = np.concatenate([np.asarray(v)[:n] for v, n in zip(vals, ends)])
            return out

        values = jax.tree.map(pack_field, *[j.values for j in parts])
        seqs[name] = Jagged(values, offsets, segment_ids, positions)
    flat = [b.replace(sequences={}) for b in shards]
    merged = jax.tree.map(lambda *xs: np.concatenate([np.asarray(x) for x in xs], axis=0), *flat)
    return merged.replace(sequences=seqs)


def merge_infos(infos: list[Any]) -> Any:
    """One info for merged shards: arrays concatenated, counters summed (dataclass infos)."""
    if not infos or not dataclasses.is_dataclass(infos[0]):
        return infos
    out = {}
    for f in dataclasses.fields(infos[0]):
        vals = [getattr(i, f.name) for i in infos]
        out[f.name] = np.concatenate(vals) if isinstance(vals[0], np.ndarray) else sum(vals)
    return type(infos[0])(**out)


def regroup(make_shard: Callable[[int, int, int], tuple[Batch, Any]], source_shards: int):
    """make_shard over `source_shards` shards -> make_shard for any n dividing source_shards."""

    def make(step: int, shard: int, num_shards: int):
        if source_shards % num_shards:
            raise ValueError(f"regroup: {num_shards} devices do not divide the {source_shards} "
                             f"source shards; use a multiple of the device count")
        k = source_shards // num_shards
        parts = [make_shard(step, shard * k + j, source_shards) for j in range(k)]
        if k == 1:
            return parts[0]
        return merge_shards([p[0] for p in parts]), merge_infos([p[1] for p in parts])

    return make


class Feeder:
    """Global batches for `step` on `mesh`, from `make_shard(step, shard, num_shards)`.

    make_shard returns (Batch of numpy arrays, info); `batches` yields the info
    objects of each step (for counters such as truncations). axis: the mesh axes
    the batch is sharded over (default: all, in mesh order); they must cover the
    whole mesh, so every device holds its own shard. make_shard must be thread
    safe: `workers` threads (data.host_workers in the trainer) build, validate
    and device_put (step, shard) pieces, up to max(prefetch, workers) steps
    ahead of the consumer; every piece of a step must have the same shapes.
    pack: copy each shard as one byte buffer (gemjax.data.packing) rather than leaf by
    leaf; None: pack_default() ($GEMJAX_FEED_PACK). Both give the same arrays.
    """

    def __init__(self, make_shard: Callable[[int, int, int], tuple[Batch, Any]], mesh: Mesh,
                 axis: str | tuple[str, ...] | None = None, check_ids: Callable | None = None,
                 id_fields: dict | None = None, prefetch: int = 2, workers: int = 1,
                 pack: bool | None = None):
        axes = tuple(mesh.axis_names) if axis is None else (axis,) if isinstance(axis, str) else tuple(axis)
        if sorted(axes) != sorted(mesh.axis_names):
            raise ValueError(f"Feeder: batch axes {axes} must name every mesh axis {mesh.axis_names} "
                             f"(each device holds its own shard)")
        self.make_shard, self.mesh, self.axis = make_shard, mesh, axes
        self.check_ids, self.id_fields = check_ids, id_fields
        self.sharding = NamedSharding(mesh, P(axes))
        # shard i of P(axes) lives on the device at flat index i of the mesh transposed to axes
        order = [mesh.axis_names.index(a) for a in axes]
        devs = list(np.transpose(mesh.devices, order).flat)
        self.num_shards = len(devs)
        self.local_shards = [i for i, d in enumerate(devs) if d.process_index == jax.process_index()]
        ls = self.local_shards
        if ls and ls != list(range(ls[0], ls[0] + len(ls))):
            raise ValueError(f"Feeder: process {jax.process_index()} holds batch shards {ls}, not one "
                             f"contiguous block; build the mesh with gemjax.parallel.mesh.build_mesh")
        self.local_devices = [devs[i] for i in self.local_shards]
        self.prefetch, self.workers = max(prefetch, workers), max(workers, 1)
        self.pack = pack_default() if pack is None else bool(pack)

    def _checked_shard(self, step: int, shard: int):
        """(Batch of numpy arrays, info, real tokens) for one shard, validated."""
        b, info = self.make_shard(step, shard, self.num_shards)
        validate_batch(b, self.check_ids, self.id_fields, where=f"step {step} shard {shard}")
        return b, info, sum(int(np.asarray(seq.offsets)[-1]) for seq in b.sequences.values())

    def host_batch(self, step: int):
        """(Batch of this process's shards concatenated, [info per shard], real tokens)."""
        shards, infos, tokens = zip(*(self._checked_shard(step, s) for s in self.local_shards))
        return concat_shards(list(shards)), list(infos), sum(tokens)

    def to_device(self, batch: Batch) -> Batch:
        """This process's shards (concatenated, as host_batch returns them) -> global arrays."""
        k = len(self.local_shards)

        def put(x):
            x = np.asarray(x)
            rows = x.shape[0] // k * self.num_shards
            return jax.make_array_from_process_local_data(self.sharding, x, (rows,) + x.shape[1:])

        return jax.tree.map(put, batch)

    def _device_shard(self, step: int, shard: int, device):
        """One shard built, validated and sent to its device (the copy runs asynchronously).

        Returns (piece, info, real tokens); piece: a Batch of single-device arrays, or
        with `pack` (uint8 [1, nbytes] single-device array, its packing.Layout)."""
        b, info, tokens = self._checked_shard(step, shard)
        if self.pack:
            row, layout = packing.pack(b)
            return (jax.device_put(row, device), layout), info, tokens
        return jax.device_put(b, device), info, tokens

    def _check_shapes(self, shapes: list[list[tuple]], paths: Callable[[], list[str]],
                      step: int | None) -> None:
        """ValueError naming the first shard and leaf whose shape differs from the first shard's."""
        for s, sh in zip(self.local_shards[1:], shapes[1:]):
            if sh != shapes[0]:
                i = next(i for i, (a, b) in enumerate(zip(shapes[0], sh)) if a != b)
                raise ValueError(f"step {step}: shard {s} leaf {paths()[i]} has shape {sh[i]}, shard "
                                 f"{self.local_shards[0]} has {shapes[0][i]}; every shard of a step must "
                                 f"have the same shapes (same local batch size and capacity)")

    def assemble_packed(self, parts: list[tuple[jax.Array, packing.Layout]],
                        step: int | None = None) -> Batch:
        """This process's packed shards (in local_shards order, each (uint8 [1, nbytes] on
        its device, Layout)) -> global arrays, equal to assemble() of the unpacked shards."""
        layouts = [lay for _, lay in parts]
        first = layouts[0]
        if any(lay != first for lay in layouts[1:]):
            def paths():
                tree = jax.tree.unflatten(first.treedef, [0] * len(first.leaves))
                return [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(tree)]
            self._check_shapes([[(sh, dt) for sh, dt, _ in lay.leaves] for lay in layouts], paths, step)
        rows = jax.make_array_from_single_device_arrays(
            (self.num_shards, first.nbytes), self.sharding, [r for r, _ in parts])
        return packing.unpacker(self.mesh, self.axis, first)(rows)

    def assemble(self, parts: list[Batch], step: int | None = None) -> Batch:
        """This process's per-device shards (in local_shards order, each on its device)
        -> global arrays; every shard must have the same leaf shapes."""
        shapes = [[np.shape(x) for x in jax.tree.leaves(p)] for p in parts]
        self._check_shapes(shapes, lambda: [jax.tree_util.keystr(k) for k, _ in
                                            jax.tree_util.tree_leaves_with_path(parts[0])], step)

        def glob(*xs):
            shape = (xs[0].shape[0] * self.num_shards,) + xs[0].shape[1:]
            return jax.make_array_from_single_device_arrays(shape, self.sharding, list(xs))

        return jax.tree.map(glob, *parts)

    def _assembled_step(self, step: int, shards: list):
        """(global Batch, infos, tokens) of one step from its shard futures (run in a
        feeder thread: the consumer's thread only takes the result)."""
        parts = [f.result() for f in shards]
        batch = (self.assemble_packed if self.pack else self.assemble)([p[0] for p in parts], step)
        return batch, [p[1] for p in parts], sum(p[2] for p in parts)

    def batches(self, start: int, stop_step: int):
        """Yields (step, device Batch, infos, tokens) for step in [start, stop_step), in order.

        `workers` threads build the (step, shard) pieces up to `prefetch` steps
        ahead, each validated and copied to its device in the thread that built it,
        and assemble each step's global arrays; the consumer's thread does no per-step
        work here beyond taking the assembled step. The pool runs tasks in submission
        order, so a step's assembly, submitted after its shards, never waits on a
        shard that has not started. The result equals to_device(host_batch(step)[0]).
        """
        pool = ThreadPoolExecutor(self.workers, thread_name_prefix="gemjax-feed")
        ahead: collections.deque = collections.deque()
        nxt = start
        try:
            for step in range(start, stop_step):
                while nxt < stop_step and len(ahead) < max(self.prefetch, 1):
                    shards = [pool.submit(self._device_shard, nxt, s, d)
                              for s, d in zip(self.local_shards, self.local_devices)]
                    ahead.append(pool.submit(self._assembled_step, nxt, shards))
                    nxt += 1
                batch, infos, tokens = ahead.popleft().result()
                yield step, batch, infos, tokens
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
