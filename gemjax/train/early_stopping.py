"""Early stopping on a validation metric, keeping the best parameters of an NNX model."""

from __future__ import annotations

import math

import jax
from flax import nnx


class EarlyStopping:
    """Track a higher-is-better metric; remember the best model's params; stop after
    `patience` evaluations without improvement.

        stopper = EarlyStopping(patience=4)
        for epoch ...:
            if stopper.update(valid_auc, model):
                break
        stopper.restore(model)          # the best evaluation's parameters
    """

    def __init__(self, patience: int):
        if patience < 1:
            raise ValueError(f"patience must be >= 1, got {patience}")
        self.patience = patience
        self.best = -math.inf
        self.bad = 0
        self._state = None

    def update(self, metric: float, model: nnx.Module) -> bool:
        """Record one evaluation; True when training should stop."""
        if metric > self.best:
            self.best, self.bad = float(metric), 0
            self._state = jax.tree.map(lambda a: a.copy(), nnx.state(model, nnx.Param))
            return False
        self.bad += 1
        return self.bad >= self.patience

    def restore(self, model: nnx.Module) -> None:
        """Put the best evaluation's parameters back into `model` (no-op before any update)."""
        if self._state is not None:
            nnx.update(model, self._state)
