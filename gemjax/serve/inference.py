"""Prediction from a trained run: `load_for_inference(workdir)` -> predict(Batch) -> [B, K].

    predict = gemjax.load_for_inference("runs/tiny")          # best (else newest) checkpoint, 1 device
    probs = predict(batch)                                     # numpy float [B, K]

`predict` is the training's eval step (`Trainer.make_eval_step`: sparse lookup,
sharded forward, sigmoid) on the restored state, so its probabilities equal
those the run's evaluation computes, bit for bit, on the same mesh.

The batch: a `gemjax.data.batch.Batch` of numpy arrays laid out for the mesh,
i.e. this process's device shards concatenated, each with its own packed
sequence buffers and local offsets (what `Feeder.host_batch` and
`SyntheticStream.shard_batch` give). On the default one-device mesh that is a
plain Batch: sparse ids [B], dense [B, F], sequences as Jagged with capacity T,
labels / label_mask [B, K], surface [B], weights [B]. Labels, label_mask and
weights do not change the probabilities (zeros are fine). Each shard is checked
on the host first (`validate_batch` with the tables' strict id bounds): bad
values are a ValueError naming the shard, feature and sample. A Batch of jax
arrays already placed on the mesh (Feeder.to_device) is used as it is.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from gemjax.data.batch import Batch
from gemjax.data.feeding import Feeder, validate_batch
from gemjax.serve.restore import restore


def _no_stream(step, shard, num_shards):
    raise RuntimeError("Predictor's Feeder only places given batches")


class Predictor:
    """predict(batch) -> probabilities [rows of this process's shards, K] (numpy).

    Attributes: cfg (the run's Config), trainer, step (the checkpoint step), directory
    (the checkpoint directory: WORKDIR/best or WORKDIR/checkpoints), state
    (params and tables on trainer.mesh; the optimizer state is dropped), meta.
    """

    def __init__(self, run):
        self.cfg, self.trainer, self.step, self.meta = run.cfg, run.trainer, run.step, run.meta
        self.directory = run.directory     # WORKDIR/best or WORKDIR/checkpoints
        self.state = {k: v for k, v in run.state.items() if k != "opt_state"}   # unused by the forward
        for leaf in jax.tree.leaves(run.state["opt_state"]):
            if isinstance(leaf, jax.Array):
                leaf.delete()
        self.feeder = Feeder(_no_stream, self.trainer.mesh)
        self.eval_step = self.trainer.make_eval_step()

    @property
    def mesh(self):
        return self.trainer.mesh

    def place(self, batch: Batch) -> Batch:
        """Host batch -> global arrays on the mesh, each shard checked first."""
        k = len(self.feeder.local_shards)
        leaves = jax.tree.leaves(batch)
        if any(np.shape(x)[0] % k for x in leaves):
            raise ValueError(f"batch: every leaf's leading dim must split into this process's {k} "
                             f"device shards, got shapes {[np.shape(x) for x in leaves]}")
        parts = jax.tree.map(lambda x: np.split(np.asarray(x), k), batch)
        for i, s in enumerate(self.feeder.local_shards):
            shard = jax.tree.map(lambda p: p[i], parts, is_leaf=lambda p: isinstance(p, list))
            validate_batch(shard, self.trainer.coll.check_ids, self.trainer.id_fields,
                           where=f"predict batch shard {s}")
        return self.feeder.to_device(batch)

    def __call__(self, batch: Batch) -> np.ndarray:
        leaves = jax.tree.leaves(batch)
        on_mesh = leaves and all(isinstance(x, jax.Array) and x.sharding == self.feeder.sharding
                                 for x in leaves)
        return np.asarray(self.eval_step(self.state, batch if on_mesh else self.place(batch)))


def check_self_contained(cfg, workdir: str) -> None:
    """ValueError for a run whose model reads its teacher's features (model.student.teacher_repr_dim
    > 0, a distilled student's representation transfer): its eval step needs the teacher."""
    if cfg.model.student.teacher_repr_dim:
        raise ValueError(f"{workdir}: the model reads its teacher's features (model.student.teacher_repr_dim="
                         f"{cfg.model.student.teacher_repr_dim}): evaluate, predict and export it with "
                         f"gemjax.distill.runs (evaluate_student, load_student, export_student)")


def load_for_inference(workdir: str, step: int | str | None = None, mesh: Any = None, *,
                       trainer_kw: dict | None = None, teacher_features: bool = False) -> Predictor:
    """A Predictor for checkpoint `step` of the run in `workdir`: default the best one
    (WORKDIR/best, the model selection's) when the run has it, else the newest; "best",
    "newest" or a step number pick another (gemjax.serve.restore.pick_checkpoint).
    Predictor.step and .directory say which checkpoint came back.

    mesh: any jax Mesh (default: one device, the first of jax.devices(), on a
    "batch" axis); trainer_kw: Trainer.create options (rules, table_replica_axes).
    The Config comes from WORKDIR/config.json. A workdir with no config or no
    checkpoint, or a step with no checkpoint, is a FileNotFoundError naming it.
    A model reading teacher features is refused (`check_self_contained`) unless
    `teacher_features` (the caller supplies them: gemjax.distill.runs).
    """
    if mesh is None:
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("batch",))
    run = restore(workdir, step, mesh, trainer_kw=trainer_kw)
    if not teacher_features:
        check_self_contained(run.cfg, workdir)
    return Predictor(run)
