"""Switch-branch planning: which bucket branch each table's exchange / replica sync
runs for a batch, decided before the step so the step holds no host-synced switch.

    planner = BranchPlanner(specs, plans, layouts, mesh, batch_axes,
                            exchange_buckets, unique_buckets, sync_buckets)
    needs = planner.needs(groups, feats)               # dispatched, device arrays
    plan = planner.plan(groups, caps, feats, jax.device_get(needs))
    with planner.fixed_branches(plan):                  # lookup / apply_gradients traced
        ...                                             # with planner.fixed(table) set

Tables whose bucketed exchange (exchange_buckets on model-parallel tables) or replica
sync (sync_buckets on local copies synced over replicas) put collectives inside a
lax.switch; XLA:GPU runs such a switch as a host-synced conditional ("Fixed branches"
in gemjax.sparse.routing). A plan is a hashable ((table, exchange index or -1, sync
index or -1), ...). EmbeddingCollection.branch_needs / branch_plan / fixed_branches
are this planner's entry points; gemjax.train.planned fixes them per batch.
"""

from __future__ import annotations

import contextlib
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from gemjax.sparse import plans as plans_lib
from gemjax.sparse import routing
from gemjax.sparse.ids import id_slots, table_ids
from gemjax.sparse.specs import TableSpec

Array = Any


class BranchPlanner:
    """The bucket branches of a collection's switched tables (module docstring).

    specs / plans / layouts: {table: TableSpec / TablePlan / plans.Layout};
    exchange_buckets, unique_buckets, sync_buckets: the collection's options.
    """

    def __init__(self, specs: Mapping[str, TableSpec], plans: Mapping[str, plans_lib.TablePlan],
                 layouts: Mapping[str, plans_lib.Layout], mesh: Mesh, batch_axes: tuple[str, ...],
                 exchange_buckets: Sequence[float], unique_buckets: Sequence[float],
                 sync_buckets: bool):
        self.specs, self.plans, self.layouts = specs, plans, layouts
        self.mesh, self.batch_axes = mesh, batch_axes
        self.exchange_buckets, self.unique_buckets = exchange_buckets, unique_buckets
        self.sync_buckets = sync_buckets
        self._fixed: dict[str, tuple[int, int]] = {}   # see fixed_branches
        self._jitted: dict[Any, Any] = {}              # the needs program per feature set

    def switched(self, name: str) -> tuple[bool, bool]:
        """(exchange switch, sync switch) of table `name`: the bucketed lax.switches that
        hold collectives (all_to_all / all-gather)."""
        lay, (_, _, sync) = self.layouts[name], plans_lib.table_axes(self.plans[name], self.mesh)
        local = lay.num_model == 1 and lay.num_fs == 1
        return (bool(self.exchange_buckets) and not local,
                self.sync_buckets and bool(sync) and local)

    def has_switches(self) -> bool:
        """Whether any table's step holds a switch with collectives."""
        return any(any(self.switched(n)) for n in self.specs)

    def needs(self, groups: Mapping[str, list[str]], feats: Mapping[str, Any]) -> dict[str, Array]:
        """Dispatch (asynchronously) what each switched table's bucket branches need
        for feats: {table: [2] int32 (largest per-destination unique count, unique
        count), pmax'd over the mesh}, replicated. groups: {table: its features}."""
        groups = {n: fs for n, fs in groups.items() if any(self.switched(n))}
        if not groups:
            return {}
        key = tuple((n, tuple(fs)) for n, fs in groups.items())
        if key not in self._jitted:
            axes = tuple(self.mesh.axis_names)

            def body(feats):
                out = {}
                for name, fs in groups.items():
                    ids, valid, _, _ = table_ids(self.specs[name], fs, feats)
                    need = routing.bucket_needs(ids, valid, self.layouts[name])
                    out[name] = jax.lax.pmax(jnp.stack(need), axes)
                return out

            self._jitted[key] = jax.jit(jax.shard_map(
                body, mesh=self.mesh, in_specs=(P(self.batch_axes),), out_specs=P(),
                check_vma=False))
        used = [f for fs in groups.values() for f in fs]
        return self._jitted[key]({f: feats[f] for f in used})

    def plan(self, groups: Mapping[str, list[str]], caps: Mapping[str, int],
             feats: Mapping[str, Any], needs: Mapping[str, Any]) -> tuple:
        """The bucket branches for feats from `needs` (host values): a hashable
        ((table, exchange index or -1, sync index or -1), ...) for `fixed_branches`.
        caps: {table: all_to_all capacity C of this batch}."""
        n_dev = int(np.prod([self.mesh.shape[a] for a in self.batch_axes]))
        plan = []
        for name in sorted(needs):
            need = np.asarray(needs[name]).reshape(-1)
            xs, ss = self.switched(name)
            lay = self.layouts[name]
            xb = sb = -1
            if xs:
                c = routing.exchange_caps(caps[name], self.exchange_buckets)
                xb = min(int(np.searchsorted(c, int(need[0]))), len(c) - 1)
            if ss:
                n = sum(id_slots(feats[f]) // n_dev for f in groups[name])
                c = routing.bucket_sizes(n, self.unique_buckets,
                                         rows=plans_lib.local_rows(lay, self.plans[name]))
                sb = min(int(np.searchsorted(c, int(need[1]))), len(c) - 1)
            plan.append((name, xb, sb))
        return tuple(plan)

    def fixed(self, name: str) -> tuple[int, int]:
        """(exchange index, sync index) fixed for table `name` while tracing, -1: not fixed."""
        return self._fixed.get(name, (-1, -1))

    @contextlib.contextmanager
    def fixed_branches(self, plan: tuple):
        """Trace with the bucket branches of `plan` fixed (`plan` of the same batch): no
        pmax and no lax.switch around the collectives, so XLA:GPU need not stop the host
        at a conditional. A batch needing more than its plan gives counted ids_overflow,
        not silent drops."""
        old, self._fixed = self._fixed, {n: (x, s) for n, x, s in plan}
        try:
            yield
        finally:
            self._fixed = old
