"""The jit-compiled train and eval steps.

Train state (a plain pytree, checkpointed whole):
    {"step": int32 [], "params": nested dict of float32 arrays (the NNX params),
     "opt_state": optax state, "tables": {table: {"weights": [V, D], "accum": [V]}}}

One step:  ids -> sparse lookup (tables never enter jax.grad) -> dense model ->
loss; value_and_grad w.r.t. (dense params, looked-up activations); optax on the
dense params, the fused row-wise optimizer on the touched table rows only.

Jagged work runs per device: the model forward is a `jax.shard_map` over the
mesh's "batch" axis, each device holding its own packed buffers (DESIGN 3.1).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from gemjax.config import Config
from gemjax.data.batch import Batch, id_features
from gemjax.models.gem import build_model, sequence_id_fields, table_specs
from gemjax.sparse import EmbeddingCollection

BATCH_AXIS = "batch"


def masked_bce_sums(logits: jax.Array, batch: Batch):
    """Per-task sums over the (local) batch: (loss_sum [K], weight_sum [K], positive_sum [K]).

    logits, labels, label_mask [B, K]; weights [B]. Log loss with logits, float32.
    """
    w = batch.label_mask * batch.weights[:, None]
    ll = optax.sigmoid_binary_cross_entropy(logits.astype(jnp.float32), batch.labels)
    return jnp.sum(ll * w, 0), jnp.sum(w, 0), jnp.sum(batch.labels * w, 0)


@dataclasses.dataclass
class Trainer:
    """Everything the steps close over: config, model graph, optimizers, mesh."""

    cfg: Config
    mesh: Mesh
    graphdef: Any
    tx: optax.GradientTransformation
    coll: EmbeddingCollection
    id_fields: dict[str, tuple[str, ...]]

    @classmethod
    def create(cls, cfg: Config, mesh: Mesh | None = None) -> "Trainer":
        mesh = mesh or Mesh(jax.devices(), (BATCH_AXIS,), axis_types=(jax.sharding.AxisType.Auto,))
        model = nnx.eval_shape(lambda: build_model(cfg, nnx.Rngs(0)))
        graphdef, _ = nnx.split(model, nnx.Param)
        t = cfg.train
        sched = optax.warmup_cosine_decay_schedule(
            0.0, t.dense_lr, max(1, min(t.warmup_steps, t.steps)), max(t.steps, 2), t.dense_lr * 0.05)
        tx = optax.chain(optax.clip_by_global_norm(10.0), optax.adam(sched))
        return cls(cfg, mesh, graphdef, tx, EmbeddingCollection(table_specs(cfg), mesh=mesh),
                   sequence_id_fields(cfg))

    @property
    def num_shards(self) -> int:
        return self.mesh.shape[BATCH_AXIS]

    def init_state(self, seed: int) -> dict:
        key = jax.random.key(seed)
        model = build_model(self.cfg, nnx.Rngs(jax.random.fold_in(key, 0)))
        params = nnx.split(model, nnx.Param)[1].to_pure_dict()
        dense = {"step": jnp.zeros((), jnp.int32), "params": params,
                 "opt_state": self.tx.init(params)}
        dense = jax.device_put(dense, NamedSharding(self.mesh, P()))
        return {**dense, "tables": self.coll.init(jax.random.fold_in(key, 1))}  # sharded per plan

    # ------------------------------------------------------------ forward
    def _sharded_forward(self) -> Callable:
        """(params, acts, batch) -> (loss, (loss_sum, weight_sum, positive_sum, logits))."""
        graphdef = self.graphdef

        def local(params, acts, batch):
            logits = nnx.merge(graphdef, params)(acts, batch)
            sums = masked_bce_sums(logits, batch)
            return jax.tree.map(lambda s: jax.lax.psum(s, BATCH_AXIS), sums), logits

        fwd = jax.shard_map(local, mesh=self.mesh, in_specs=(P(), P(BATCH_AXIS), P(BATCH_AXIS)),
                            out_specs=(P(), P(BATCH_AXIS)))

        def loss_fn(params, acts, batch):
            (loss_sum, w_sum, pos_sum), logits = fwd(params, acts, batch)
            loss = jnp.sum(loss_sum) / jnp.maximum(jnp.sum(w_sum), 1.0)
            return loss, (loss_sum, w_sum, pos_sum, logits)

        return loss_fn

    def make_train_step(self) -> Callable:
        loss_fn = self._sharded_forward()
        coll, tx, id_fields = self.coll, self.tx, self.id_fields

        def step(state, batch: Batch):
            acts, residuals = coll.lookup(state["tables"], id_features(batch, id_fields))
            (loss, (loss_sum, w_sum, pos_sum, _)), (g_params, g_acts) = jax.value_and_grad(
                loss_fn, argnums=(0, 1), has_aux=True)(state["params"], acts, batch)
            updates, opt_state = tx.update(g_params, state["opt_state"], state["params"])
            new_state = {"step": state["step"] + 1,
                         "params": optax.apply_updates(state["params"], updates),
                         "opt_state": opt_state,
                         "tables": coll.apply_gradients(state["tables"], residuals, g_acts)}
            metrics = {"loss": loss, "loss_sum": loss_sum, "weight_sum": w_sum,
                       "positive_sum": pos_sum, "grad_norm": optax.global_norm(g_params),
                       **residuals["stats"]}
            return new_state, metrics

        return jax.jit(step, donate_argnums=(0,))

    def make_eval_step(self) -> Callable:
        loss_fn = self._sharded_forward()
        coll, id_fields = self.coll, self.id_fields

        def step(state, batch: Batch):
            acts, _ = coll.lookup(state["tables"], id_features(batch, id_fields))
            _, (_, _, _, logits) = loss_fn(state["params"], acts, batch)
            return jax.nn.sigmoid(logits)

        return jax.jit(step)
