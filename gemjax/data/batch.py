"""The device-local batch pytree that every stage of gemjax passes along.

    Batch(
      sparse     {feature: ids [B] int32}          single-valued categorical features
      dense      [B, F] float32                    dense features
      sequences  {name: Jagged}                    event sequences; values is a dict of
                                                   fields, e.g. {"item": [T] int32,
                                                   "event": [T] int32}
      labels     [B, K] float32                    K tasks, 0/1
      label_mask [B, K] float32                    1 where the label is observed
      surface    [B] int32                         surface (domain) of each sample
      weights    [B] float32                       sample weights (0 on padding samples)
    )

Sparse lookups see the flat dict from `id_features`: plain features by name and
each sequence field as "<sequence>.<field>".
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from gemjax.data.jagged import Jagged

Array = Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Batch:
    sparse: dict[str, Array]
    dense: Array
    sequences: dict[str, Jagged]
    labels: Array
    label_mask: Array
    surface: Array
    weights: Array

    @property
    def batch_size(self) -> int:
        return self.labels.shape[0]

    def replace(self, **kw) -> "Batch":
        return dataclasses.replace(self, **kw)


def id_features(batch: Batch, id_fields: dict[str, tuple[str, ...]]) -> dict[str, Array]:
    """Flat {feature: ids} for the sparse lookup.

    id_fields maps a sequence name to the fields of it that are looked up in
    embedding tables (e.g. {"clicks": ("item", "event")}); those appear as
    "clicks.item", "clicks.event" with shape [T].
    """
    feats = dict(batch.sparse)
    for name, fields in id_fields.items():
        seq = batch.sequences[name]
        for f in fields:
            feats[f"{name}.{f}"] = seq.values[f]
    return feats
