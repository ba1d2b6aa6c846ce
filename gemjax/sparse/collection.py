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

State arrays are padded to Vp = a multiple of the table's shard count and
sharded per the plan (`gemjax.sparse.plans`); under a "mod" split their row
order is permuted and table_wise tables sit inside a stack (`to_logical` /
`from_logical` convert on the host; `logical_arrays` / `from_logical_arrays`
convert sharded, on device, for checkpoints that restore onto any mesh). On a
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
grad_dtype: dtype the per-id activation gradients are gathered and exchanged
in (float32 default; bfloat16 halves that traffic and rounds each per-id
gradient once); duplicate sums and the optimizer math stay float32.
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
train.sparse_exchange_buckets, on in the h200 preset).
sync_buckets (with unique_buckets): local copies kept in sync over replicas
(replicated, or 2d with a one-device model group) all-gather only the smallest
unique bucket of rows and their summed grads, sized by the largest unique count
over the replicas (`routing.sync_update_bucketed`), instead of all N per-id
slots; same updates (tests/test_sparse_sync_buckets.py). Default off (the
trainer turns it on with train.sparse_sync_buckets, on in the h200 preset).
Both switches hold collectives; `branch_needs` + `branch_plan` + `fixed_branches`
fix their branches per batch before the step, which the trainer does (PlannedStep;
tests/test_sparse_fixed_branches.py): see "Fixed branches" in routing.
row_major (default True): the activations a lookup returns and the gradients
apply_gradients reads are pinned to a row-major physical layout
(`jax.experimental.layout.with_layout_constraint`). Without it XLA:GPU's layout
assignment may make a whole sequence stack feature-major ([D, T] in memory) and
then transpose every per-id gradient before its row gather: an 11 ms transpose
and a 4 ms strided gather per step in the 2-GPU h200 program. A no-op on CPU.
update_impl: "xla" (default) or "pallas": the duplicate sum and row-wise Adagrad
fused in one Pallas kernel (gemjax.sparse.fused_update; tables whose optimizer
is not RowWiseAdagrad or whose dim is not a power of two >= 16 keep "xla").
fused_knobs: overrides of fused_update.KNOBS for that kernel (e.g. short_programs).
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

import contextlib
import warnings
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.layout import Layout, with_layout_constraint
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from gemjax.data.jagged import Jagged
from gemjax.sparse import fused_update
from gemjax.sparse import plans as plans_lib
from gemjax.sparse import routing
from gemjax.sparse.optimizers import RowWiseAdagrad
from gemjax.sparse.specs import TableSpec

Array = Any
STATS = ("ids_out_of_range", "ids_overflow")


class EmbeddingCollection:
    def __init__(self, specs: Sequence[TableSpec], plan: Any = None, mesh: Mesh | None = None,
                 *, replica_axes: Sequence[str] = (), batch_axes: Sequence[str] | None = None,
                 dedup: str = "sort", grad_dtype: Any = jnp.float32,
                 unique_buckets: Sequence[float] = routing.DEFAULT_BUCKETS, update_impl: str = "xla",
                 fused_knobs: Mapping[str, int] | None = None,
                 exchange_buckets: Sequence[float] = (), sync_buckets: bool = False,
                 row_major: bool = True, **planner_kw):
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
        unknown = set(fused_knobs or {}) - set(fused_update.KNOBS)
        if unknown:
            raise ValueError(f"fused_knobs: unknown knobs {sorted(unknown)} "
                             f"(have {sorted(fused_update.KNOBS)})")
        self.fused_knobs = tuple(sorted((fused_knobs or {}).items()))
        self.row_major = bool(row_major)
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate table names in {names}")
        self.specs = {s.name: s for s in specs}
        self.table_of: dict[str, TableSpec] = {}
        for s in specs:
            for f in s.features:
                if f in self.table_of:
                    raise ValueError(f"feature {f!r} is served by both {self.table_of[f].name!r} and {s.name!r}")
                self.table_of[f] = s
        if mesh is None:
            mesh = Mesh(np.array(jax.devices()[:1]), ("batch",))
        self.mesh = mesh
        self.batch_axes = tuple(mesh.axis_names if batch_axes is None else batch_axes)
        self.plans = plans_lib.resolve(plan, specs, mesh, replica_axes, **planner_kw)
        self.plan = self.plans
        # storage units: a table, or a stack of table_wise tables ("@table_wise_<i>")
        self.units, self.layouts = plans_lib.stacks(specs, self.plans, mesh)
        self.unit_of = {t: u for u, ts in self.units.items() for t in ts}
        self._jitted: dict[Any, Any] = {}   # logical <-> storage permutations, branch needs
        self._fixed: dict[str, tuple[int, int]] = {}   # see fixed_branches

    # ---------------------------------------------------------------- plan / state
    def describe(self) -> str:
        """The plan as a text table (bytes per device per table)."""
        return plans_lib.format_plan(list(self.specs.values()), self.plans, self.mesh)

    def state_sharding(self, mesh: Mesh | None = None) -> dict[str, dict[str, NamedSharding]]:
        """NamedShardings of the state pytree (e.g. orbax restore targets)."""
        mesh = mesh or self.mesh
        out = {}
        for u, ts in self.units.items():
            s = self.specs[ts[0]]
            sh = NamedSharding(mesh, P(self.plans[ts[0]].storage_axes or None))
            out[u] = {"weights": sh, **{k: sh for k in s.optimizer.init_state(1, s.dim)}}
        return out

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

    def to_logical(self, state) -> dict[str, dict[str, np.ndarray]]:
        """Host copy of the state in logical row order, padding removed: [V, ...] per array.

        Gathers every table onto the host: for tests and small tables. Checkpoints use
        `logical_arrays` (sharded, on device).
        """
        out = {}
        for n, s in self.specs.items():
            idx = self.layouts[n].storage_index(np.arange(s.vocab))
            out[n] = {k: np.asarray(v)[idx] for k, v in state[self.unit_of[n]].items()}
        return out

    def from_logical(self, logical) -> dict[str, dict[str, Array]]:
        """Inverse of to_logical: {table: {name: [V, ...]}} -> sharded state (padding zero).

        Arrays are cast to the table / optimizer-state dtypes.
        """
        shardings, out = self.state_sharding(), {}
        for u, ts in self.units.items():
            full = {}
            for n in ts:
                s, lay = self.specs[n], self.layouts[n]
                dtypes = {"weights": np.dtype(s.dtype),
                          **{k: np.dtype(a.dtype) for k, a in s.optimizer.init_state(1, s.dim).items()}}
                idx = lay.storage_index(np.arange(s.vocab))
                for k, v in logical[n].items():
                    v = np.asarray(v).astype(dtypes[k])
                    if v.shape[0] != s.vocab:
                        raise ValueError(f"table {n!r} array {k!r}: leading dim {v.shape[0]} != vocab {s.vocab}")
                    if k not in full:
                        full[k] = np.zeros((lay.padded_vocab,) + v.shape[1:], v.dtype)
                    full[k][idx] = v
            out[u] = {k: jax.device_put(v, shardings[u][k]) for k, v in full.items()}
        return out

    # ------------------------------------------- logical order on device (checkpoints)
    def logical_rows(self, name: str) -> int:
        """Leading dim L >= V of table `name`'s logical arrays on this mesh: the padded
        vocab (a multiple of its shard count), or for a table_wise table V rounded up to a
        multiple of the devices of its model axes."""
        lay, p = self.layouts[name], self.plans[name]
        if lay.fixed_shard >= 0:
            n = plans_lib._axes_size(self.mesh, p.model_axes)
            return -(-lay.vocab // n) * n
        return lay.padded_vocab

    def logical_sharding(self) -> dict[str, dict[str, NamedSharding]]:
        """NamedShardings of `logical_arrays`: rows split like the table's storage
        (table_wise tables: over their model axes)."""
        out = {}
        for n, s in self.specs.items():
            p = self.plans[n]
            axes = p.model_axes if p.kind == "table_wise" else p.storage_axes
            sh = NamedSharding(self.mesh, P(axes or None))
            out[n] = {k: sh for k in ["weights", *s.optimizer.init_state(1, s.dim)]}
        return out

    def logical_targets(self) -> dict[str, dict[str, jax.ShapeDtypeStruct]]:
        """Shapes, dtypes and shardings of `logical_arrays` (orbax restore targets)."""
        shardings, out = self.logical_sharding(), {}
        for n, s in self.specs.items():
            rows = self.logical_rows(n)
            arrays = {"weights": jax.ShapeDtypeStruct((1, s.dim), s.dtype),
                      **s.optimizer.init_state(1, s.dim)}
            out[n] = {k: jax.ShapeDtypeStruct((rows,) + tuple(a.shape[1:]), a.dtype,
                                              sharding=shardings[n][k]) for k, a in arrays.items()}
        return out

    def _permuted(self, name: str) -> bool:
        """Whether table `name`'s storage order differs from its logical order."""
        lay = self.layouts[name]
        return lay.fixed_shard >= 0 or (lay.split == "mod" and lay.num_shards > 1)

    def logical_arrays(self, state) -> dict[str, dict[str, Array]]:
        """state (storage order) -> {table: {name: [L, ...]}} in logical row order, sharded.

        Row i < V is logical row i; L = `logical_rows(table)`, a function of the mesh.
        Rows V..L-1 are zero, except for tables stored in logical order already
        ("range" splits, replicated or one-shard tables), which are passed through
        uncopied (padding rows as stored). The others go through one jitted permutation,
        never a host copy: a "mod" split is the row-block transpose [S, Vp/S] ->
        [Vp/S, S] as one all_to_all (`_mod_permute`: about 2 shards of exchange buffers
        per device besides the input and output shards), table_wise tables a slice of
        their stack. The input is not donated.
        """
        moved = tuple(n for n in self.specs if self._permuted(n))
        out = {n: dict(state[self.unit_of[n]]) for n in self.specs if n not in moved}
        if moved:
            key = ("to_logical", moved)
            if key not in self._jitted:
                sh = self.logical_sharding()

                def convert(state):
                    return {n: {k: _storage_to_logical(a, self.layouts[n], self.logical_rows(n),
                                                       self.mesh, self.plans[n].storage_axes)
                                for k, a in state[self.unit_of[n]].items()} for n in moved}
                self._jitted[key] = jax.jit(convert, out_shardings={n: sh[n] for n in moved})
            out.update(self._jitted[key]({self.unit_of[n]: state[self.unit_of[n]] for n in moved}))
        return out

    def from_logical_arrays(self, logical) -> dict[str, dict[str, Array]]:
        """Inverse of `logical_arrays`, also from another mesh's logical arrays.

        logical {table: {name: [L', ...]}}, L' >= V any length (rows past V are
        ignored), any sharding over this mesh's devices: restore them from a checkpoint
        with `logical_targets()` (orbax pads or truncates the rows). Returns the state
        in this collection's storage order, dtypes and `state_sharding()`. Arrays of
        tables already in logical order with L' = Vp and their storage sharding are
        used as they are (padding rows as given); the rest go through one jitted
        permutation (padding rows zero) and are donated.
        """
        shardings = self.state_sharding()
        dtypes = {}
        for n, s in self.specs.items():
            dtypes[n] = {"weights": jnp.dtype(s.dtype),
                         **{k: a.dtype for k, a in s.optimizer.init_state(1, s.dim).items()}}
            if n not in logical or set(logical[n]) != set(dtypes[n]):
                raise ValueError(f"logical state of table {n!r}: expected arrays "
                                 f"{sorted(dtypes[n])}, got {sorted(logical.get(n, {}))}")
            for k, a in logical[n].items():
                if a.shape[0] < s.vocab:
                    raise ValueError(f"logical state of table {n!r} array {k!r}: {a.shape[0]} rows "
                                     f"< vocab {s.vocab}")
        out, moved = {}, []
        for u, ts in self.units.items():
            n = ts[0]
            arrays = logical[n]
            if not self._permuted(n) and all(
                    a.shape[0] == self.layouts[n].padded_vocab and a.dtype == dtypes[n][k]
                    and getattr(a, "sharding", None) is not None
                    and a.sharding.is_equivalent_to(shardings[u][k], a.ndim)
                    for k, a in arrays.items()):
                out[u] = dict(arrays)
            else:
                moved.append(u)
        if moved:
            key = ("from_logical", tuple(moved))
            if key not in self._jitted:
                def convert(logical):
                    res = {}
                    for u in moved:
                        ts = self.units[u]
                        lays = [self.layouts[t] for t in ts]
                        res[u] = {k: _logical_to_storage([logical[t][k] for t in ts], lays, self.mesh,
                                                         self.plans[ts[0]].storage_axes)
                                  .astype(dtypes[ts[0]][k]) for k in logical[ts[0]]}
                    return res
                self._jitted[key] = jax.jit(convert, out_shardings={u: shardings[u] for u in moved},
                                            donate_argnums=0)
            with warnings.catch_warnings():   # donation is best effort: shapes may differ
                warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
                out.update(self._jitted[key]({t: dict(logical[t]) for u in moved
                                              for t in self.units[u]}))
        return {u: out[u] for u in self.units}

    # ---------------------------------------------------------------- checks
    def check_ids(self, feats: Mapping[str, Any]) -> None:
        """Host-side strict bounds check; raises ValueError naming the feature."""
        for f, ids in feats.items():
            spec = self._spec(f)
            if spec.bounds != "strict":
                continue
            if isinstance(ids, Jagged):   # per device shard: tokens before its offsets[-1]
                n_dev = int(np.prod([self.mesh.shape[x] for x in self.batch_axes]))
                ends = np.asarray(ids.offsets).reshape(n_dev, -1)[:, -1:]
                t = np.arange(ids.capacity // n_dev)[None, :]
                a = np.asarray(ids.values).reshape(n_dev, -1)[t < ends]
            else:
                a = np.asarray(ids)
            if a.size and (a.min() < 0 or a.max() >= spec.vocab):
                bad = a[(a < 0) | (a >= spec.vocab)]
                raise ValueError(
                    f"feature {f!r}: {bad.size} ids outside [0, {spec.vocab}) of table {spec.name!r} "
                    f"(e.g. {bad[:3].tolist()}); fix the input or set bounds='clamp' or 'hash' on the table")

    def _spec(self, feature: str) -> TableSpec:
        if feature not in self.table_of:
            raise KeyError(f"feature {feature!r} is served by no table; known: {sorted(self.table_of)}")
        return self.table_of[feature]

    def _check_feature(self, f: str, ids: Any) -> None:
        spec = self._spec(f)
        if spec.pooling is None and isinstance(ids, Jagged):
            raise TypeError(f"feature {f!r}: table {spec.name!r} has no pooling; pass plain ids, not a Jagged bag")
        if spec.pooling is not None and not isinstance(ids, Jagged):
            raise TypeError(f"feature {f!r}: pooled table {spec.name!r} needs a Jagged bag of ids")

    def _groups(self, feats: Mapping[str, Any]) -> dict[str, list[str]]:
        """table -> its features present in feats (sorted, so the order is static)."""
        groups: dict[str, list[str]] = {}
        for f in sorted(feats):
            self._check_feature(f, feats[f])
            groups.setdefault(self._spec(f).name, []).append(f)
        return groups

    def _axes(self, name: str):
        p = self.plans[name]
        fs = p.replica_axes if p.kind == "fs2d" else ()
        sync = p.replica_axes if p.kind in ("2d", "replicated") else ()
        return p.model_axes, fs, sync

    def _capacities(self, feats, groups) -> dict[str, int]:
        n_dev = int(np.prod([self.mesh.shape[a] for a in self.batch_axes]))
        caps = {}
        for name, fs in groups.items():
            n = sum(_size(feats[f]) // n_dev for f in fs)
            caps[name] = plans_lib.capacity(n, self.layouts[name], self.plans[name])
        return caps

    def _state_specs(self, units):
        return {u: {k: P(self.plans[self.units[u][0]].storage_axes or None)
                    for k in ["weights", *self.specs[self.units[u][0]].optimizer.init_state(1, 1)]}
                for u in units}

    def _units_of(self, names):
        return list(dict.fromkeys(self.unit_of[n] for n in names))

    # ------------------------------------------------------ fixed bucket branches
    def _switched(self, name: str) -> tuple[bool, bool]:
        """(exchange switch, sync switch) of table `name`: the bucketed lax.switches that
        hold collectives (all_to_all / all-gather), which XLA:GPU runs as a host-synced
        conditional (module docstring of routing: "fixed branches")."""
        lay, (_, _, sync) = self.layouts[name], self._axes(name)
        local = lay.num_model == 1 and lay.num_fs == 1
        return (bool(self.exchange_buckets) and not local,
                self.sync_buckets and bool(sync) and local)

    def has_switches(self) -> bool:
        """Whether any table's step holds a switch with collectives (see `branch_plan`)."""
        return any(any(self._switched(n)) for n in self.specs)

    def branch_needs(self, feats: Mapping[str, Any]) -> dict[str, Array]:
        """Dispatch (asynchronously) what each switched table's bucket branches need
        for feats: {table: [2] int32 (largest per-destination unique count, unique
        count), pmax'd over the mesh}, replicated. Pass the host copy to `branch_plan`."""
        groups = {n: fs for n, fs in self._groups(feats).items() if any(self._switched(n))}
        if not groups:
            return {}
        key = ("needs", tuple((n, tuple(fs)) for n, fs in groups.items()))
        if key not in self._jitted:
            axes = tuple(self.mesh.axis_names)

            def body(feats):
                out = {}
                for name, fs in groups.items():
                    ids, valid, _, _ = _table_ids(self.specs[name], fs, feats)
                    need = routing.bucket_needs(ids, valid, self.layouts[name])
                    out[name] = jax.lax.pmax(jnp.stack(need), axes)
                return out

            self._jitted[key] = jax.jit(jax.shard_map(
                body, mesh=self.mesh, in_specs=(P(self.batch_axes),), out_specs=P(),
                check_vma=False))
        used = [f for fs in groups.values() for f in fs]
        return self._jitted[key]({f: feats[f] for f in used})

    def branch_plan(self, feats: Mapping[str, Any], needs: Mapping[str, Any]) -> tuple:
        """The bucket branches for feats from `branch_needs` (host values): a hashable
        ((table, exchange index or -1, sync index or -1), ...) for `fixed_branches`."""
        groups = self._groups(feats)
        caps = self._capacities(feats, groups)
        n_dev = int(np.prod([self.mesh.shape[a] for a in self.batch_axes]))
        plan = []
        for name in sorted(needs):
            need = np.asarray(needs[name]).reshape(-1)
            xs, ss = self._switched(name)
            lay = self.layouts[name]
            xb = sb = -1
            if xs:
                c = routing.exchange_caps(caps[name], self.exchange_buckets)
                xb = min(int(np.searchsorted(c, int(need[0]))), len(c) - 1)
            if ss:
                n = sum(_size(feats[f]) // n_dev for f in groups[name])
                c = routing.bucket_sizes(n, self.unique_buckets,
                                         rows=plans_lib.local_rows(lay, self.plans[name]))
                sb = min(int(np.searchsorted(c, int(need[1]))), len(c) - 1)
            plan.append((name, xb, sb))
        return tuple(plan)

    @contextlib.contextmanager
    def fixed_branches(self, plan: tuple):
        """Trace lookup / apply_gradients with the bucket branches of `plan` fixed
        (`branch_plan` of the same batch): no pmax and no lax.switch around the
        collectives, so XLA:GPU need not stop the host at a conditional. A batch
        needing more than its plan gives counted ids_overflow, not silent drops."""
        old, self._fixed = self._fixed, {n: (x, s) for n, x, s in plan}
        try:
            yield
        finally:
            self._fixed = old

    # ---------------------------------------------------------------- lookup
    def lookup(self, state, feats: Mapping[str, Any]):
        """feats {feature: ids [...] int or Jagged bag} -> (acts, residuals).

        acts[f]: [*ids.shape, D] (table dtype) for unpooled features, [B, D] for
        pooled bags (float32 sum / mean over the bag; empty bags give zeros).
        residuals: routing indices per table, bag layouts, and "stats".
        """
        groups = self._groups(feats)
        caps = self._capacities(feats, groups)
        bspec = P(self.batch_axes)

        def body(state, feats):
            acts, res, stats = {}, {}, {k: jnp.zeros((), jnp.int32) for k in STATS}
            for name, fs in groups.items():
                spec, lay = self.specs[name], self.layouts[name]
                ids, valid, sizes, bad = _table_ids(spec, fs, feats)
                stats["ids_out_of_range"] += bad
                model, fs_axes, sync = self._axes(name)
                xb, sb = self._fixed.get(name, (-1, -1))
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
        n_dev = int(np.prod([self.mesh.shape[a] for a in self.batch_axes]))
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
                    else:
                        src = g_f.astype(jnp.float32).reshape(-1, spec.dim)
                        idx = jnp.arange(src.shape[0], dtype=jnp.int32)
                    srcs.append(src)
                    index.append(jnp.where(idx >= 0, idx + off, -1))
                    off += src.shape[0]
                g = jnp.concatenate(srcs + [jnp.zeros((1, spec.dim), jnp.float32)]).astype(self.grad_dtype)
                src_index = jnp.concatenate(index)
                src_index = jnp.where(src_index >= 0, src_index, off)
                if copies:   # devices holding a copy of another's batch add nothing
                    g = jnp.where(jax.lax.axis_index(copies) == 0, g, 0)
                model, fs_axes, sync = self._axes(name)
                lay = self.layouts[name]
                unit = self.unit_of[name]
                local = lay.num_model == 1 and lay.num_fs == 1 and not sync
                impl = self._update_impl(spec)
                if local and (self.unique_buckets or impl == "pallas"):
                    new[unit] = routing.update_unique_bucketed(
                        new.get(unit, state[unit]), g, route[name], spec.optimizer,
                        self.unique_buckets, src_index=src_index, update_impl=impl,
                        fused_knobs=self.fused_knobs)
                    continue
                if self.sync_buckets and sync and lay.num_model == 1 and lay.num_fs == 1:
                    # a local copy synced over replicas: they all-gather unique rows only
                    sb = self._fixed.get(name, (-1, -1))[1]
                    new[unit] = routing.sync_update_bucketed(
                        new.get(unit, state[unit]), g, route[name], sync, spec.optimizer,
                        src_index=src_index, branch=sb if sb >= 0 else None, dedup=self.dedup,
                        buckets=self.unique_buckets, update_impl=impl,
                        fused_knobs=self.fused_knobs)
                    continue
                if "xb" in route[name]:     # exchange at the lookup's bucket capacity
                    xb = self._fixed.get(name, (-1, -1))[0]
                    new[unit] = routing.route_update_bucketed(
                        new.get(unit, state[unit]), g, route[name], lay, caps[name], model, fs_axes,
                        sync, self.exchange_buckets, spec.optimizer, src_index=src_index,
                        branch=xb if xb >= 0 else None, dedup=self.dedup,
                        buckets=self.unique_buckets, update_impl=impl, fused_knobs=self.fused_knobs)
                    continue
                rows, grads = routing.route_grads(g, route[name], self.layouts[name], caps[name],
                                                  model, fs_axes, sync, src_index=src_index)
                new[unit] = routing.update_rows(new.get(unit, state[unit]), rows, grads,
                                                spec.optimizer, rows_unique=local, dedup=self.dedup,
                                                buckets=self.unique_buckets, update_impl=impl,
                                                fused_knobs=self.fused_knobs)
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


def _size(ids: Any) -> int:
    """Id slots of one feature over all devices (a Jagged bag: its capacity)."""
    return int(np.prod((ids.values if isinstance(ids, Jagged) else ids).shape))


def _table_ids(spec: TableSpec, fs: Sequence[str], feats: Mapping[str, Any]):
    """Inside shard_map: one table's features -> (ids [N] int32 bounded per spec.bounds,
    valid [N] bool, per-feature sizes, count of valid ids out of range)."""
    flat, valid, sizes = [], [], []
    for f in fs:
        ids = feats[f]
        raw = jnp.asarray(ids.values if isinstance(ids, Jagged) else ids).astype(jnp.int32)
        ok = ids.mask if isinstance(ids, Jagged) else jnp.ones(raw.shape, bool)
        flat.append(raw.reshape(-1))
        valid.append(ok.reshape(-1))
        sizes.append(raw.size)
    raw, valid = jnp.concatenate(flat), jnp.concatenate(valid)
    bad = jnp.sum(valid & ((raw < 0) | (raw >= spec.vocab)), dtype=jnp.int32)
    ids = jnp.mod(raw, spec.vocab) if spec.bounds == "hash" else jnp.clip(raw, 0, spec.vocab - 1)
    return ids, valid, sizes, bad


def _pad_rows(x: Array, rows: int) -> Array:
    """x [n, ...] -> [rows, ...]: zero rows appended, or rows past `rows` dropped."""
    if x.shape[0] >= rows:
        return x[:rows]
    return jnp.pad(x, [(0, rows - x.shape[0])] + [(0, 0)] * (x.ndim - 1))


def _zero_past_vocab(x: Array, vocab: int, offset: Array | int = 0) -> Array:
    """Rows whose logical id (offset + row) is >= vocab set to zero."""
    ids = offset + jnp.arange(x.shape[0])
    return jnp.where((ids < vocab).reshape((-1,) + (1,) * (x.ndim - 1)), x, jnp.zeros((), x.dtype))


def _mod_blocks(j: Array, m: Array, lay: plans_lib.Layout):
    """Rows of storage shard m (mod split) whose logical ids fall in logical block j.

    Logical block j holds ids [j * rps, (j + 1) * rps); storage shard m holds ids
    l * S + m at local row l. Those in block j are l in [start, start + count):
    start = clip(ceil((j * rps - m) / S), 0, rps), at most ceil(rps / S) of them.
    """
    s, rps = lay.num_shards, lay.rows_per_shard
    start = lambda jj: jnp.clip(-((m - jj * rps) // s), 0, rps)  # noqa: E731  ceil division
    return start(j), start(j + 1) - start(j)


def _mod_permute(x: Array, lay: plans_lib.Layout, mesh: Mesh, axes: tuple[str, ...],
                 to_logical: bool) -> Array:
    """A mod split's storage [Vp, ...] <-> its logical order [Vp, ...], both sharded
    P(axes) over the S storage shards: one padded all_to_all of [S, ceil(rps/S), ...]
    per device, never the table on one device. XLA:CPU temp memory per device,
    measured (1e6 x 16 table + row-wise Adagrad on 8 devices): 2.1 shards to
    logical, 3.8 storage-ward (its output may reuse the donated input). Logical
    rows >= V come out zero."""
    s, rps = lay.num_shards, lay.rows_per_shard
    cap = -(-rps // s)
    c = jnp.arange(cap)

    def body(local):                                   # [rps, ...], this device's block
        me = jax.lax.axis_index(axes)
        peers = jnp.arange(s)
        if to_logical:      # me = storage shard m, peers = logical blocks j
            start, count = _mod_blocks(peers, me, lay)
            src = start[:, None] + c[None, :]                       # [S, cap] local storage rows
            ok = c[None, :] < count[:, None]
        else:               # me = logical block j, peers = storage shards m
            start, count = _mod_blocks(me, peers, lay)
            src = (start[:, None] + c[None, :]) * s + peers[:, None] - me * rps
            ok = (c[None, :] < count[:, None]) & (src + me * rps < lay.vocab)   # rows past V: 0
        send = jnp.take(local, jnp.where(ok, src, 0), axis=0)
        send = jnp.where(ok.reshape(ok.shape + (1,) * (local.ndim - 1)), send,
                         jnp.zeros((), local.dtype))
        recv = jax.lax.all_to_all(send, axes, 0, 0)                 # recv[p] from peer p
        if to_logical:      # me = logical block j, peers = storage shards m
            start, count = _mod_blocks(me, peers, lay)
            dst = (start[:, None] + c[None, :]) * s + peers[:, None] - me * rps
        else:               # me = storage shard m, peers = logical blocks j
            start, count = _mod_blocks(peers, me, lay)
            dst = start[:, None] + c[None, :]
        ok = c[None, :] < count[:, None]
        dst = jnp.where(ok, dst, rps).reshape(-1)                   # rps: dropped
        out = jnp.zeros_like(local).at[dst].set(recv.reshape((-1,) + local.shape[1:]),
                                                mode="drop", unique_indices=True)
        return _zero_past_vocab(out, lay.vocab, me * rps) if to_logical else out

    spec = P(axes)
    return jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)(x)


def _storage_to_logical(a: Array, lay: plans_lib.Layout, rows: int, mesh: Mesh,
                        axes: tuple[str, ...]) -> Array:
    """One table's storage array [Vp, ...] (its stack for table_wise) -> logical [rows, ...].

    Storage row of logical id i (`Layout.storage_index`): i for "range" and replicated
    tables (identity), s * rps + l with (s, l) = (i % S, i // S) for "mod" (an
    all_to_all, `_mod_permute`), a slice of the stack for table_wise tables (XLA may
    gather the stack, which fits one device by construction).
    """
    if lay.fixed_shard >= 0:
        start = lay.fixed_shard * lay.rows_per_shard + lay.base
        return _pad_rows(jax.lax.slice_in_dim(a, start, start + lay.vocab), rows)
    if lay.split == "mod" and lay.num_shards > 1:
        return _mod_permute(a, lay, mesh, axes, to_logical=True)
    return _zero_past_vocab(a, lay.vocab)


def _logical_to_storage(xs: Sequence[Array], lays: Sequence[plans_lib.Layout], mesh: Mesh,
                        axes: tuple[str, ...]) -> Array:
    """Logical arrays [>= V, ...] of the tables of one storage unit -> its storage [Vp, ...]."""
    if lays[0].fixed_shard < 0:
        (x,), (lay,) = xs, lays
        if x.shape[0] != lay.padded_vocab:
            x = _pad_rows(x[:lay.vocab], lay.padded_vocab)
        if lay.split == "mod" and lay.num_shards > 1:
            return _mod_permute(x, lay, mesh, axes, to_logical=False)
        return _zero_past_vocab(x, lay.vocab)
    out = jnp.zeros((lays[0].padded_vocab,) + xs[0].shape[1:], xs[0].dtype)
    for x, lay in zip(xs, lays):
        start = lay.fixed_shard * lay.rows_per_shard + lay.base
        out = jax.lax.dynamic_update_slice_in_dim(out, x[:lay.vocab], start, axis=0)
    return out


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
