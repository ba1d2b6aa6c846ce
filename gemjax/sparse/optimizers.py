"""Fused sparse optimizers: update only the rows a batch touched.

Every optimizer keeps its state as arrays whose leading dimension is the
vocabulary, so a table's weights and state shard the same way:

    init_state(vocab, dim) -> {name: [V, ...] array}

and updates rows already gathered from the table:

    update(rows [N, D], state {name: [N, ...]}, grads [N, D] (duplicates summed))
      -> (new rows [N, D] in the table dtype, new state {name: [N, ...]})

The caller scatters the results back into the (donated) table, so no dense
[V, D] gradient or state copy is ever built. Math runs in float32.

Optimizers:
  SGD             w -= lr * g
  Adagrad         a += g^2 (per element);  w -= lr * g / (sqrt(a) + eps)
  RowWiseAdagrad  a += mean(g^2) (per row); w -= lr * g / (sqrt(a) + eps)
  LazyAdam        Adam on touched rows only; bias correction uses each row's own
                  update count (state "count" [V] int32), since untouched rows'
                  moments do not decay.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp

Array = Any


@dataclasses.dataclass(frozen=True)
class SGD:
    """w -= lr * g."""

    lr: float = 0.01

    def init_state(self, vocab: int, dim: int) -> dict[str, Array]:
        return {}

    def state_bytes_per_row(self, dim: int) -> int:
        return 0

    def update(self, rows: Array, state: dict[str, Array], grads: Array):
        w = rows.astype(jnp.float32) - self.lr * grads.astype(jnp.float32)
        return w.astype(rows.dtype), {}


@dataclasses.dataclass(frozen=True)
class Adagrad:
    """Element-wise Adagrad: a += g^2; w -= lr * g / (sqrt(a) + eps)."""

    lr: float = 0.05
    eps: float = 1e-8
    initial_accumulator: float = 0.0

    def init_state(self, vocab: int, dim: int) -> dict[str, Array]:
        return {"accum": jnp.full((vocab, dim), self.initial_accumulator, jnp.float32)}

    def state_bytes_per_row(self, dim: int) -> int:
        return 4 * dim

    def update(self, rows: Array, state: dict[str, Array], grads: Array):
        g = grads.astype(jnp.float32)
        accum = state["accum"] + g * g
        w = rows.astype(jnp.float32) - self.lr * g / (jnp.sqrt(accum) + self.eps)
        return w.astype(rows.dtype), {"accum": accum}


@dataclasses.dataclass(frozen=True)
class RowWiseAdagrad:
    """state += mean(g^2) over the row; w -= lr * g / (sqrt(state) + eps)."""

    lr: float = 0.05
    eps: float = 1e-8
    initial_accumulator: float = 0.0

    def init_state(self, vocab: int, dim: int) -> dict[str, Array]:
        return {"accum": jnp.full((vocab,), self.initial_accumulator, jnp.float32)}

    def state_bytes_per_row(self, dim: int) -> int:
        return 4

    def update(self, rows: Array, state: dict[str, Array], grads: Array):
        g = grads.astype(jnp.float32)
        accum = state["accum"] + jnp.mean(g * g, axis=-1)
        step = self.lr * g / (jnp.sqrt(accum)[:, None] + self.eps)
        return (rows.astype(jnp.float32) - step).astype(rows.dtype), {"accum": accum}


@dataclasses.dataclass(frozen=True)
class LazyAdam:
    """Adam on touched rows only, per-row bias correction (see module docstring).

    m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2;  c = count + 1
    w -= lr * (m / (1 - b1^c)) / (sqrt(v / (1 - b2^c)) + eps)
    """

    lr: float = 1e-3
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8

    def init_state(self, vocab: int, dim: int) -> dict[str, Array]:
        return {"m": jnp.zeros((vocab, dim), jnp.float32),
                "v": jnp.zeros((vocab, dim), jnp.float32),
                "count": jnp.zeros((vocab,), jnp.int32)}

    def state_bytes_per_row(self, dim: int) -> int:
        return 8 * dim + 4

    def update(self, rows: Array, state: dict[str, Array], grads: Array):
        g = grads.astype(jnp.float32)
        m = self.b1 * state["m"] + (1 - self.b1) * g
        v = self.b2 * state["v"] + (1 - self.b2) * g * g
        count = state["count"] + 1
        c = count.astype(jnp.float32)[:, None]
        # 1 - b^c as -expm1(c log b) with log b taken in float64: 1 - 0.999**c in
        # float32 loses ~5 digits to cancellation.
        m_hat = m / -jnp.expm1(c * math.log(self.b1))
        v_hat = v / -jnp.expm1(c * math.log(self.b2))
        w = rows.astype(jnp.float32) - self.lr * m_hat / (jnp.sqrt(v_hat) + self.eps)
        return w.astype(rows.dtype), {"m": m, "v": v, "count": count}


SparseOptimizer = SGD | Adagrad | RowWiseAdagrad | LazyAdam
