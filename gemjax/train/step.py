"""The jit-compiled train and eval steps, on any mesh from gemjax.parallel.mesh.build_mesh.

Train state (a plain pytree, checkpointed whole):
    {"step": int32 [], "params": nested dict of float32 arrays (the NNX params),
     "opt_state": optax state, "tables": {table: {"weights": [V, D], "accum": [V]}}}

One step:  ids -> sparse lookup (tables never enter jax.grad) -> dense model ->
loss; value_and_grad w.r.t. (dense params, looked-up activations); optax on the
dense params, the fused row-wise optimizer on the touched table rows only.

Layout (DESIGN 3.3), for a mesh such as replica=2,fsdp=2,expert=2:
  batch    sharded over ALL mesh axes: each device holds its own packed jagged
           shard (DESIGN 3.1); the model forward is a `jax.shard_map` over them.
  params   + optax state placed by `rules.param_shardings` (logical names on every
           parameter; FSDP within "fsdp", replicated across "replica"). Inside the
           shard_map each parameter is all-gathered over its sharded axes, so the
           backward pass reduce-scatters its gradient back to the shard (and
           sums over the replica axes); params and optimizer state stay sharded.
  experts  expert parallelism (DESIGN 2: "2D FSDP + EP"): when the rules shard the
           experts' stacked dim over mesh axes of size ep > 1 (default: "expert",
           if it divides E), expert params are NOT gathered over those axes: each
           device keeps its [E/ep, ...] shard (still gathered over fsdp) and the
           forward runs under `experts.expert_parallel(axes)`, which makes
           WukongExperts exchange tokens with all_to_all. Their gradients come
           back per owner (reduce-scattered over fsdp, summed over replica by
           shard_map's transpose, never summed over the EP axes). Off with
           `Trainer.expert_parallel = False` (every device then runs all experts).
  router   the forward runs under `experts.sharded_batch(batch axes)`: the experts'
  aux      aux (load-balancing loss, z-loss, drops, load) are global-batch figures
           and their gradient is added once, as on one device (experts.py).
  tables   `EmbeddingCollection(specs, mesh, replica_axes=table_replica_axes)`:
           row-wise over the other (model-parallel) axes, replicated ("2d") or
           sharded ("fs2d") over the replica axes, per the sparse planner.
A 1-D mesh with one "batch" axis (the default: all devices) is plain data
parallelism with replicated params.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from gemjax.config import Config
from gemjax.data.batch import Batch, id_features
from gemjax.layers.experts import expert_parallel as expert_parallel_context
from gemjax.layers.experts import sharded_batch
from gemjax.models.gem import build_model, sequence_id_fields, table_specs
from gemjax.parallel import rules as rules_lib
from gemjax.sparse import EmbeddingCollection, routing

BATCH_AXIS = "batch"
# The Pallas kernels' outputs carry no varying-manual-axes type, which check_vma=True
# requires inside shard_map; the forward is per device and its gradients are unchanged
# (tests/test_train_sharded.py compares with one device).
CHECK_VMA = False


def default_mesh(devices: Sequence[jax.Device] | None = None) -> Mesh:
    """All devices on one "batch" axis (plain data parallelism)."""
    devices = list(jax.devices() if devices is None else devices)
    return Mesh(devices, (BATCH_AXIS,), axis_types=(jax.sharding.AxisType.Auto,))


def masked_bce_sums(logits: jax.Array, batch: Batch):
    """Per-task sums over the (local) batch: (loss_sum [K], weight_sum [K], positive_sum [K]).

    logits, labels, label_mask [B, K]; weights [B]. Log loss with logits, float32.
    """
    w = batch.label_mask * batch.weights[:, None]
    ll = optax.sigmoid_binary_cross_entropy(logits.astype(jnp.float32), batch.labels)
    return jnp.sum(ll * w, 0), jnp.sum(w, 0), jnp.sum(batch.labels * w, 0)


def gather_param(x: jax.Array, spec: P, local_dims: Sequence[int] = ()) -> jax.Array:
    """Inside shard_map: the full parameter from its shard (all_gather over each sharded dim).

    x: the local shard of a parameter placed with PartitionSpec `spec`. The
    transpose of all_gather is psum_scatter, so gradients come back reduce-scattered.
    local_dims: dims left as the local shard (the expert dim under EP).
    """
    for d, axes in enumerate(spec):
        if axes is not None and d not in local_dims:
            x = jax.lax.all_gather(x, axes, axis=d, tiled=True)
    return x


def expert_param_mask(graphdef: Any, params: Any) -> Any:
    """Like `params` (a pure dict, any leaves): True where the param's first logical
    axis name is "expert" (WukongExperts' stacked experts)."""
    model = nnx.merge(graphdef, params)
    names = jax.tree.map(lambda v: tuple(v.get_metadata().get("out_sharding") or ()),
                         nnx.state(model, nnx.Param), is_leaf=lambda v: isinstance(v, nnx.Variable))
    return jax.tree.map(lambda n: bool(n) and n[0] == "expert", names.to_pure_dict(),
                        is_leaf=lambda n: isinstance(n, tuple))


def expert_parallel_axes(mesh: Mesh, p_specs: Any, is_expert: Any) -> tuple[str, ...] | None:
    """Mesh axes the expert params' stacked dim is sharded over (the EP axes), or None
    when no expert param is sharded there or their sizes multiply to 1.

    p_specs: PartitionSpecs like the params; is_expert: `expert_param_mask`.
    """
    found = set()
    for spec, e in zip(jax.tree.leaves(p_specs, is_leaf=lambda s: isinstance(s, P)),
                       jax.tree.leaves(is_expert)):
        if e:
            d0 = spec[0] if len(spec) else None
            found.add(() if d0 is None else (d0,) if isinstance(d0, str) else tuple(d0))
    if len(found) > 1:
        raise ValueError(f"expert params are sharded over different axes on their expert dim: "
                         f"{sorted(found)}; expert parallelism needs one layout")
    axes = found.pop() if found else ()
    if not axes or int(np.prod([mesh.shape[a] for a in axes])) == 1:
        return None
    return axes


@dataclasses.dataclass
class Trainer:
    """Everything the steps close over: config, model graph, optimizers, mesh, shardings."""

    cfg: Config
    mesh: Mesh
    graphdef: Any
    tx: optax.GradientTransformation
    coll: EmbeddingCollection
    id_fields: dict[str, tuple[str, ...]]
    param_shardings: Any        # nested dict of NamedSharding, like state["params"]
    opt_shardings: Any          # like state["opt_state"]
    expert_parallel: bool = True  # EP when the rules shard the expert dim (module docstring)

    @classmethod
    def create(cls, cfg: Config, mesh: Mesh | None = None, *, rules: rules_lib.Rules | None = None,
               table_replica_axes: Sequence[str] = (), table_plan: Any = None,
               **planner_kw) -> "Trainer":
        """mesh: any jax Mesh (default: all devices on one "batch" axis).

        rules: logical-axis rules for the dense params (default rules.DEFAULT_RULES).
        table_replica_axes: mesh axes the embedding tables are replicated (or
          fs2d-sharded) over; the other axes form the model-parallel group.
        table_plan: a sparse plan (gemjax.sparse.plans.resolve); None: the planner,
          which takes planner_kw (plans.plan_tables: replicate_below_bytes,
          device_budget_bytes, capacity_factor (None: the all_to_all never drops ids)).
        """
        mesh = mesh or default_mesh()
        for a in table_replica_axes:
            if a not in mesh.axis_names:
                raise ValueError(f"table_replica_axes: {a!r} is not a mesh axis {mesh.axis_names}")
        model = nnx.eval_shape(lambda: build_model(cfg, nnx.Rngs(0)))
        graphdef, abstract = nnx.split(model, nnx.Param)
        t = cfg.train
        sched = optax.warmup_cosine_decay_schedule(
            0.0, t.dense_lr, max(1, min(t.warmup_steps, t.steps // 2)), max(t.steps, 2), t.dense_lr * 0.05)
        tx = optax.chain(optax.clip_by_global_norm(10.0), optax.adam(sched))
        p_sh = rules_lib.param_shardings(abstract, mesh, rules).to_pure_dict()
        replicated = NamedSharding(mesh, P())
        o_abs = jax.eval_shape(tx.init, abstract.to_pure_dict())
        o_sh = optax.tree_utils.tree_map_params(tx, lambda _, s: s, o_abs, p_sh,
                                                transform_non_params=lambda _: replicated)
        xb = routing.DEFAULT_EXCHANGE_BUCKETS if cfg.train.sparse_exchange_buckets else ()
        coll = EmbeddingCollection(table_specs(cfg), table_plan, mesh=mesh,
                                   replica_axes=tuple(table_replica_axes), exchange_buckets=xb,
                                   sync_buckets=cfg.train.sparse_sync_buckets,
                                   update_impl=cfg.train.sparse_update_impl,
                                   row_major=cfg.train.sparse_row_major, **planner_kw)
        return cls(cfg, mesh, graphdef, tx, coll, sequence_id_fields(cfg), p_sh, o_sh)

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The batch is sharded over every mesh axis, in mesh order."""
        return tuple(self.mesh.axis_names)

    @property
    def num_shards(self) -> int:
        """Devices, each holding its own batch shard."""
        return self.mesh.size

    def state_shardings(self) -> dict:
        """NamedShardings of the train state (orbax restore targets, jit out_shardings)."""
        return {"step": NamedSharding(self.mesh, P()), "params": self.param_shardings,
                "opt_state": self.opt_shardings, "tables": self.coll.state_sharding()}

    def init_state(self, seed: int) -> dict:
        """The initial state, every array already placed on state_shardings() (any process count).

        The dense params are drawn eagerly (identical on every process, whatever
        the mesh) and each device takes its slice; the optimizer state is built
        in place by a jitted init.
        """
        key = jax.random.key(seed)
        model = build_model(self.cfg, nnx.Rngs(jax.random.fold_in(key, 0)))
        host = jax.device_get(nnx.split(model, nnx.Param)[1].to_pure_dict())
        params = jax.tree.map(lambda a, s: jax.make_array_from_callback(a.shape, s, lambda i: a[i]),
                              host, self.param_shardings)
        opt_state = jax.jit(self.tx.init, out_shardings=self.opt_shardings)(params)
        step = jax.make_array_from_callback((), NamedSharding(self.mesh, P()),
                                            lambda i: np.zeros((), np.int32))
        return {"step": step, "params": params, "opt_state": opt_state,
                "tables": self.coll.init(jax.random.fold_in(key, 1))}  # sharded per plan

    # ------------------------------------------------------------ forward
    def _sharded_forward(self) -> Callable:
        """(params, acts, batch) -> (loss, (loss_sum, weight_sum, positive_sum, logits))."""
        graphdef, axes = self.graphdef, self.batch_axes
        p_specs = jax.tree.map(lambda s: s.spec, self.param_shardings)
        is_expert = expert_param_mask(graphdef, jax.tree.map(lambda _: 0.0, p_specs,
                                                             is_leaf=lambda s: isinstance(s, P)))
        ep_axes = (expert_parallel_axes(self.mesh, p_specs, is_expert)
                   if self.expert_parallel else None)
        local_dims = jax.tree.map(lambda e: (0,) if e and ep_axes else (), is_expert)

        def local(params, acts, batch):
            full = jax.tree.map(gather_param, params, p_specs, local_dims)
            ctx = expert_parallel_context(ep_axes) if ep_axes else contextlib.nullcontext()
            with ctx, sharded_batch(axes):    # router aux over the global batch
                logits = nnx.merge(graphdef, full)(acts, batch)
            sums = masked_bce_sums(logits, batch)
            return jax.tree.map(lambda s: jax.lax.psum(s, axes), sums), logits

        fwd = jax.shard_map(local, mesh=self.mesh, in_specs=(p_specs, P(axes), P(axes)),
                            out_specs=(P(), P(axes)), check_vma=CHECK_VMA)

        def loss_fn(params, acts, batch):
            (loss_sum, w_sum, pos_sum), logits = fwd(params, acts, batch)
            loss = jnp.sum(loss_sum) / jnp.maximum(jnp.sum(w_sum), 1.0)
            return loss, (loss_sum, w_sum, pos_sum, logits)

        return loss_fn

    def make_train_step(self) -> "PlannedStep":
        """(state, batch[, next_batch]) -> (state, metrics), jitted; state donated, outputs
        placed like the input. See `PlannedStep` for next_batch."""
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

        replicated = NamedSharding(self.mesh, P())
        shardings = (self.state_shardings(), replicated)

        return self._planned(step, "train step", donate_argnums=(0,), out_shardings=shardings)

    def _planned(self, step: Callable, name: str, **jit_kw) -> "PlannedStep":
        """PlannedStep `name` of `step` (state, batch) -> ..., traced with each sparse branch
        plan fixed and jitted with jit_kw."""
        coll = self.coll

        def build(plan: tuple) -> Callable:
            def fixed(state, batch):
                with coll.fixed_branches(plan):
                    return step(state, batch)
            return jax.jit(fixed, **jit_kw)

        return PlannedStep(coll, self.id_fields, build, fixed=self.cfg.train.sparse_fixed_branches,
                           name=name)

    def make_eval_step(self) -> Callable:
        """(state, batch) -> sigmoid probabilities [rows of this process's shards, K] (numpy).

        On one process that is the whole batch; with several, each process gets
        the rows of its own devices' shards, in the order it fed them. The sparse
        branches are fixed per batch as in training (a PlannedStep: no host-synced
        conditional in the program).
        """
        loss_fn = self._sharded_forward()
        coll, id_fields = self.coll, self.id_fields

        def step(state, batch: Batch):
            acts, _ = coll.lookup(state["tables"], id_features(batch, id_fields))
            _, (_, _, _, logits) = loss_fn(state["params"], acts, batch)
            return jax.nn.sigmoid(logits)

        planned = self._planned(step, "eval step")
        if jax.process_count() == 1:
            return planned

        def local_rows(state, batch):
            out = planned(state, batch)
            shards = sorted(out.addressable_shards, key=lambda s: s.index[0].start or 0)
            seen, rows = set(), []
            for s in shards:
                if (s.index[0].start or 0) not in seen:
                    seen.add(s.index[0].start or 0)
                    rows.append(np.asarray(s.data))
            return np.concatenate(rows)

        return local_rows


class PlannedStep:
    """A jitted step (the train step, the eval step), one program per sparse branch plan.

    Tables whose bucketed exchange or replica sync hold collectives inside a
    lax.switch (EmbeddingCollection.has_switches: train.sparse_exchange_buckets on
    model-parallel tables, train.sparse_sync_buckets on replicated ones) would make
    XLA:GPU stop the host at that conditional until the device reaches it, so the
    host could not queue the next step while this one runs (2 H200s: 20-30 ms of
    idle device per step). Instead the step is traced with the branches fixed
    (`coll.fixed_branches`), from the batch's `branch_plan`: a small jitted count
    of unique ids per table. Call with next_batch= and that count for the next
    batch is queued before this step and read after it is queued, so the host
    stays one step ahead. A plan at least as large as the batch needs in every
    table that is compiled already is reused (same results, fewer compiles);
    `plans` lists the compiled ones. Without switched tables, or with fixed=False
    (train.sparse_fixed_branches: the switches stay in the step): one program.
    """

    def __init__(self, coll: EmbeddingCollection, id_fields, build: Callable[[tuple], Callable],
                 fixed: bool = True, name: str = "step"):
        self.coll, self.id_fields, self._build, self.name = coll, id_fields, build, name
        self._fns: dict[tuple, Callable] = {}
        self._ahead: tuple[Any, tuple] | None = None     # (next batch, its plan)
        self._switched = fixed and coll.has_switches()

    @property
    def plans(self) -> list[tuple]:
        return list(self._fns)

    def _fn(self, plan: tuple) -> Callable:
        if plan not in self._fns:
            if self._fns:   # a batch needing larger buckets than any compiled plan: say why it stalls
                logging.warning("gemjax: compiling the %s for sparse branch plan %d %s "
                                "(table, exchange index, sync index)", self.name,
                                len(self._fns) + 1, plan)
            self._fns[plan] = self._build(plan)
        return self._fns[plan]

    def _needs(self, batch: Batch):
        return self.coll.branch_needs(id_features(batch, self.id_fields))

    def plan(self, batch: Batch, needs: Any = None) -> tuple:
        """The branch plan the step runs `batch` with (reads `needs` to the host)."""
        if not self._switched:
            return ()
        feats = id_features(batch, self.id_fields)
        if needs is None:
            needs = self.coll.branch_needs(feats)
        want = self.coll.branch_plan(feats, jax.device_get(needs))
        covers = [p for p in self._fns if len(p) == len(want) and all(
            a[0] == b[0] and a[1] >= b[1] and a[2] >= b[2] for a, b in zip(p, want))]
        return min(covers, key=lambda p: sum(x + y for _, x, y in p)) if covers else want

    def __call__(self, state, batch: Batch, next_batch: Batch | None = None):
        if not self._switched:
            return self._fn(())(state, batch)
        if self._ahead is not None and self._ahead[0] is batch:
            plan = self._ahead[1]
        else:
            plan = self.plan(batch)
        needs = self._needs(next_batch) if next_batch is not None else None  # queued first
        out = self._fn(plan)(state, batch)
        self._ahead = None if next_batch is None else (next_batch, self.plan(next_batch, needs))
        return out

    def lower(self, state, batch: Batch):
        """The jitted program `batch` runs with, lowered (e.g. .compile().memory_analysis())."""
        return self._fn(self.plan(batch)).lower(state, batch)
