"""Ids before they are routed: which table serves a feature, the host-side strict bounds
check, and the in-step bounding of one table's ids.

    table_of = feature_tables(specs)                 # {feature: TableSpec}
    check_ids(feats, table_of, n_devices)            # host: ValueError naming the feature
    groups = group_features(feats, table_of)         # {table: [features present]}
    ids, valid, sizes, bad = table_ids(spec, groups[name], feats)    # inside shard_map

feats: {feature: ids [...] int, or a Jagged bag}, sharded over the batch axes on a mesh
(a bag: each device's own packed buffer with local offsets).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax.numpy as jnp
import numpy as np

from gemjax.data.jagged import Jagged
from gemjax.sparse.specs import TableSpec


def feature_tables(specs: Sequence[TableSpec]) -> dict[str, TableSpec]:
    """{feature: the TableSpec serving it}; ValueError on a duplicate table name or a
    feature served by two tables."""
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate table names in {names}")
    table_of: dict[str, TableSpec] = {}
    for s in specs:
        for f in s.features:
            if f in table_of:
                raise ValueError(f"feature {f!r} is served by both {table_of[f].name!r} and {s.name!r}")
            table_of[f] = s
    return table_of


def spec_of(table_of: Mapping[str, TableSpec], feature: str) -> TableSpec:
    """The table serving `feature`; KeyError naming it and the known features."""
    if feature not in table_of:
        raise KeyError(f"feature {feature!r} is served by no table; known: {sorted(table_of)}")
    return table_of[feature]


def check_ids(feats: Mapping[str, Any], table_of: Mapping[str, TableSpec], n_devices: int) -> None:
    """Host-side bounds check of the features of "strict" tables: ValueError naming the
    feature, its table and a few ids outside [0, vocab). A Jagged bag holds `n_devices`
    packed shards; only each shard's tokens before its offsets[-1] are checked."""
    for f, ids in feats.items():
        spec = spec_of(table_of, f)
        if spec.bounds != "strict":
            continue
        if isinstance(ids, Jagged):   # per device shard: tokens before its offsets[-1]
            ends = np.asarray(ids.offsets).reshape(n_devices, -1)[:, -1:]
            t = np.arange(ids.capacity // n_devices)[None, :]
            a = np.asarray(ids.values).reshape(n_devices, -1)[t < ends]
        else:
            a = np.asarray(ids)
        if a.size and (a.min() < 0 or a.max() >= spec.vocab):
            bad = a[(a < 0) | (a >= spec.vocab)]
            raise ValueError(
                f"feature {f!r}: {bad.size} ids outside [0, {spec.vocab}) of table {spec.name!r} "
                f"(e.g. {bad[:3].tolist()}); fix the input or set bounds='clamp' or 'hash' on the table")


def check_feature(table_of: Mapping[str, TableSpec], f: str, ids: Any) -> None:
    """TypeError unless pooled tables get Jagged bags and unpooled ones plain ids."""
    spec = spec_of(table_of, f)
    if spec.pooling is None and isinstance(ids, Jagged):
        raise TypeError(f"feature {f!r}: table {spec.name!r} has no pooling; pass plain ids, not a Jagged bag")
    if spec.pooling is not None and not isinstance(ids, Jagged):
        raise TypeError(f"feature {f!r}: pooled table {spec.name!r} needs a Jagged bag of ids")


def group_features(feats: Mapping[str, Any], table_of: Mapping[str, TableSpec]) -> dict[str, list[str]]:
    """table -> its features present in feats (sorted, so the order is static); each
    feature checked by `check_feature`."""
    groups: dict[str, list[str]] = {}
    for f in sorted(feats):
        check_feature(table_of, f, feats[f])
        groups.setdefault(spec_of(table_of, f).name, []).append(f)
    return groups


def id_slots(ids: Any) -> int:
    """Id slots of one feature over all devices (a Jagged bag: its capacity)."""
    return int(np.prod((ids.values if isinstance(ids, Jagged) else ids).shape))


def table_ids(spec: TableSpec, fs: Sequence[str], feats: Mapping[str, Any]):
    """Inside shard_map: one table's features -> (ids [N] int32 bounded per spec.bounds,
    valid [N] bool, per-feature sizes, count of valid ids out of range)."""
    flat, valid, sizes = [], [], []
    for f in fs:
        ids = feats[f]
        raw = jnp.asarray(ids.values if isinstance(ids, Jagged) else ids).astype(jnp.int32)
        ok = ids.mask if isinstance(ids, Jagged) else jnp.ones(raw.shape, bool)
        flat.append(raw.reshape(-1))
        valid.append(ok.reshape(-1))
        sizes.append(raw.size)
    raw, valid = jnp.concatenate(flat), jnp.concatenate(valid)
    bad = jnp.sum(valid & ((raw < 0) | (raw >= spec.vocab)), dtype=jnp.int32)
    ids = jnp.mod(raw, spec.vocab) if spec.bounds == "hash" else jnp.clip(raw, 0, spec.vocab - 1)
    return ids, valid, sizes, bad
