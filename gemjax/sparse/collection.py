"""EmbeddingCollection: sharded lookups and fused sparse updates for every table.

    coll = EmbeddingCollection(specs, plan=None, mesh=None, replica_axes=(),
                               dedup="sort", grad_dtype=jnp.float32,
                               unique_buckets=routing.DEFAULT_BUCKETS,
                               exchange_buckets=())
    print(coll.describe())                       # the plan as a table
    state = coll.init(key)                       # {table: {"weights": [Vp, D], <opt state [Vp, ...]>}}
                                                 # (table_wise tables: one "@table_wise_<i>" stack)
    coll.check_ids(feats)                        # host-side strict bounds check
    acts, residuals = coll.lookup(state, feats)  # feats {feature: ids [...] or Jagged bag}
    ... g_acts = d loss / d acts ...
    state = coll.apply_gradients(state, residuals, g_acts)

The collection keeps the lookup / update API and delegates: plans and row layouts
to `gemjax.sparse.plans`; storage <-> logical row order to `gemjax.sparse.row_order`
(`coll.rows`: state arrays are padded to Vp = a multiple of the table's shard count
and sharded per the plan; under a "mod" split their row order is permuted and
table_wise tables sit inside a stack; `to_logical` / `from_logical` convert on the
host, `logical_arrays` / `from_logical_arrays` sharded, on device, for checkpoints
that restore onto any mesh); feature -> table and the host-side id checks to
`gemjax.sparse.ids`; switch-branch planning to `gemjax.sparse.branches`
(`coll.branches`); the routed exchange and row updates to `gemjax.sparse.routing`. On a
mesh, feats are global arrays sharded over `batch_axes` (default: every mesh
axis), each device holding its own samples (a Jagged bag: its own packed
buffer with local offsets); acts come back sharded the same way. Devices along
mesh axes outside batch_axes hold copies of a batch: they look up the same ids
and only the first copy's gradients are applied.

The tables never enter jax.grad: the loss is differentiated with respect to
the looked-up activations, and `apply_gradients` routes those to the owning
shards and updates only the touched rows (see `gemjax.sparse.routing`), so no
dense [vocab, dim] gradient or optimizer-state copy exists. Donate the state
to the jitted step so the updates happen in place.

residuals["stats"] (int32 scalars, summed over the mesh):
  ids_out_of_range  ids outside [0, vocab) that were clamped / hashed
  ids_overflow      ids dropped by the all_to_all capacity (zero embedding, no grad)
With mesh=None everything runs on one device (a 1-device mesh).

dedup: how duplicate ids are found and their gradients summed (see
`gemjax.sparse.routing`): "sort" (default: one stable sort in the lookup,
reused by the backward; sorted segment_sum), "sort_scatter" (the same sort
for the dedupe, unsorted scatter-add by the inverse in the backward) or "scatter"
(jnp.unique + unsorted scatter-add, the original path). Same results up to
float rounding of the sums.
grad_dtype: the widest dtype the per-id activation gradients are gathered and
exchanged in (float32 default; bfloat16 halves that traffic and rounds each
float32 per-id gradient once). For a table updated where its ids
were looked up (no exchange), gradients narrower than it (bfloat16
activations) stay as they are: the float32 duplicate sum widens them exactly,
so a bfloat16 model's per-id rows move at half the bytes with the same sums.
Duplicate sums and the optimizer math are float32.
unique_buckets: fractions of N, e.g. routing.DEFAULT_BUCKETS = (1/4, 3/8, 1/2);
the duplicate sum and the update run on the smallest bucket holding the unique
rows instead of all N ids (local tables) or all S_m * C received slots (the
owner of a sharded table): `routing.update_unique_bucketed`, one lax.switch
branch per bucket (default routing.DEFAULT_BUCKETS; () = off). The switch
returns the updated table through a `cond`; the update stays in place
(tests/test_train.py checks the step's jaxpr and compiled temp memory).
exchange_buckets: fractions of the all_to_all capacity C, e.g.
routing.DEFAULT_EXCHANGE_BUCKETS = (1/8, 1/4, 1/2), full C always last: per table
per step the exchange (ids and rows forward, grads and the replica all-gathers
backward) runs at the smallest capacity holding the largest per-destination
unique count over the mesh (a pmax, then one lax.switch branch per capacity;
the backward reuses the forward's branch). Same rows, updates and overflow as
() = off (tests/test_sparse_exchange_buckets.py); the traffic follows the
unique ids instead of C. Default () (the trainer turns it on with
sparse.exchange_buckets, on in the h200 preset).
sync_buckets (with unique_buckets): local copies kept in sync over replicas
(replicated, or 2d with a one-device model group) all-gather only the smallest
unique bucket of rows and their summed grads, sized by the largest unique count
over the replicas (`routing.sync_update_bucketed`), instead of all N per-id
slots; same updates (tests/test_sparse_sync_buckets.py). Default off (the
trainer turns it on with sparse.sync_buckets, on in the h200 preset).
Both switches hold collectives; `branch_needs` + `branch_plan` + `fixed_branches`
(gemjax.sparse.branches) fix their branches per batch before the step, which the
trainer does (gemjax.train.planned.PlannedStep;
tests/test_sparse_fixed_branches.py): see "Fixed branches" in routing.
row_major (default True): the activations a lookup returns and the gradients
apply_gradients reads are pinned to a row-major physical layout
(`jax.experimental.layout.with_layout_constraint`). Without it XLA:GPU's layout
assignment may make a whole sequence stack feature-major ([D, T] in memory) and
then transpose every per-id gradient before its row gather: an 11 ms transpose
and a 4 ms strided gather per step in the 2-GPU h200 program. A no-op on CPU.
update_impl: "xla" (default) or "pallas": the duplicate sum and row-wise Adagrad
fused in one Pallas kernel (kernels.sparse_update; tables whose optimizer
is not RowWiseAdagrad or whose dim is not a power of two >= 16 keep "xla").
fused_knobs: overrides of kernels.sparse_update.KNOBS for that kernel (e.g. short_programs).
segment_sum: the "xla" update's sorted duplicate sum (routing.sum_duplicates): "auto"
(the Pallas kernel kernels.segment_sum on GPU, XLA's segment_sum elsewhere), "xla", "pallas".
onehot_rows (int, default 0 = off; opt-in): a local table without pooling (one gradient
row per id) whose "xla" update's unique bucket holds K <= onehot_rows rows sums its
duplicates as a one-hot matmul over the gradient rows in their own order
(routing.onehot_sums) instead of the sorted segment sum's row gather; pooled tables
and the other update paths keep the sorted sum. Same sums up to float32 summation
order; NaN / Inf stay in their own segment (tests/test_sparse_onehot.py). Meant for
tables of a few dozen rows read by millions of ids; its GPU timing is pending.
act_dtype: the dtype of the unpooled activations (rows per id: sequence tokens, single
ids); None keeps the table dtype. A bfloat16 model passes bfloat16: its gradients then
come back in bfloat16, so the duplicate sum reads half the bytes (the float32 rows a
bfloat16 model casts down get gradients of bfloat16 precision stored in float32
anyway). Pooled bags stay float32 sums.
Tested in interpret mode on CPU and lowered for sm_90; on one H200 (below) the
lookup + update step takes 1.20 ms with it vs 1.93 ms with "xla" (48% vs 30% of
3.6 TB/s counting every id's row; 0.86 vs 1.59 ms with steps queued back to back).
Inside the h200 teacher's train step on one H200 it was slower (142.3 vs 133.3 ms
per step) before the kernel's glue lost its host-stepped while loop (a binary
search, ~0.45 ms per step); since then the two are even
(experiments/sweep_mesh.py --shapes=replica=1, side by side on two H200s: 128.2 ms
with "pallas", 128.9 with "xla"), so "xla", which runs everywhere, stays the default.
Measured on one H200 (1e8 x 128 table, Zipf 1.05, 1.3M ids, pooled bags,
benchmarks/bench_sparse.py), lookup + update step: dedup="sort" with
DEFAULT_BUCKETS 1.98 ms; sort_scatter 2.74 ms; scatter 2.80 ms; sort without
buckets 3.99 ms.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.layout import Layout, with_layout_constraint
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from gemjax.data.jagged import Jagged
from gemjax.sparse import ids as ids_lib
from gemjax.sparse import plans as plans_lib
from gemjax.sparse import routing
from gemjax.sparse.branches import BranchPlanner
from gemjax.sparse.optimizers import RowWiseAdagrad
from gemjax.sparse.row_order import RowOrder
from gemjax.sparse.specs import TableSpec
from kernels import sparse_update

Array = Any
STATS = ("ids_out_of_range", "ids_overflow")


class EmbeddingCollection:
    def __init__(self, specs: Sequence[TableSpec], plan: Any = None, mesh: Mesh | None = None,
                 *, replica_axes: Sequence[str] = (), batch_axes: Sequence[str] | None = None,
                 dedup: str = "sort", grad_dtype: Any = jnp.float32,
                 unique_buckets: Sequence[float] = routing.DEFAULT_BUCKETS, update_impl: str = "xla",
                 fused_knobs: Mapping[str, int] | None = None,
                 exchange_buckets: Sequence[float] = (), sync_buckets: bool = False,
                 row_major: bool = True, segment_sum: str = "auto", act_dtype: Any = None,
                 onehot_rows: int = 0, **planner_kw):
        if dedup not in routing.DEDUPS:
            raise ValueError(f"dedup must be one of {routing.DEDUPS}, got {dedup!r}")
        if jnp.dtype(grad_dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
            raise ValueError(f"grad_dtype must be float32 or bfloat16, got {grad_dtype}")
        self.dedup = dedup
        self.grad_dtype = jnp.dtype(grad_dtype)
        routing.bucket_sizes(1, unique_buckets)          # validates
        self.unique_buckets = tuple(unique_buckets)
        routing.exchange_caps(1, exchange_buckets)       # validates
        self.exchange_buckets = tuple(exchange_buckets)
        if sync_buckets and not self.unique_buckets:
            raise ValueError("sync_buckets sizes the replica all-gather by unique_buckets; "
                             "it needs unique_buckets (e.g. routing.DEFAULT_BUCKETS), got ()")
        self.sync_buckets = bool(sync_buckets)
        if update_impl not in routing.UPDATE_IMPLS:
            raise ValueError(f"update_impl must be one of {routing.UPDATE_IMPLS}, got {update_impl!r}")
        self.update_impl = update_impl
        unknown = set(fused_knobs or {}) - set(sparse_update.KNOBS)
        if unknown:
            raise ValueError(f"fused_knobs: unknown knobs {sorted(unknown)} "
                             f"(have {sorted(sparse_update.KNOBS)})")
        self.fused_knobs = tuple(sorted((fused_knobs or {}).items()))
        self.row_major = bool(row_major)
        if segment_sum not in routing.SEGMENT_SUMS:
            raise ValueError(f"segment_sum must be one of {routing.SEGMENT_SUMS}, got {segment_sum!r}")
        self.segment_sum = segment_sum
        self.onehot_rows = routing.check_onehot_rows(onehot_rows)
        self.act_dtype = None
        if act_dtype is not None:
            bad = ValueError(f"act_dtype must be a float dtype or None, got {act_dtype!r}")
            try:
                self.act_dtype = jnp.dtype(act_dtype)
            except TypeError as e:
                raise bad from e
            if not jnp.issubdtype(self.act_dtype, jnp.floating):
                raise bad
        self.table_of = ids_lib.feature_tables(specs)
        self.specs = {s.name: s for s in specs}
        if mesh is None:
            mesh = Mesh(np.array(jax.devices()[:1]), ("batch",))
        self.mesh = mesh
        self.batch_axes = tuple(mesh.axis_names if batch_axes is None else batch_axes)
        self.plans = plans_lib.resolve(plan, specs, mesh, replica_axes, **planner_kw)
        self.plan = self.plans
        # storage units: a table, or a stack of table_wise tables ("@table_wise_<i>")
        self.rows = RowOrder(specs, self.plans, mesh)
        self.units, self.layouts, self.unit_of = self.rows.units, self.rows.layouts, self.rows.unit_of
        self.branches = BranchPlanner(self.specs, self.plans, self.layouts, mesh, self.batch_axes,
                                      self.exchange_buckets, self.unique_buckets, self.sync_buckets)

    # ---------------------------------------------------------------- plan / state
    def describe(self) -> str:
        """The plan as a text table (bytes per device per table)."""
        return plans_lib.format_plan(list(self.specs.values()), self.plans, self.mesh)

    def state_sharding(self, mesh: Mesh | None = None) -> dict[str, dict[str, NamedSharding]]:
        """NamedShardings of the state pytree (e.g. orbax restore targets)."""
        return self.rows.state_sharding(mesh)

    def init(self, key: Array) -> dict[str, dict[str, Array]]:
        """Rows ~ U(-scale, scale) in storage order; optimizer state from the optimizer."""
        shardings = self.state_sharding()

        def make():
            state = {}
            for i, (u, ts) in enumerate(self.units.items()):
                s = self.specs[ts[0]]
                vp = self.layouts[ts[0]].padded_vocab
                w = jax.random.uniform(jax.random.fold_in(key, i), (vp, s.dim), jnp.float32,
                                       -s.scale, s.scale).astype(s.dtype)
                state[u] = {"weights": w, **s.optimizer.init_state(vp, s.dim)}
            return state
        return jax.jit(make, out_shardings=shardings)()

    # ------------------------------- row order (gemjax.sparse.row_order: storage <-> logical)
    def to_logical(self, state) -> dict[str, dict[str, np.ndarray]]:
        """Host copy of the state in logical row order, [V, ...] per array (`RowOrder`)."""
        return self.rows.to_logical(state)

    def from_logical(self, logical) -> dict[str, dict[str, Array]]:
        """Inverse of to_logical: {table: {name: [V, ...]}} -> sharded state (`RowOrder`)."""
        return self.rows.from_logical(logical)

    def logical_rows(self, name: str) -> int:
        """Leading dim L >= V of table `name`'s logical arrays on this mesh (`RowOrder`)."""
        return self.rows.logical_rows(name)

    def logical_sharding(self) -> dict[str, dict[str, NamedSharding]]:
        """NamedShardings of `logical_arrays` (`RowOrder`)."""
        return self.rows.logical_sharding()

    def logical_targets(self) -> dict[str, dict[str, jax.ShapeDtypeStruct]]:
        """Shapes, dtypes and shardings of `logical_arrays` (orbax restore targets)."""
        return self.rows.logical_targets()

    def logical_arrays(self, state) -> dict[str, dict[str, Array]]:
        """state (storage order) -> {table: {name: [L, ...]}} in logical row order, sharded,
        one jitted permutation and no host copy (`RowOrder.logical_arrays`)."""
        return self.rows.logical_arrays(state)

    def from_logical_arrays(self, logical) -> dict[str, dict[str, Array]]:
        """Inverse of `logical_arrays`, also from another mesh's logical arrays
        (`RowOrder.from_logical_arrays`)."""
        return self.rows.from_logical_arrays(logical)


    # ------------------------------------------- ids (gemjax.sparse.ids) and routing sizes
    def check_ids(self, feats: Mapping[str, Any]) -> None:
        """Host-side strict bounds check; raises ValueError naming the feature (`ids.check_ids`)."""
        ids_lib.check_ids(feats, self.table_of, self._n_batch_devices())

    def _n_batch_devices(self) -> int:
        return int(np.prod([self.mesh.shape[a] for a in self.batch_axes]))

    def _groups(self, feats: Mapping[str, Any]) -> dict[str, list[str]]:
        """table -> its features present in feats (sorted, so the order is static)."""
        return ids_lib.group_features(feats, self.table_of)

    def _axes(self, name: str):
        return plans_lib.table_axes(self.plans[name], self.mesh)

    def _capacities(self, feats, groups) -> dict[str, int]:
        n_dev = self._n_batch_devices()
        caps = {}
        for name, fs in groups.items():
            n = sum(ids_lib.id_slots(feats[f]) // n_dev for f in fs)
            caps[name] = plans_lib.capacity(n, self.layouts[name], self.plans[name])
        return caps

    def _state_specs(self, units):
        return {u: {k: P(self.plans[self.units[u][0]].storage_axes or None)
                    for k in ["weights", *self.specs[self.units[u][0]].optimizer.init_state(1, 1)]}
                for u in units}

    def _units_of(self, names):
        return list(dict.fromkeys(self.unit_of[n] for n in names))

    # ------------------------------ fixed bucket branches (gemjax.sparse.branches)
    def _switched(self, name: str) -> tuple[bool, bool]:
        return self.branches.switched(name)

    def has_switches(self) -> bool:
        """Whether any table's step holds a switch with collectives (see `branch_plan`)."""
        return self.branches.has_switches()

    def branch_needs(self, feats: Mapping[str, Any]) -> dict[str, Array]:
        """Dispatch what each switched table's bucket branches need for feats
        ({table: [2] int32}, replicated; `BranchPlanner.needs`)."""
        return self.branches.needs(self._groups(feats), feats)

    def branch_plan(self, feats: Mapping[str, Any], needs: Mapping[str, Any]) -> tuple:
        """The bucket branches for feats from `branch_needs` (host values): a hashable
        ((table, exchange index or -1, sync index or -1), ...) for `fixed_branches`."""
        groups = self._groups(feats)
        return self.branches.plan(groups, self._capacities(feats, groups), feats, needs)

    def fixed_branches(self, plan: tuple):
        """Context: trace lookup / apply_gradients with the bucket branches of `plan`
        fixed (`BranchPlanner.fixed_branches`)."""
        return self.branches.fixed_branches(plan)

    # ---------------------------------------------------------------- lookup
    def lookup(self, state, feats: Mapping[str, Any]):
        """feats {feature: ids [...] int or Jagged bag} -> (acts, residuals).

        acts[f]: [*ids.shape, D] (act_dtype, else the table dtype) for unpooled
        features, [B, D] for pooled bags (float32 sum / mean over the bag; empty bags
        give zeros).
        residuals: routing indices per table, bag layouts, and "stats".
        """
        groups = self._groups(feats)
        caps = self._capacities(feats, groups)
        bspec = P(self.batch_axes)

        def body(state, feats):
            acts, res, stats = {}, {}, {k: jnp.zeros((), jnp.int32) for k in STATS}
            for name, fs in groups.items():
                spec, lay = self.specs[name], self.layouts[name]
                ids, valid, sizes, bad = ids_lib.table_ids(spec, fs, feats)
                stats["ids_out_of_range"] += bad
                model, fs_axes, sync = self._axes(name)
                xb, sb = self.branches.fixed(name)
                weights = state[self.unit_of[name]]["weights"]
                rows, res[name], over = routing.lookup_rows(
                    weights, ids, valid, lay, caps[name], model, fs_axes,
                    dedup=self.dedup, exchange_buckets=self.exchange_buckets,
                    group_axes=tuple(self.mesh.axis_names), branch=xb if xb >= 0 else None)
                stats["ids_overflow"] += over
                if sb >= 0:   # unique rows past the fixed sync bucket would not be applied
                    u = jnp.sum(res[name]["uniq"] != routing.INVALID, dtype=jnp.int32)
                    top = routing.bucket_sizes(ids.shape[0], self.unique_buckets,
                                               rows=weights.shape[0])[sb]
                    stats["ids_overflow"] += jnp.maximum(u - top, 0)
                start = 0
                for f, size in zip(fs, sizes):
                    r = rows[start:start + size]
                    start += size
                    ids_f = feats[f]
                    if isinstance(ids_f, Jagged):
                        acts[f] = _pool(r, ids_f, spec.pooling)
                    else:
                        acts[f] = r.reshape(ids_f.shape + (spec.dim,))
                        if self.act_dtype is not None:
                            acts[f] = acts[f].astype(self.act_dtype)
                    if self.row_major:
                        acts[f] = _row_major(acts[f])
            return acts, res, {k: v[None] for k, v in stats.items()}

        names = list(groups)
        acts, res, stats = jax.shard_map(
            body, mesh=self.mesh, in_specs=(self._state_specs(self._units_of(names)), bspec),
            out_specs=(bspec, bspec, bspec), check_vma=False,
        )({u: state[u] for u in self._units_of(names)}, dict(feats))
        stats = {k: jnp.sum(v) for k, v in stats.items()}
        return acts, {"ids": dict(feats), "route": res, "stats": stats}

    # ---------------------------------------------------------------- update
    def _update_impl(self, spec) -> str:
        """The collection's update_impl for this table, or "xla" where the fused kernel does
        not apply (an optimizer other than row-wise Adagrad, a dim not a power of two >= 16)."""
        if self.update_impl == "pallas" and (
                not isinstance(spec.optimizer, RowWiseAdagrad) or spec.dim < 16
                or spec.dim & (spec.dim - 1)):
            return "xla"
        return self.update_impl

    def apply_gradients(self, state, residuals, g_acts):
        """Route g_acts to the owning shards, update touched rows; returns the new state.

        g_acts {feature: same shape as acts[feature]}; features missing from g_acts
        count as zero gradient. Tables with no feature in g_acts are unchanged.
        """
        feats = residuals["ids"]
        groups = {n: fs for n, fs in self._groups(feats).items() if any(f in g_acts for f in fs)}
        names = list(groups)
        if not names:
            return state
        n_dev = self._n_batch_devices()
        caps = {n: residuals["route"][n]["recv"].shape[0] // n_dev // self.layouts[n].num_model
                for n in names}
        bspec = P(self.batch_axes)
        copies = tuple(a for a in self.mesh.axis_names if a not in self.batch_axes)

        def body(state, route, feats, g_acts):
            new = {}
            for name in names:
                spec = self.specs[name]
                # one source row per pooled bag / per unpooled id, a zero row last;
                # src_index [N] says which row each id's gradient is (no [N, D] copy)
                srcs, index, off = [], [], 0
                for f in groups[name]:
                    ids = feats[f]
                    if f not in g_acts:
                        n_f = ids.capacity if isinstance(ids, Jagged) else int(np.prod(ids.shape))
                        index.append(jnp.full((n_f,), -1, jnp.int32))
                        continue
                    g_f = _row_major(g_acts[f]) if self.row_major else g_acts[f]
                    if isinstance(ids, Jagged):
                        src, idx = _unpool_source(ids, g_f.astype(jnp.float32), spec.pooling)
                    else:   # rows as they are: the f32 duplicate sum widens them exactly
                        src = g_f.reshape(-1, spec.dim)
                        idx = jnp.arange(src.shape[0], dtype=jnp.int32)
                    srcs.append(src)
                    index.append(jnp.where(idx >= 0, idx + off, -1))
                    off += src.shape[0]
                model, fs_axes, sync = self._axes(name)
                lay = self.layouts[name]
                unit = self.unit_of[name]
                owned = lay.num_model == 1 and lay.num_fs == 1    # every row on this device
                local = owned and not sync
                # exchanged rows travel in grad_dtype; rows a device sums itself (a local or
                # a replicated table, whose replicas share the float32 sums) stay as narrow
                # as they came: the float32 duplicate sum widens them exactly
                dt = jnp.result_type(*srcs) if owned else self.grad_dtype
                if dt.itemsize > self.grad_dtype.itemsize:
                    dt = self.grad_dtype
                parts = [s.astype(dt) for s in srcs] + [jnp.zeros((1, spec.dim), dt)]
                src_index = jnp.concatenate(index)
                src_index = jnp.where(src_index >= 0, src_index, off)
                if copies:   # devices holding a copy of another's batch add nothing
                    parts = [jnp.where(jax.lax.axis_index(copies) == 0, x, 0) for x in parts]
                impl = self._update_impl(spec)
                # one-hot duplicate sums need one source row per id: unpooled tables only
                # (a pooled bag's row is read by all of its ids)
                onehot = self.onehot_rows if spec.pooling is None else 0
                # rows this device sums itself go to routing.sum_duplicates as they are (its
                # sorted segment sum reads each row from its own array); exchanged rows and
                # the fused update take one array
                g = tuple(parts) if owned and impl == "xla" else jnp.concatenate(parts)
                if local and (self.unique_buckets or impl == "pallas"):
                    new[unit] = routing.update_unique_bucketed(
                        new.get(unit, state[unit]), g, route[name], spec.optimizer,
                        self.unique_buckets, src_index=src_index, update_impl=impl,
                        fused_knobs=self.fused_knobs, segment_sum=self.segment_sum,
                        onehot_rows=onehot)
                    continue
                if self.sync_buckets and sync and lay.num_model == 1 and lay.num_fs == 1:
                    # a local copy synced over replicas: they all-gather unique rows only
                    sb = self.branches.fixed(name)[1]
                    new[unit] = routing.sync_update_bucketed(
                        new.get(unit, state[unit]), g, route[name], sync, spec.optimizer,
                        src_index=src_index, branch=sb if sb >= 0 else None, dedup=self.dedup,
                        buckets=self.unique_buckets, update_impl=impl,
                        fused_knobs=self.fused_knobs, segment_sum=self.segment_sum)
                    continue
                if "xb" in route[name]:     # exchange at the lookup's bucket capacity
                    xb = self.branches.fixed(name)[0]
                    new[unit] = routing.route_update_bucketed(
                        new.get(unit, state[unit]), g, route[name], lay, caps[name], model, fs_axes,
                        sync, self.exchange_buckets, spec.optimizer, src_index=src_index,
                        branch=xb if xb >= 0 else None, dedup=self.dedup,
                        buckets=self.unique_buckets, update_impl=impl, fused_knobs=self.fused_knobs,
                        segment_sum=self.segment_sum)
                    continue
                rows, grads = routing.route_grads(g, route[name], self.layouts[name], caps[name],
                                                  model, fs_axes, sync, src_index=src_index,
                                                  segment_sum=self.segment_sum)
                new[unit] = routing.update_rows(new.get(unit, state[unit]), rows, grads,
                                                spec.optimizer, rows_unique=local, dedup=self.dedup,
                                                buckets=self.unique_buckets, update_impl=impl,
                                                fused_knobs=self.fused_knobs,
                                                segment_sum=self.segment_sum)
            return new

        units = self._units_of(names)
        sspecs = self._state_specs(units)
        used = [f for n in names for f in groups[n]]
        new = jax.shard_map(
            body, mesh=self.mesh, in_specs=(sspecs, bspec, bspec, bspec), out_specs=sspecs,
            check_vma=False,
        )({u: state[u] for u in units}, {n: residuals["route"][n] for n in names},
          {f: feats[f] for f in used}, {f: g_acts[f] for f in used if f in g_acts})
        return {**state, **new}


def _row_major(x: Array) -> Array:
    """x with its physical layout pinned to row-major (last dim minor); same values."""
    return with_layout_constraint(x, Layout(tuple(range(x.ndim))))


def _pool(rows: Array, bag: Jagged, pooling: str) -> Array:
    """rows [T, D] per token -> [B, D] float32 sum / mean (padding tokens ignored)."""
    b = bag.num_samples
    rows = jnp.where(bag.mask[:, None], rows.astype(jnp.float32), 0)
    # segment ids of a packed bag are non-decreasing (padding carries the sentinel B)
    summed = jax.ops.segment_sum(rows, bag.segment_ids, num_segments=b + 1,
                                 indices_are_sorted=True)[:b]
    if pooling == "mean":
        summed = summed / jnp.maximum(bag.lengths, 1)[:, None].astype(summed.dtype)
    return summed


def _unpool_source(bag: Jagged, g: Array, pooling: str) -> tuple[Array, Array]:
    """Pooled grads [B, D] -> (source [B, D], index [T] int32): token t's grad is
    source[index[t]], index -1 on padding tokens (mean pooling divides by the length)."""
    b = bag.num_samples
    if pooling == "mean":
        g = g / jnp.maximum(bag.lengths, 1)[:, None].astype(g.dtype)
    return g, jnp.where(bag.segment_ids < b, bag.segment_ids, -1).astype(jnp.int32)
