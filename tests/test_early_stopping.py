"""EarlyStopping keeps the best parameters and stops after `patience` bad evaluations."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gemjax.train.early_stopping import EarlyStopping


def test_keeps_best_params_and_stops_after_patience():
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    stopper = EarlyStopping(patience=2)
    stops = []
    for value, metric in ((1.0, 0.5), (2.0, 0.7), (3.0, 0.6), (4.0, 0.65)):
        model.kernel[...] = jnp.full((2, 1), value)
        stops.append(stopper.update(metric, model))
    assert stops == [False, False, False, True] and stopper.best == 0.7
    stopper.restore(model)
    np.testing.assert_array_equal(np.asarray(model.kernel[...]), np.full((2, 1), 2.0))


def test_patience_must_be_positive():
    with pytest.raises(ValueError, match="patience must be >= 1"):
        EarlyStopping(0)
