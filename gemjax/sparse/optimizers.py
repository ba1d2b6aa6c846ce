"""Fused sparse optimizers: update only the rows a batch touched.

Each optimizer works on rows already gathered from a table:
    rows [N, D], state {name: [N, ...]}, grads [N, D] (duplicates summed)
and returns the new rows and state; the caller scatters them back.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

Array = Any


@dataclasses.dataclass(frozen=True)
class RowWiseAdagrad:
    """state += mean(g^2) over the row; w -= lr * g / (sqrt(state) + eps)."""

    lr: float = 0.05
    eps: float = 1e-8
    initial_accumulator: float = 0.0

    def init_state(self, vocab: int, dim: int) -> dict[str, Array]:
        return {"accum": jnp.full((vocab,), self.initial_accumulator, jnp.float32)}

    def update(self, rows: Array, state: dict[str, Array], grads: Array):
        g = grads.astype(jnp.float32)
        accum = state["accum"] + jnp.mean(g * g, axis=-1)
        step = self.lr * g / (jnp.sqrt(accum)[:, None] + self.eps)
        return (rows.astype(jnp.float32) - step).astype(rows.dtype), {"accum": accum}


SparseOptimizer = RowWiseAdagrad
