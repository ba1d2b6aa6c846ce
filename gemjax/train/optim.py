"""Every optimizer of a run, built from the config in one place.

    tx = dense_transform(cfg)                  # optax transform of the dense params
    opt = sparse_optimizer(cfg)                # row update of the embedding tables
    specs = table_specs(cfg)                   # the model's tables, each with `opt`

Dense (cfg.optim.dense: name, any optax transform that takes a learning rate): the chain
    clip_by_global_norm(optim.dense.clip_norm)      (left out when clip_norm is 0)
    <optax.{optim.dense.name}>(schedule, **extra)   (extra: weight_decay where it takes one)
with the learning-rate schedule optim.dense.schedule over optim.dense.lr / warmup_steps:
    "warmup_cosine"    0 -> lr linearly over min(warmup_steps, train.steps // 2) steps,
                       then cosine down to lr * optim.dense.final_lr_scale at train.steps
    "warmup_constant"  0 -> lr linearly over warmup_steps, then constant (what an
                       endless online stream trains with)
    "constant"         lr from the first step

Sparse (cfg.optim.sparse.name): "rowwise_adagrad" (GEM's: one accumulator per row), "adagrad",
"sgd" or "lazy_adam" (gemjax.sparse.optimizers) at optim.sparse.lr; every table of the
run updates its touched rows with it.
"""

from __future__ import annotations

import dataclasses
import inspect

import optax

from gemjax.config import Config
from gemjax.models.gem import table_specs as model_table_specs
from gemjax.sparse import SGD, Adagrad, LazyAdam, RowWiseAdagrad, TableSpec
from gemjax.sparse.optimizers import SparseOptimizer

SCHEDULES = ("warmup_cosine", "warmup_constant", "constant")
SPARSE_OPTIMIZERS = {"rowwise_adagrad": RowWiseAdagrad, "adagrad": Adagrad, "sgd": SGD,
                     "lazy_adam": LazyAdam}


def lr_schedule(cfg: Config, schedule: str | None = None) -> optax.Schedule:
    """The dense learning rate per step (`schedule` overrides cfg.optim.dense.schedule)."""
    steps, o = cfg.train.steps, cfg.optim.dense
    schedule = schedule or o.schedule
    if schedule == "warmup_cosine":
        return optax.warmup_cosine_decay_schedule(
            0.0, o.lr, max(1, min(o.warmup_steps, steps // 2)), max(steps, 2),
            o.lr * o.final_lr_scale)
    if schedule == "warmup_constant":
        return optax.linear_schedule(0.0, o.lr, max(1, o.warmup_steps))
    if schedule == "constant":
        return optax.constant_schedule(o.lr)
    raise ValueError(f"optim.dense.schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")


def dense_factory(name: str):
    """optax.<name>, checked to be a transform that takes a learning rate."""
    fn = getattr(optax, name, None)
    if fn is None or not callable(fn) or "learning_rate" not in _params(fn):
        raise ValueError(f"optim.dense.name={name!r} is not an optax optimizer taking a "
                         f"learning_rate (e.g. adam, adamw, adagrad, sgd, lamb, lion)")
    return fn


def dense_transform(cfg: Config, schedule: str | None = None) -> optax.GradientTransformation:
    """clip_by_global_norm(optim.dense.clip_norm) then optax.<optim.dense.name> on lr_schedule."""
    o = cfg.optim.dense
    fn = dense_factory(o.name)
    kw = {}
    if o.weight_decay:
        if "weight_decay" not in _params(fn):
            raise ValueError(f"optim.dense.weight_decay={o.weight_decay:g}: optax.{o.name} takes no "
                             f"weight_decay (adamw, lamb, lion, adafactor do)")
        kw["weight_decay"] = o.weight_decay
    tx = fn(learning_rate=lr_schedule(cfg, schedule), **kw)
    return optax.chain(optax.clip_by_global_norm(o.clip_norm), tx) if o.clip_norm > 0 else tx


def sparse_optimizer(cfg: Config) -> SparseOptimizer:
    """The row-wise update of every embedding table, at optim.sparse.lr."""
    cls = SPARSE_OPTIMIZERS.get(cfg.optim.sparse.name)
    if cls is None:
        raise ValueError(f"optim.sparse.name must be one of {', '.join(SPARSE_OPTIMIZERS)}, "
                         f"got {cfg.optim.sparse.name!r}")
    return cls(lr=cfg.optim.sparse.lr)


def table_specs(cfg: Config) -> list[TableSpec]:
    """The model's embedding tables (gemjax.models.gem.table_specs), each updated by
    sparse_optimizer(cfg)."""
    opt = sparse_optimizer(cfg)
    return [dataclasses.replace(s, optimizer=opt) for s in model_table_specs(cfg)]


def _params(fn) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()
