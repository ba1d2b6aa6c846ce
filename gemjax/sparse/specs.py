"""Embedding table specifications: one list describes every table."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from gemjax.sparse.optimizers import RowWiseAdagrad, SparseOptimizer

POOLINGS = (None, "sum", "mean")
BOUNDS = ("strict", "clamp", "hash")


@dataclasses.dataclass(frozen=True)
class TableSpec:
    """One embedding table.

    name: table name.  vocab: rows.  dim: embedding width.
    features: the feature names (keys of the lookup dict) served by this table.
    pooling: None (one row per id: single ids or sequence tokens), "sum" or
      "mean" (multi-hot bags given as Jagged, pooled to [B, dim]).
    dtype: storage dtype (float32 or bfloat16).
    init_scale: rows start ~ U(-s, s); default 1/sqrt(dim).
    optimizer: the fused sparse optimizer applied to touched rows.
    bounds: "strict" (ids outside [0, vocab) are an error, checked on the host
      by `EmbeddingCollection.check_ids`) or "clamp" (clamped into range inside
      the step and counted in the lookup stats) or "hash" (ids taken modulo
      vocab, non-negative, and counted). Default "strict". Under jit "strict"
      and "clamp" both clamp and count ("ids_out_of_range"); "strict" adds the
      host check. Padding tokens of Jagged bags are never counted.
    """

    name: str
    vocab: int
    dim: int
    features: tuple[str, ...]
    pooling: str | None = None
    dtype: Any = jnp.float32
    init_scale: float | None = None
    optimizer: SparseOptimizer = RowWiseAdagrad()
    bounds: str = "strict"

    def __post_init__(self):
        if self.vocab < 1:
            raise ValueError(f"table {self.name!r}: vocab must be >= 1, got {self.vocab}")
        if self.dim < 1:
            raise ValueError(f"table {self.name!r}: dim must be >= 1, got {self.dim}")
        if not self.features:
            raise ValueError(f"table {self.name!r}: needs at least one feature")
        if self.pooling not in POOLINGS:
            raise ValueError(f"table {self.name!r}: pooling must be one of {POOLINGS}, got {self.pooling!r}")
        if jnp.dtype(self.dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
            raise ValueError(f"table {self.name!r}: dtype must be float32 or bfloat16, got {self.dtype}")
        if self.bounds not in BOUNDS:
            raise ValueError(f"table {self.name!r}: bounds must be one of {BOUNDS}, got {self.bounds!r}")

    @property
    def row_bytes(self) -> int:
        """Bytes per row: weights in the storage dtype plus optimizer state."""
        return self.dim * jnp.dtype(self.dtype).itemsize + self.optimizer.state_bytes_per_row(self.dim)

    @property
    def scale(self) -> float:
        return self.init_scale if self.init_scale is not None else self.dim ** -0.5
