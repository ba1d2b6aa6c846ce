"""Run the real train step a few steps on a mesh and return host copies, for layout-equality checks.

    res = train_steps("replica=2,fsdp=4", steps=3, table_replica_axes=("replica",))

Every process of a multi-process job calls it (``gemjax.parallel.launch``); each
process feeds only its own devices' shards. The data are the stream's
``source_shards`` shards regrouped onto the mesh (``feeding.regroup``), so any
mesh whose device count divides source_shards sees the same samples and a
correct layout gives the same losses, params and tables as one device.
Returns plain numpy / Python values (picklable), identical on every process.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np

from gemjax.config import get_config
from gemjax.data.feeding import Feeder, regroup
from gemjax.data.source import make_source
from gemjax.parallel import multihost
from gemjax.parallel.mesh import build_mesh
from gemjax.train.step import Trainer, default_mesh

# Attention key biases: softmax is invariant to them (q.b shifts every score of a
# query equally), so their true gradient is 0 and the computed one is float32
# rounding noise, which Adam normalises to +-lr; compare them on the global scale.
KEY_BIAS = ("['k_proj']['bias']",)


def train_steps(mesh_spec: str | None, steps: int = 3, *, config: str = "tiny", overrides: str = "",
                table_replica_axes: Sequence[str] = (), source_shards: int = 8, seed: int = 0,
                tables0: dict | None = None, hlo: bool = False, evaluate: bool = True,
                **planner_kw) -> dict[str, Any]:
    """{"losses" [steps], "ids_overflow", "params", "init_params", "tables", "init_tables",
    "devices", "processes"}; tables in logical row order ({table: {name: [V, ...]}}).

    mesh_spec None: one device (the reference). planner_kw: sparse planner
    arguments (e.g. replicate_below_bytes=0, capacity_factor=None).
    tables0: logical tables to start from instead of the mesh's own init (table
    init is drawn in storage order, which depends on the shard count).
    hlo: also return the compiled step's HLO text ("hlo"), the compiled eval step's
    ("eval_hlo") and the state's shardings ("shardings", PartitionSpec strings).
    "eval_probs": the eval step's probabilities on the first batch after training
    (evaluate False: no eval step is built, neither "eval_probs" nor "eval_hlo").
    """
    cfg = get_config(config, overrides)
    mesh = default_mesh(jax.devices()[:1]) if mesh_spec is None else build_mesh(mesh_spec)
    trainer = Trainer.create(cfg, mesh, table_replica_axes=tuple(table_replica_axes), **planner_kw)
    state = trainer.init_state(seed)
    init_params = multihost.to_host(state["params"])
    init_tables = trainer.coll.to_logical(multihost.to_host(state["tables"]))
    if tables0 is not None:
        state["tables"] = trainer.coll.from_logical(tables0)
    feeder = Feeder(regroup(make_source(cfg, seed=seed).shard_batch, source_shards), mesh,
                    check_ids=trainer.coll.check_ids, id_fields=trainer.id_fields)
    step = trainer.make_train_step()
    losses, overflow, extra = [], 0, {}
    batches = [feeder.to_device(feeder.host_batch(i)[0]) for i in range(steps)]
    for i, batch in enumerate(batches):
        if hlo and i == 0:
            extra["hlo"] = step.lower(state, batch).compile().as_text()
            extra["shardings"] = jax.tree.map(lambda x: str(x.sharding.spec), state)
        # next_batch as the train loop passes it (its sparse branch plan is made ahead)
        state, m = step(state, batch, next_batch=batches[i + 1] if i + 1 < steps else None)
        losses.append(float(np.asarray(m["loss"])))
        overflow += int(np.asarray(m["ids_overflow"]))
    if evaluate:
        eval_step = trainer.make_eval_step()
        if hlo:
            extra["eval_hlo"] = eval_step.lower(state, batches[0]).compile().as_text()
        extra["eval_probs"] = np.asarray(eval_step(state, batches[0]))
    return {"losses": losses, "ids_overflow": overflow,
            "params": multihost.to_host(state["params"]), "init_params": init_params,
            "tables": trainer.coll.to_logical(multihost.to_host(state["tables"])),
            "init_tables": init_tables, "plans": {n: p.kind for n, p in trainer.coll.plans.items()},
            "devices": mesh.size, "processes": jax.process_count(),
            "branch_plans": step.plans, **extra}


def max_rel_diff(a: Any, b: Any, skip: Sequence[str] = ()) -> float:
    """Largest |a - b| of any leaf relative to that leaf's largest |b| (float64).

    skip: leaves whose path (jax.tree_util.keystr) contains one of these strings
    are left out (see `global_rel_diff` for a check that covers them).
    """
    errs = []
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
        if any(s in jax.tree_util.keystr(path) for s in skip):
            continue
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        errs.append(float(np.max(np.abs(x - y))) / max(float(np.max(np.abs(y))), 1e-30))
    return max(errs)


def global_rel_diff(a: Any, b: Any) -> float:
    """Largest |a - b| over all leaves relative to the largest |b| over all leaves (float64)."""
    d = max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
            for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    return d / max(max(float(np.max(np.abs(np.asarray(y)))) for y in jax.tree.leaves(b)), 1e-30)
