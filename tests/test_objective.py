"""The one train step with an explicit objective (gemjax.train.step.Objective): a custom
objective's loss sums, its gradient and its eval output go through
Trainer.make_train_step / make_eval_step unchanged, checked against the model run
outside the step with the loss written out in numpy."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh

from gemjax.config import apply_overrides, get_config
from gemjax.data.batch import id_features
from gemjax.data.feeding import Feeder
from gemjax.data.synthetic import SyntheticStream
from gemjax.train.step import BinaryTasks, Trainer


@dataclasses.dataclass(frozen=True)
class Brier:
    """Squared error of the probabilities, per task; predict: the raw logits."""

    metrics: tuple[str, ...] = ("brier",)

    def lookup_ids(self, ctx, step, train):
        return {}

    def loss_sums(self, model, acts, batch, shard):
        w = batch.label_mask * batch.weights[:, None]
        err = (jax.nn.sigmoid(model(acts, batch).astype(jnp.float32)) - batch.labels) ** 2
        return {"loss_sum": jnp.sum(err * w, 0), "weight_sum": jnp.sum(w, 0),
                "step_seen": shard.step.astype(jnp.float32)[None]}

    def predict(self, model, acts, batch, shard):
        return model(acts, batch)


@pytest.mark.slow
def test_a_custom_objective_is_what_the_step_trains_and_evaluates():
    # model v0 without its sequence arch: the objective sees the same step, compiled in half the time
    cfg = apply_overrides(get_config("tiny"), "data.batch_size=16,model.use_sequences=false")
    trainer = Trainer.create(cfg, Mesh(np.array(jax.devices()[:1]), ("batch",)))
    assert trainer.objective == BinaryTasks()
    feeder = Feeder(SyntheticStream(cfg.data, 0).shard_batch, trainer.mesh)
    batch = feeder.to_device(feeder.host_batch(0)[0])
    state = trainer.init_state(0)

    # reference: the model outside the step (its logits and, by jax.grad, the gradient of
    # the loss written out here, in one program), the loss in numpy
    acts, _ = trainer.coll.lookup(state["tables"], id_features(batch, trainer.id_fields))
    w = np.asarray(batch.label_mask, np.float64) * np.asarray(batch.weights, np.float64)[:, None]

    def ref_loss(params):
        z = nnx.merge(trainer.graphdef, params)(acts, batch)
        e = (jax.nn.sigmoid(z) - batch.labels) ** 2 * jnp.asarray(w, jnp.float32)
        return jnp.sum(e) / jnp.maximum(jnp.sum(jnp.asarray(w, jnp.float32)), 1.0), z
    (_, z), grads = jax.jit(jax.value_and_grad(ref_loss, has_aux=True))(state["params"])
    logits = np.asarray(z, np.float64)
    err = (1 / (1 + np.exp(-logits)) - np.asarray(batch.labels, np.float64)) ** 2
    want_loss = np.sum(err * w) / max(np.sum(w), 1.0)
    want_gnorm = float(optax.global_norm(grads))
    bce = np.sum((np.logaddexp(0, logits) - np.asarray(batch.labels) * logits) * w) / max(np.sum(w), 1.0)
    assert abs(bce - want_loss) > 0.1          # the default objective's loss is another figure

    trainer.objective = Brier()                    # passed explicitly: the steps read it
    probs_or_logits = np.asarray(trainer.make_eval_step()(state, batch))
    np.testing.assert_allclose(probs_or_logits, logits, rtol=1e-5, atol=1e-6)   # predict: logits
    _, m = trainer.make_train_step()(state, batch)
    assert float(m["loss"]) == pytest.approx(want_loss, rel=1e-5)
    np.testing.assert_allclose(np.asarray(m["loss_sum"]), np.sum(err * w, 0), rtol=1e-5)
    assert float(m["step_seen"][0]) == 0.0                     # the state's step counter
    assert float(m["grad_norm"]) == pytest.approx(want_gnorm, rel=1e-4)
