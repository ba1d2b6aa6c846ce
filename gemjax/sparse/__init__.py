"""Sparse embeddings: table specs, sharding plans, routed lookups, fused sparse optimizers."""

from gemjax.sparse.collection import EmbeddingCollection
from gemjax.sparse.optimizers import SGD, Adagrad, LazyAdam, RowWiseAdagrad
from gemjax.sparse.plans import TablePlan, format_plan, plan_tables
from gemjax.sparse.specs import TableSpec

__all__ = ["EmbeddingCollection", "SGD", "Adagrad", "LazyAdam", "RowWiseAdagrad", "TablePlan",
           "TableSpec", "format_plan", "plan_tables"]
