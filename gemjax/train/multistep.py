"""K train steps per jitted call (train.steps_per_call): one launch for K optimizer steps.

    feeder = multistep.feeder(k, make_shard, mesh, ...)       # K batches per item
    step = multistep.MultiStep(trainer, k)
    for first, batches, infos, tokens in feeder.batches(start, stop):
        state, metrics = step(state, batches)                 # metrics [K, ...] per leaf

A small train step is launch-bound: the host spends longer launching its kernels
than the device spends running them. `MultiStep` jits a `lax.scan` of the trainer's
`train_step` over K batches stacked on a new leading axis, so the host launches one
program per K steps. The scan body is the one-step function itself: step k of the
scan sees the state step k - 1 left, as K separate calls would, and its metrics come
back stacked ([K] + each one-step metric's shape; `unstack` splits them on the host).

`StackedFeeder` hands the K batches of steps first .. first + K - 1 as one item: each
device's K shards are stacked leaf by leaf on the host ([K, B_local, ...]) and copied
as one buffer (gemjax.data.packing), and the global arrays are [K, B_global, ...],
sharded over the batch axes on their second axis (`stacked_sharding`). With K = 1
the train loop uses the plain Feeder and Trainer.make_train_step: the same programs
as without this module.

Sparse branch plans (gemjax.train.planned), where tables switch their exchange or sync
buckets per batch: one plan per call, covering each of its K batches (`MultiStep`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from gemjax.data import packing
from gemjax.data.batch import Batch, id_features
from gemjax.data.feeding import Feeder
from gemjax.train.planned import PlannedStep, jit_per_plan
from gemjax.train.step import Trainer, train_step


def stacked_sharding(mesh: Mesh, axes: tuple[str, ...]) -> NamedSharding:
    """[K, B, ...] arrays: the K steps on every device, the batch dim over `axes`."""
    return NamedSharding(mesh, P(None, axes))


def stack(batches: list[Batch], first: int = 0, where: str = "") -> Batch:
    """Host batches of steps first, first + 1, ... -> one Batch, each leaf stacked
    [K, ...]; ValueError naming the step and leaf whose shape differs from step first's."""
    leaves0, treedef = jax.tree.flatten(batches[0])
    for j, b in enumerate(batches[1:], 1):
        leaves = jax.tree.leaves(b)
        bad = [i for i, (x, y) in enumerate(zip(leaves0, leaves)) if np.shape(x) != np.shape(y)]
        if len(leaves) != len(leaves0) or bad:
            i = bad[0] if bad else 0
            path = jax.tree_util.keystr(jax.tree_util.tree_leaves_with_path(batches[0])[i][0])
            raise ValueError(f"{where}step {first + j}: leaf {path} has shape {np.shape(leaves[i])}, "
                             f"step {first} has {np.shape(leaves0[i])}; train.steps_per_call > 1 "
                             f"stacks consecutive steps, which must have the same shapes")
    return jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *batches)


def unstack(metrics: Any, k: int) -> list[Any]:
    """Host metrics of one call, each leaf [K, ...] -> K per-step metrics (k == 1: [metrics]
    as it is, the one-step call's own)."""
    if k == 1:
        return [metrics]
    return [jax.tree.map(lambda x, j=j: x[j], metrics) for j in range(k)]


class StackedFeeder(Feeder):
    """A Feeder whose items are K consecutive steps: (first step, Batch [K, B_global, ...]
    sharded by `stacked_sharding`, the K steps' infos (step by step, shard by shard), their
    real tokens). batches(start, stop) needs start and stop multiples of K; the pool
    threads build, stack, check and copy each device's K shards (one copy per device
    with pack), up to `prefetch` items ahead."""

    def __init__(self, *args, steps_per_call: int, **kw):
        super().__init__(*args, **kw)
        if steps_per_call < 1:
            raise ValueError(f"StackedFeeder: steps_per_call must be >= 1, got {steps_per_call}")
        self.k = steps_per_call
        self.stacked = stacked_sharding(self.mesh, self.axis)

    def _device_shard(self, group: int, shard: int, device):
        """Steps group*K .. group*K + K - 1 of one shard, stacked and sent to its device."""
        first = group * self.k
        parts = [self._checked_shard(first + j, shard) for j in range(self.k)]
        b = stack([p[0] for p in parts], first, where=f"shard {shard}: ")
        infos, tokens = [p[1] for p in parts], sum(p[2] for p in parts)
        if self.pack:
            row, layout = packing.pack(b)
            return (jax.device_put(row, device), layout), infos, tokens
        return jax.device_put(b, device), infos, tokens

    def assemble_packed(self, parts, step=None) -> Batch:
        """Packed stacked shards -> global [K, B_global, ...] arrays (`stacked_sharding`)."""
        layouts = [lay for _, lay in parts]
        if any(lay != layouts[0] for lay in layouts[1:]):
            self._check_shapes([[(sh, dt) for sh, dt, _ in lay.leaves] for lay in layouts],
                               lambda: [str(i) for i in range(len(layouts[0].leaves))], step)
        rows = jax.make_array_from_single_device_arrays(
            (self.num_shards, layouts[0].nbytes), self.sharding, [r for r, _ in parts])
        return packing.unpacker(self.mesh, self.axis, layouts[0], lead=1)(rows)

    def assemble(self, parts, step=None) -> Batch:
        """Stacked per-device shards [K, B_local, ...] -> global [K, B_global, ...] arrays."""
        shapes = [[np.shape(x) for x in jax.tree.leaves(p)] for p in parts]
        self._check_shapes(shapes, lambda: [jax.tree_util.keystr(k) for k, _ in
                                            jax.tree_util.tree_leaves_with_path(parts[0])], step)

        def glob(*xs):
            shape = (xs[0].shape[0], xs[0].shape[1] * self.num_shards) + xs[0].shape[2:]
            return jax.make_array_from_single_device_arrays(shape, self.stacked, list(xs))

        return jax.tree.map(glob, *parts)

    def _assembled_step(self, group: int, shards: list):
        batch, infos, tokens = super()._assembled_step(group, shards)
        by_step = [per_shard[j] for j in range(self.k) for per_shard in infos]
        return batch, by_step, tokens

    def batches(self, start: int, stop_step: int):
        """Yields (first step, Batch [K, ...], infos, tokens) for first in range(start,
        stop_step, K)."""
        if start % self.k or stop_step % self.k:
            raise ValueError(f"StackedFeeder: steps [{start}, {stop_step}) must start and end "
                             f"at multiples of train.steps_per_call={self.k}")
        for group, batch, infos, tokens in super().batches(start // self.k, stop_step // self.k):
            yield group * self.k, batch, infos, tokens


def feeder(steps_per_call: int, *args, **kw) -> Feeder:
    """Feeder(*args, **kw) for one step per call, else a StackedFeeder of K steps."""
    if steps_per_call == 1:
        return Feeder(*args, **kw)
    return StackedFeeder(*args, steps_per_call=steps_per_call, **kw)


def check_bounds(k: int, start: int, end: int, profile_steps: tuple[int, int] | None) -> None:
    """ValueError unless the run's first and last steps (a resumed checkpoint, stop_after)
    and the profile window fall between calls of k steps."""
    if k == 1:
        return
    for what, v in (("the resumed checkpoint's step", start), ("the last step (stop_after)", end),
                    *((("--profile_steps bound", b) for b in profile_steps or ()))):
        if v % k:
            raise ValueError(f"train.steps_per_call={k}: {what} is {v}, not a multiple of {k}; "
                             f"run with a train.steps_per_call that divides it")


def scan_steps(step: Callable, state, batches: Batch):
    """lax.scan of step (state, batch) -> (state, metrics) over batches [K, ...]:
    (state after K steps, metrics stacked [K, ...])."""
    return jax.lax.scan(step, state, batches)


class MultiStep(PlannedStep):
    """The trainer's train_step, K steps per jitted call: (state, batches [K, ...][,
    next_batches]) -> (state, metrics [K, ...]); state donated, placed like
    Trainer.make_train_step's.

    Sparse branch plans (gemjax.train.planned): one plan for the K batches of a call, the
    per-table largest of theirs (`max_needs`: each batch's unique-id counts, maxed over
    the K in one jitted call); a plan that covers a batch's needs gives that batch the
    results of its own plan, so the K steps train as K one-step calls. As in PlannedStep,
    the next call's needs are queued before this call and read after it."""

    def __init__(self, trainer: Trainer, k: int):
        if k < 2:
            raise ValueError(f"MultiStep: k must be >= 2 (k=1 is Trainer.make_train_step), got {k}")
        self.k = k
        out = (trainer.state_shardings(), NamedSharding(trainer.mesh, P()))
        scanned = functools.partial(scan_steps, functools.partial(train_step, trainer.context()))
        super().__init__(trainer.coll, trainer.id_fields,
                         jit_per_plan(trainer.coll, scanned, donate_argnums=(0,), out_shardings=out),
                         fixed=trainer.cfg.sparse.fixed_branches,
                         name=f"train step x{k}")
        self._max_needs = jax.jit(self.max_needs)

    def max_needs(self, feats: dict) -> dict:
        """feats stacked [K, ...] -> {table: [2] int32}: `EmbeddingCollection.branch_needs`
        of each of the K batches, the largest per entry (traced)."""
        per = [self.coll.branch_needs(jax.tree.map(lambda x, j=j: x[j], feats))
               for j in range(self.k)]
        return jax.tree.map(lambda *xs: jnp.max(jnp.stack(xs), axis=0), *per)

    def _needs(self, batch: Batch):
        return self._max_needs(id_features(batch, self.id_fields))

    def plan(self, batch: Batch, needs: Any = None) -> tuple:
        """The branch plan the call runs the K batches of `batch` with (reads `needs`)."""
        if not self._switched:
            return ()
        if needs is None:
            needs = self._needs(batch)
        one = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype),
                           id_features(batch, self.id_fields))     # one step's shapes
        return self.covering(self.coll.branch_plan(one, jax.device_get(needs)))
