"""Where a batch becomes a loss and gradients: `loss_fn` and `train_step` (and `eval_step`),
top-level functions of (StepContext, state, batch); the `Trainer` builds the context and
jits them, on any mesh from gemjax.parallel.mesh.build_mesh.

Train state (a plain pytree, checkpointed whole):
    {"step": int32 [], "params": nested dict of float32 arrays (the NNX params),
     "opt_state": optax state, "tables": {table: {"weights": [V, D], "accum": [V]}}}
  plus, under model.precision.format=fp8 with model.precision.scaling=delayed,
     "fp8_meta": {"/"-joined path of each FP8 linear: amax history float32 [3, H]}
  (rows x, w, dy, newest first; H = model.precision.amax_history; replicated): each step
  scales its FP8 operands from it and writes the next one (gemjax.precision.delayed: the
  history's "gradient" is its update; it never enters the optimizer).

One step (`train_step`):  ids (the batch's and the objective's `lookup_ids`) -> sparse
lookup (tables never enter jax.grad) -> the objective's loss sums per batch shard
(`Objective.loss_sums`, calling the dense model) -> loss (`loss_fn`); value_and_grad
w.r.t. (dense params, looked-up activations); optax on the dense params, the fused
row-wise optimizer on the touched table rows only. The sparse branch plan of each batch
is fixed ahead of the step by gemjax.train.planned.

Objectives (`Objective`, passed in StepContext / Trainer.objective): `BinaryTasks` (the
multi-task log loss, `masked_bce_sums`; the default), a distilled student's KD loss
(gemjax.distill.losses.kd_objective, a BinaryTasks), next-item retrieval's sampled or
full softmax (gemjax.train.retrieval.NextItemSoftmax). The eval step returns the
objective's `predict` per row.

Layout, for a mesh such as replica=2,fsdp=2,expert=2:
  batch    sharded over ALL mesh axes: each device holds its own packed jagged
           shard; the model forward is a `jax.shard_map` over them.
  params   + optax state placed by `rules.param_shardings` (logical names on every
           parameter; FSDP within "fsdp", replicated across "replica"). Inside the
           shard_map each parameter is all-gathered over its sharded axes, so the
           backward pass reduce-scatters its gradient back to the shard (and
           sums over the replica axes); params and optimizer state stay sharded.
  fp8      with model.precision.format=fp8 and model.precision.gather (default "exact": the tensor and
           blocked scalings; "always": rowwise too), the kernel of each FP8 linear
           sharded over one dim goes through gemjax.precision.fsdp.all_gather_fp8_weight
           instead: quantized once per step with the FP8 GEMM's own scales, gathered as
           FP8 bits (a quarter of the float32 bytes), its gradient reduce-scattered
           the same way (StepContext.fp8_weights, `fp8_weight_plan`).
  experts  expert parallelism ("2D FSDP + EP"): when the rules shard the
           experts' stacked dim over mesh axes of size ep > 1 (default: "expert",
           if it divides E), expert params are NOT gathered over those axes: each
           device keeps its [E/ep, ...] shard (still gathered over fsdp) and the
           model's experts get those axes (`experts.set_mesh_axes(expert_axes=)`), which
           makes WukongExperts exchange tokens with all_to_all. Their gradients come
           back per owner (reduce-scattered over fsdp, summed over replica by
           shard_map's transpose, never summed over the EP axes). Off with
           `Trainer.expert_parallel = False` (every device then runs all experts).
  router   the model gets the batch axes (`experts.set_mesh_axes(batch_axes=)`): the experts'
  aux      aux (load-balancing loss, z-loss, drops, load) are global-batch figures
           and their gradient is added once, as on one device (experts.py).
  tables   `EmbeddingCollection(specs, mesh, replica_axes=table_replica_axes)`:
           row-wise over the other (model-parallel) axes, replicated ("2d") or
           sharded ("fs2d") over the replica axes, per the sparse planner.
A 1-D mesh with one "batch" axis (the default: all devices) is plain data
parallelism with replicated params.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from gemjax.config import Config
from gemjax.data.batch import Batch, id_features
from gemjax.layers.experts import set_mesh_axes
from gemjax.models.gem import build_model, sequence_id_fields
from gemjax.parallel import rules as rules_lib
from gemjax.precision.fsdp import WeightGather, all_gather_fp8_weight, weight_block
from gemjax.precision.policy import bind_histories, delayed_linears, fp8_kernels
from gemjax.sparse import EmbeddingCollection, routing
from gemjax.train import optim
from gemjax.train.planned import PlannedStep, planned_jit

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


@dataclasses.dataclass(frozen=True)
class Fp8Weight:
    """A leaf of StepContext.fp8_weights: the kernel of an FP8 linear, its GEMM's recipe
    and input dtype (None: the kernel's own); rowwise: gathered as FP8 under the rowwise
    scaling too (model.precision.gather=always)."""
    recipe: Any
    dtype: str | None
    rowwise: bool = False


def fp8_weight_plan(w: jax.Array, spec: P, local_dims: Sequence[int], fp8: Any,
                    mesh: Mesh) -> WeightGather | None:
    """How the step gathers shard w of an FP8 linear's kernel [K, N] (placed with `spec`)
    as FP8, or None to gather it like any param: when `fp8` is an Fp8Weight and exactly
    one dim of w is sharded, over mesh axes of more than one device in all."""
    if not isinstance(fp8, Fp8Weight) or w.ndim != 2:
        return None
    if fp8.recipe.scaling == "rowwise" and not fp8.rowwise or fp8.recipe.scaling == "delayed":
        return None
    dims = [d for d, a in enumerate(spec) if a is not None and d not in local_dims]
    if len(dims) != 1:
        return None
    d = dims[0]
    axes = (spec[d],) if isinstance(spec[d], str) else tuple(spec[d])
    n = int(np.prod([mesh.shape[a] for a in axes]))
    if n == 1:
        return None
    shape = tuple(s * (n if i == d else 1) for i, s in enumerate(w.shape))
    return WeightGather(axes, d, weight_block(fp8.recipe, shape), fp8.recipe.fwd_fmt,
                        fp8.dtype or str(w.dtype))


def fp8_weight_mask(graphdef: Any, params: Any, rowwise: bool = False) -> Any:
    """Like `params` (a pure dict, any leaves): an Fp8Weight at each FP8 linear's kernel
    (gemjax.precision.policy.fp8_kernels), False elsewhere."""
    kernels = fp8_kernels(nnx.merge(graphdef, params))
    key = lambda k: getattr(k, "key", getattr(k, "idx", None))  # noqa: E731
    return jax.tree_util.tree_map_with_path(
        lambda path, _: (Fp8Weight(*kernels[p], rowwise) if (p := tuple(map(key, path))) in kernels
                         else False), params)


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


@dataclasses.dataclass(frozen=True)
class Shard:
    """What an objective reads inside the step's shard_map besides the model, the
    activations and the batch: step (int32 [], the state's step counter), ids (this
    shard's rows of the objective's `lookup_ids`, {feature: [N_local] int32}), axes (the
    manual mesh axes the batch is split over: `jax.lax.axis_index(axes)` is the shard's
    index)."""

    step: jax.Array
    ids: dict[str, jax.Array]
    axes: tuple[str, ...]


class Objective(Protocol):
    """What a step optimizes and what its eval step returns; the step passes it explicitly
    (`StepContext.objective`, `Trainer.objective`).

    metrics: the eval figures the objective's evaluator reports (the headline of eval rows).
    lookup_ids(ctx, step, train) -> {feature: [num_shards * N] int32} ids looked up beside
      the batch's own (sharded over the batch axes, N per device; {}: none). train False:
      the eval step's.
    loss_sums(model, acts, batch, shard) -> {"loss_sum": [K], "weight_sum": [K], ...}: sums
      over this shard (per device, inside shard_map); the step sums them over the mesh and
      trains on loss = sum(loss_sum) / max(sum(weight_sum), 1), so the loss is the
      global-batch mean whatever the mesh. Every entry is reported in the step's metrics.
    predict(model, acts, batch, shard) -> [B_local, ...]: the eval step's output per shard.

    model: the merged NNX model (full parameters); acts: the looked-up activations,
    lookup_ids' features included; batch: this shard's Batch.
    """

    metrics: tuple[str, ...]

    def lookup_ids(self, ctx: "StepContext", step: jax.Array, train: bool) -> dict[str, jax.Array]:
        ...

    def loss_sums(self, model, acts: dict, batch: Batch, shard: Shard) -> dict[str, jax.Array]:
        ...

    def predict(self, model, acts: dict, batch: Batch, shard: Shard) -> jax.Array:
        ...


@dataclasses.dataclass(frozen=True)
class BinaryTasks:
    """The ranking objective: logits [B, K] = model(acts, batch), per-task sums of
    `task_loss` (logits [B_local, K], batch) -> (loss_sum, weight_sum, positive_sum) [K]
    (default `masked_bce_sums`, the labels' log loss; a distilled student's
    gemjax.distill.losses.kd_objective reads the soft targets its batch carries).
    predict: sigmoid probabilities [B_local, K]."""

    task_loss: Callable = masked_bce_sums
    metrics: tuple[str, ...] = ("ne", "auc", "calibration")

    def lookup_ids(self, ctx, step, train):
        return {}

    def loss_sums(self, model, acts, batch, shard):
        loss_sum, w_sum, pos_sum = self.task_loss(model(acts, batch), batch)
        return {"loss_sum": loss_sum, "weight_sum": w_sum, "positive_sum": pos_sum}

    def predict(self, model, acts, batch, shard):
        return jax.nn.sigmoid(model(acts, batch))


@dataclasses.dataclass(frozen=True, eq=False)
class StepContext:
    """What the step functions read besides the state and the batch (`Trainer.context`).

    p_specs: PartitionSpecs like state["params"]; local_dims: like it, the dims each
    param keeps as its local shard inside the shard_map ((0,) for experts under EP);
    ep_axes: the expert-parallel mesh axes, or None; objective: the `Objective` trained
    and evaluated.
    """

    graphdef: Any
    mesh: Mesh
    tx: optax.GradientTransformation
    coll: EmbeddingCollection
    id_fields: dict[str, tuple[str, ...]]
    p_specs: Any
    local_dims: Any
    ep_axes: tuple[str, ...] | None
    objective: Objective = BinaryTasks()
    # like params: Fp8Weight at the kernels gathered as FP8 (None: every param gathered as is)
    fp8_weights: Any = None
    fp8_margin: int = 0      # model.precision.margin: the delayed scales' headroom

    @property
    def batch_axes(self) -> tuple[str, ...]:
        return tuple(self.mesh.axis_names)


def _gather_fp8_or_param(mesh: Mesh, x: jax.Array, spec: P, local_dims: Sequence[int], fp8: Any):
    plan = fp8_weight_plan(x, spec, local_dims, fp8, mesh)
    return gather_param(x, spec, local_dims) if plan is None else all_gather_fp8_weight(x, plan)


def local_forward(ctx: StepContext, method: str, params, acts, batch: Batch, ids, step,
                  fp8_meta=None):
    """Per device, inside shard_map: the objective's `method` ("loss_sums" or "predict") on
    the model with its full parameters (each gathered over its sharded axes; the kernels of
    ctx.fp8_weights as FP8 bits + scales); fp8_meta: this device's copy of the amax
    histories ({key: [1, 3, H]}, `stacked_meta`), bound to their delayed-scaling linears."""
    if ctx.fp8_weights is None:
        full = jax.tree.map(gather_param, params, ctx.p_specs, ctx.local_dims)
    else:
        full = jax.tree.map(functools.partial(_gather_fp8_or_param, ctx.mesh), params,
                            ctx.p_specs, ctx.local_dims, ctx.fp8_weights)
    # experts: EP over ctx.ep_axes; router aux over the global batch
    model = set_mesh_axes(nnx.merge(ctx.graphdef, full), expert_axes=ctx.ep_axes,
                          batch_axes=ctx.batch_axes)
    if fp8_meta:
        bind_histories(model, {k: h[0] for k, h in fp8_meta.items()}, ctx.batch_axes,
                       ctx.fp8_margin)
    return getattr(ctx.objective, method)(model, acts, batch, Shard(step, ids, ctx.batch_axes))


def _global_sums(ctx: StepContext, *args):
    sums = local_forward(ctx, "loss_sums", *args)
    return jax.tree.map(lambda s: jax.lax.psum(s, ctx.batch_axes), sums)


def _predictions(ctx: StepContext, *args):
    return local_forward(ctx, "predict", *args)


def _sharded(ctx: StepContext, fn: Callable, out_specs) -> Callable:
    """fn(ctx, params, acts, batch, ids, step[, fp8_meta]) as a shard_map over the mesh
    (fp8_meta: `stacked_meta`, one copy per device)."""
    axes = ctx.batch_axes
    return jax.shard_map(functools.partial(fn, ctx), mesh=ctx.mesh,
                         in_specs=(ctx.p_specs, P(axes), P(axes), P(axes), P(), P(axes)),
                         out_specs=out_specs, check_vma=CHECK_VMA)


def stacked_meta(ctx: StepContext, fp8_meta: dict | None) -> dict | None:
    """Each history [3, H] repeated per device: [devices, 3, H], one copy per batch shard,
    so the shard_map's transpose hands each device's next history back unsummed."""
    if not fp8_meta:
        return None
    n = ctx.mesh.size
    return {k: jnp.broadcast_to(h, (n,) + h.shape) for k, h in fp8_meta.items()}


def next_meta(fp8_meta: dict, g_meta: dict) -> dict:
    """The next amax histories from their cotangents [devices, 3, H] (equal over devices:
    the amaxes are maxed over the mesh); a history whose linear did not run this step
    (cotangent all zeros) is kept."""
    return {k: jnp.where(jnp.any(g_meta[k][0] != 0), g_meta[k][0], h) for k, h in fp8_meta.items()}


def _lookup(ctx: StepContext, state: dict, batch: Batch, train: bool):
    """(acts, residuals, ids) of the batch's ids and the objective's `lookup_ids`."""
    ids = ctx.objective.lookup_ids(ctx, state["step"], train)
    acts, residuals = ctx.coll.lookup(state["tables"], {**id_features(batch, ctx.id_fields), **ids})
    return acts, residuals, ids


def loss_fn(ctx: StepContext, params, acts, batch: Batch, ids: dict, step: jax.Array,
            fp8_meta=None):
    """(loss [], sums): the objective's loss_sums summed over the mesh and the loss, the
    global-batch mean sum(loss_sum) / max(sum(weight_sum), 1) (`Objective`).

    params: like state["params"] (sharded); acts: the looked-up activations
    (`EmbeddingCollection.lookup`); ids, step: the objective's lookup_ids and the
    state's step counter; fp8_meta: `stacked_meta` of the state's amax histories (its
    gradient is the next histories, `next_meta`).
    """
    sums = _sharded(ctx, _global_sums, P())(params, acts, batch, ids, step, fp8_meta)
    loss = jnp.sum(sums["loss_sum"]) / jnp.maximum(jnp.sum(sums["weight_sum"]), 1.0)
    return loss, sums


def updated_state(tx: optax.GradientTransformation, coll: EmbeddingCollection, state: dict,
                  residuals: dict, g_params, g_acts) -> dict:
    """The next train state: dense params through `tx`, the looked-up table rows through
    the collection's sparse optimizer (`residuals` of its lookup, `g_acts` their
    gradients), step + 1."""
    updates, opt_state = tx.update(g_params, state["opt_state"], state["params"])
    return {"step": state["step"] + 1,
            "params": optax.apply_updates(state["params"], updates),
            "opt_state": opt_state,
            "tables": coll.apply_gradients(state["tables"], residuals, g_acts)}


def train_step(ctx: StepContext, state: dict, batch: Batch) -> tuple[dict, dict]:
    """One optimizer step of ctx.objective: (new state, metrics).

    metrics: "loss" [], the objective's loss_sums summed over the mesh ("loss_sum",
    "weight_sum" [K], ...; BinaryTasks adds "positive_sum"), "grad_norm" [] (dense params)
    and the sparse lookup's counters ("ids_out_of_range", "ids_overflow").
    """
    acts, residuals, ids = _lookup(ctx, state, batch, train=True)
    meta = stacked_meta(ctx, state.get("fp8_meta"))
    grad_fn = jax.value_and_grad(functools.partial(loss_fn, ctx), has_aux=True,
                                 argnums=(0, 1) if meta is None else (0, 1, 5))
    (loss, sums), grads = grad_fn(state["params"], acts, batch, ids, state["step"], meta)
    g_params, g_acts = grads[:2]
    new_state = updated_state(ctx.tx, ctx.coll, state, residuals, g_params, g_acts)
    if meta is not None:
        new_state["fp8_meta"] = next_meta(state["fp8_meta"], grads[2])
    metrics = {"loss": loss, **sums, "grad_norm": optax.global_norm(g_params),
               **residuals["stats"]}
    return new_state, metrics


def eval_step(ctx: StepContext, state: dict, batch: Batch) -> jax.Array:
    """The objective's predict over the batch (no update): [B, ...] sharded like the
    batch (BinaryTasks: sigmoid probabilities [B, K])."""
    acts, _, ids = _lookup(ctx, state, batch, train=False)
    fwd = _sharded(ctx, _predictions, P(ctx.batch_axes))
    return fwd(state["params"], acts, batch, ids, state["step"],
               stacked_meta(ctx, state.get("fp8_meta")))


def process_rows(out: jax.Array) -> np.ndarray:
    """The rows of `out` (sharded over its first dim) held by this process's devices, in
    shard order, as numpy (each shard once, however often it is replicated)."""
    shards = sorted(out.addressable_shards, key=lambda s: s.index[0].start or 0)
    seen, rows = set(), []
    for s in shards:
        if (s.index[0].start or 0) not in seen:
            seen.add(s.index[0].start or 0)
            rows.append(np.asarray(s.data))
    return np.concatenate(rows)


@dataclasses.dataclass
class Trainer:
    """Builds and jits the steps: config, model graph, optimizers, mesh, shardings."""

    cfg: Config
    mesh: Mesh
    graphdef: Any
    tx: optax.GradientTransformation
    coll: EmbeddingCollection
    id_fields: dict[str, tuple[str, ...]]
    param_shardings: Any        # nested dict of NamedSharding, like state["params"]
    opt_shardings: Any          # like state["opt_state"]
    expert_parallel: bool = True  # EP when the rules shard the expert dim (module docstring)
    objective: Objective = BinaryTasks()  # StepContext.objective of the steps

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
        tx = optim.dense_transform(cfg)
        p_sh = rules_lib.param_shardings(abstract, mesh, rules).to_pure_dict()
        replicated = NamedSharding(mesh, P())
        o_abs = jax.eval_shape(tx.init, abstract.to_pure_dict())
        o_sh = optax.tree_utils.tree_map_params(tx, lambda _, s: s, o_abs, p_sh,
                                                transform_non_params=lambda _: replicated)
        xb = routing.DEFAULT_EXCHANGE_BUCKETS if cfg.sparse.exchange_buckets else ()
        coll = EmbeddingCollection(optim.table_specs(cfg), table_plan, mesh=mesh,
                                   replica_axes=tuple(table_replica_axes), exchange_buckets=xb,
                                   sync_buckets=cfg.sparse.sync_buckets,
                                   update_impl=cfg.train.sparse_update_impl,
                                   row_major=cfg.sparse.row_major,
                                   segment_sum=cfg.sparse.segment_sum,
                                   onehot_rows=cfg.sparse.onehot_rows,
                                   act_dtype=(cfg.model.dtype if cfg.sparse.act_dtype == "model"
                                              else None), **planner_kw)
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
        out = {"step": NamedSharding(self.mesh, P()), "params": self.param_shardings,
               "opt_state": self.opt_shardings, "tables": self.coll.state_sharding()}
        keys = self.fp8_meta_keys()
        if keys:
            out["fp8_meta"] = {k: NamedSharding(self.mesh, P()) for k in keys}
        return out

    def fp8_meta_keys(self) -> list[str]:
        """The keys of state["fp8_meta"]: the FP8 linears with delayed scaling (module
        docstring); [] when there are none (the state then has no "fp8_meta")."""
        m = self.cfg.model
        if m.precision.format != "fp8" or m.precision.scaling != "delayed":
            return []
        dummy = jax.tree.map(lambda s: 0.0, self.param_shardings)
        return delayed_linears(nnx.merge(self.graphdef, dummy))

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
        state = {"step": step, "params": params, "opt_state": opt_state,
                 "tables": self.coll.init(jax.random.fold_in(key, 1))}  # sharded per plan
        keys = self.fp8_meta_keys()
        if keys:                          # empty amax histories (gemjax.precision.delayed)
            zeros = np.zeros((3, self.cfg.model.precision.amax_history), np.float32)
            state["fp8_meta"] = {k: jax.make_array_from_callback(
                zeros.shape, NamedSharding(self.mesh, P()), lambda i: zeros[i]) for k in keys}
        return state

    def abstract_state(self) -> dict:
        """init_state's tree as jax.ShapeDtypeStructs (shape, dtype, sharding), nothing
        drawn or placed: a restore target (gemjax.train.checkpoint) or a lowering input."""
        model = nnx.eval_shape(lambda: build_model(self.cfg, nnx.Rngs(0)))
        params = nnx.split(model, nnx.Param)[1].to_pure_dict()
        shapes = {"step": jax.ShapeDtypeStruct((), jnp.int32), "params": params,
                  "opt_state": jax.eval_shape(self.tx.init, params),
                  "tables": jax.eval_shape(lambda: self.coll.init(jax.random.key(0)))}
        keys = self.fp8_meta_keys()
        if keys:
            shapes["fp8_meta"] = {k: jax.ShapeDtypeStruct(
                (3, self.cfg.model.precision.amax_history), jnp.float32) for k in keys}
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            shapes, self.state_shardings())

    def context(self) -> StepContext:
        """The StepContext of this trainer (expert parallelism per `expert_parallel`)."""
        p_specs = jax.tree.map(lambda s: s.spec, self.param_shardings)
        is_expert = expert_param_mask(self.graphdef, jax.tree.map(
            lambda _: 0.0, p_specs, is_leaf=lambda s: isinstance(s, P)))
        ep_axes = (expert_parallel_axes(self.mesh, p_specs, is_expert)
                   if self.expert_parallel else None)
        local_dims = jax.tree.map(lambda e: (0,) if e and ep_axes else (), is_expert)
        m = self.cfg.model
        fp8 = (fp8_weight_mask(self.graphdef, jax.tree.map(
            lambda _: 0.0, p_specs, is_leaf=lambda s: isinstance(s, P)), m.precision.gather == "always")
            if m.precision.format == "fp8" and m.precision.gather != "off" else None)
        return StepContext(self.graphdef, self.mesh, self.tx, self.coll, self.id_fields,
                           p_specs, local_dims, ep_axes, self.objective, fp8, m.precision.margin)

    def make_train_step(self) -> PlannedStep:
        """`train_step` as (state, batch[, next_batch]) -> (state, metrics), jitted; state
        donated, outputs placed like the input. See `PlannedStep` for next_batch."""
        shardings = (self.state_shardings(), NamedSharding(self.mesh, P()))
        return self._planned(functools.partial(train_step, self.context()), "train step",
                             donate_argnums=(0,), out_shardings=shardings)

    def _planned(self, step: Callable, name: str, **jit_kw) -> PlannedStep:
        """PlannedStep `name` of `step` (state, batch) -> ..., traced with each sparse branch
        plan fixed and jitted with jit_kw."""
        return planned_jit(self.coll, self.id_fields, step, name,
                           fixed=self.cfg.sparse.fixed_branches, **jit_kw)

    def make_eval_step(self) -> Callable:
        """`eval_step` as (state, batch) -> sigmoid probabilities [rows of this process's
        shards, K] (numpy).

        On one process that is the whole batch; with several, each process gets
        the rows of its own devices' shards, in the order it fed them (`process_rows`).
        The sparse branches are fixed per batch as in training (a PlannedStep: no
        host-synced conditional in the program).
        """
        planned = self._planned(functools.partial(eval_step, self.context()), "eval step")
        if jax.process_count() == 1:
            return planned
        return lambda state, batch: process_rows(planned(state, batch))
