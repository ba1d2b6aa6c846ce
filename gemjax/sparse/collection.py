"""EmbeddingCollection: lookups and sparse updates for every table.

    coll = EmbeddingCollection(specs)
    state = coll.init(key)                       # {table: {"weights": [V, D], <opt state>}}
    acts, residuals = coll.lookup(state, feats)  # feats {feature: ids [...] or Jagged bag}
    ... g_acts = d loss / d acts ...
    state = coll.apply_gradients(state, residuals, g_acts)

The tables never enter jax.grad: the loss is differentiated with respect to the
looked-up activations, and the optimizer updates only the rows the batch
touched (duplicates summed first), so no dense [vocab, dim] gradient exists.

This is the single-device engine; sharded plans reuse the same contract.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from gemjax.data.jagged import Jagged
from gemjax.sparse.specs import TableSpec

Array = Any


class EmbeddingCollection:
    def __init__(self, specs: Sequence[TableSpec], plan: Any = None, mesh: Any = None):
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate table names in {names}")
        self.specs = {s.name: s for s in specs}
        self.table_of: dict[str, TableSpec] = {}
        for s in specs:
            for f in s.features:
                if f in self.table_of:
                    raise ValueError(f"feature {f!r} is served by both {self.table_of[f].name!r} and {s.name!r}")
                self.table_of[f] = s
        self.plan, self.mesh = plan, mesh

    # ---------------------------------------------------------------- state
    def init(self, key: Array) -> dict[str, dict[str, Array]]:
        state = {}
        for i, s in enumerate(self.specs.values()):
            k = jax.random.fold_in(key, i)
            w = jax.random.uniform(k, (s.vocab, s.dim), jnp.float32, -s.scale, s.scale).astype(s.dtype)
            state[s.name] = {"weights": w, **s.optimizer.init_state(s.vocab, s.dim)}
        return state

    # ---------------------------------------------------------------- checks
    def check_ids(self, feats: Mapping[str, Any]) -> None:
        """Host-side strict bounds check; raises ValueError naming the feature."""
        for f, ids in feats.items():
            spec = self._spec(f)
            if spec.bounds != "strict":
                continue
            a = np.asarray(ids.values if isinstance(ids, Jagged) else ids)
            if isinstance(ids, Jagged):
                a = a[: int(np.asarray(ids.offsets)[-1])]
            if a.size and (a.min() < 0 or a.max() >= spec.vocab):
                bad = a[(a < 0) | (a >= spec.vocab)]
                raise ValueError(
                    f"feature {f!r}: {bad.size} ids outside [0, {spec.vocab}) of table {spec.name!r} "
                    f"(e.g. {bad[:3].tolist()}); fix the input or set bounds='clamp' on the table")

    def _spec(self, feature: str) -> TableSpec:
        if feature not in self.table_of:
            raise KeyError(f"feature {feature!r} is served by no table; known: {sorted(self.table_of)}")
        return self.table_of[feature]

    # ---------------------------------------------------------------- lookup
    def lookup(self, state, feats: Mapping[str, Any]):
        """Returns (acts, residuals).

        acts[f]: [*ids.shape, D] for unpooled features, [B, D] for pooled bags.
        residuals: {"ids": {f: clamped ids}, "stats": {"ids_out_of_range": int32}}.
        """
        acts, ids_out, oob = {}, {}, jnp.zeros((), jnp.int32)
        for f, ids in feats.items():
            spec = self._spec(f)
            raw = ids.values if isinstance(ids, Jagged) else ids
            raw = jnp.asarray(raw, jnp.int32)
            bad = (raw < 0) | (raw >= spec.vocab)
            if isinstance(ids, Jagged):
                bad = bad & ids.mask
            oob = oob + jnp.sum(bad, dtype=jnp.int32)
            clamped = jnp.clip(raw, 0, spec.vocab - 1)
            rows = jnp.take(state[spec.name]["weights"], clamped, axis=0)
            if spec.pooling is None:
                if isinstance(ids, Jagged):
                    raise TypeError(f"feature {f!r}: table {spec.name!r} has no pooling; pass plain ids, not a Jagged bag")
                acts[f] = rows
            else:
                if not isinstance(ids, Jagged):
                    raise TypeError(f"feature {f!r}: pooled table {spec.name!r} needs a Jagged bag of ids")
                acts[f] = _pool(rows, ids, spec.pooling)
            ids_out[f] = ids.replace(values=clamped) if isinstance(ids, Jagged) else clamped
        return acts, {"ids": ids_out, "stats": {"ids_out_of_range": oob}}

    # ---------------------------------------------------------------- update
    def apply_gradients(self, state, residuals, g_acts):
        """Sparse update of the rows touched by the batch; returns the new state."""
        new_state = dict(state)
        for name, spec in self.specs.items():
            ids_list, g_list = [], []
            for f in spec.features:
                if f not in g_acts:
                    continue
                ids, g = residuals["ids"][f], g_acts[f]
                if isinstance(ids, Jagged):
                    ids, g = _unpool_grads(ids, g, spec.pooling)
                ids_list.append(ids.reshape(-1))
                g_list.append(g.reshape(-1, spec.dim))
            if not ids_list:
                continue
            ids = jnp.concatenate(ids_list)
            g = jnp.concatenate(g_list).astype(jnp.float32)
            new_state[name] = _update_rows(state[name], ids, g, spec)
        return new_state


def _pool(rows: Array, bag: Jagged, pooling: str) -> Array:
    b = bag.num_samples
    rows = jnp.where(bag.mask[:, None], rows, 0)
    summed = jax.ops.segment_sum(rows, bag.segment_ids, num_segments=b + 1)[:b]
    if pooling == "mean":
        summed = summed / jnp.maximum(bag.lengths, 1)[:, None].astype(summed.dtype)
    return summed


def _unpool_grads(bag: Jagged, g: Array, pooling: str):
    """Pooled grads [B, D] -> per-token grads [T, D] (zero on padding)."""
    b = bag.num_samples
    gp = g
    if pooling == "mean":
        gp = g / jnp.maximum(bag.lengths, 1)[:, None].astype(g.dtype)
    gp = jnp.concatenate([gp, jnp.zeros((1, g.shape[-1]), g.dtype)])
    return bag.values, jnp.take(gp, jnp.minimum(bag.segment_ids, b), axis=0)


def _update_rows(table_state, ids: Array, g: Array, spec: TableSpec):
    """Sum duplicate ids' grads (sort + segment_sum), update those rows only."""
    n = ids.shape[0]
    uniq, inv = jnp.unique(ids, size=n, fill_value=spec.vocab, return_inverse=True)
    g_sum = jax.ops.segment_sum(g, inv.reshape(-1), num_segments=n)
    safe = jnp.minimum(uniq, spec.vocab - 1)
    rows = jnp.take(table_state["weights"], safe, axis=0)
    opt_rows = {k: jnp.take(v, safe, axis=0) for k, v in table_state.items() if k != "weights"}
    new_rows, new_opt = spec.optimizer.update(rows, opt_rows, g_sum)
    out = {"weights": table_state["weights"].at[uniq].set(new_rows, mode="drop")}
    for k, v in new_opt.items():
        out[k] = table_state[k].at[uniq].set(v, mode="drop")
    return out
