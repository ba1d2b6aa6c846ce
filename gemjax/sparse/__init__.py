"""Sparse embeddings: table specs, the collection (lookup + fused sparse optimizers)."""

from gemjax.sparse.collection import EmbeddingCollection
from gemjax.sparse.optimizers import RowWiseAdagrad
from gemjax.sparse.specs import TableSpec

__all__ = ["EmbeddingCollection", "RowWiseAdagrad", "TableSpec"]
