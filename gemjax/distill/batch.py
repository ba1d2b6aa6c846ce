"""The batch a distilled student trains on: a Batch plus the teacher's outputs for it.

    DistillBatch(<every Batch field>,
      teacher_logits [B, K] float32   soft-target logits per task (the teacher's, or the
                                      Student Adapter's correction of them)
      teacher_repr   [B, E] float32   teacher features of each sample (E may be 0))

Every leaf is row-major over samples (or tokens), so the train step shards it over the
batch axes as it shards a Batch. A student model reads `teacher_repr`
(gemjax.models.student); the distillation objective reads `teacher_logits`
(gemjax.distill.losses).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from gemjax.data.batch import Batch

Array = Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DistillBatch(Batch):
    teacher_logits: Array
    teacher_repr: Array


def with_teacher(batch: Batch, teacher_logits, teacher_repr, mesh=None) -> DistillBatch:
    """`batch` with the teacher's outputs attached.

    teacher_logits [B, K], teacher_repr [B, E]: numpy (placed on `mesh`, sharded over
    every mesh axis like the batch rows) or jax arrays already placed. A shape that does
    not match the batch, or a non-finite value in a numpy input, is a ValueError
    naming the input.
    """
    b, k = batch.labels.shape
    out = {}
    for name, x in (("teacher_logits", teacher_logits), ("teacher_repr", teacher_repr)):
        if x.ndim != 2 or x.shape[0] != b or (name == "teacher_logits" and x.shape[1] != k):
            raise ValueError(f"{name}: shape {tuple(x.shape)} does not fit a batch of {b} samples "
                             f"x {k} tasks")
        if isinstance(x, np.ndarray):
            if not np.all(np.isfinite(x)):
                raise ValueError(f"{name}: {int(np.sum(~np.isfinite(x)))} non-finite values")
            x = x.astype(np.float32)
            if mesh is not None:
                x = jax.device_put(x, NamedSharding(mesh, P(tuple(mesh.axis_names))))
        out[name] = x
    fields = {f.name: getattr(batch, f.name) for f in dataclasses.fields(Batch)}
    return DistillBatch(**fields, **out)
