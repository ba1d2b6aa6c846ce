"""Sharding plans for embedding tables, and a small planner.

A plan says where a table's rows (and their optimizer state, which shares the
leading vocab dimension) live on the mesh, and over which mesh axes ids travel:

  kind          rows stored                         ids exchanged      grads combined
  replicated    whole table on every device         none (local)       all-gather over all axes
  row_wise      split over all mesh axes            all_to_all, all    at the owner
  2d            split over model axes,              all_to_all over    at the owner, then
                replicated over replica axes        model axes         all-gather over replica
                                                                       axes (replicas in sync)
  fs2d          split over model x replica axes     all_to_all over    reduce-scattered to the
                (each replica's copy sharded        model axes, then   sub-shard owner
                further), gathered on demand        all-gather over
                                                    replica axes
  table_wise    whole table on one device           all_to_all, all    at the owner

Table-wise tables sharing (dim, dtype, optimizer) are stacked into one array
sharded over all axes, each device's block holding whole tables (SPMD arrays
span the mesh, so this is how "one table per device" is stored): the state key
of a stack is "@table_wise_<i>" instead of the table name (`stacks`). Their
all_to_all capacity is N (every id goes to one device), so they never overflow.

Rows are split "mod" (row i on shard i % S, good for Zipf ids: hot rows spread)
or "range" (contiguous blocks; the storage order equals the logical order, so a
checkpoint restores onto any shard count that divides the padded vocab). The
vocab is padded up to a multiple of the shard count; padding rows are never
looked up.

Static capacity: each device sends at most C unique ids to each destination,
C = min(N, max(min_capacity, ceil(capacity_factor * N / S_model))) (N = the
device's ids for the table; capacity_factor=None gives C = N, which can never
overflow).
Overflow policy: ids past the capacity of their destination get a zero
embedding and no gradient, and are counted in stats["ids_overflow"] (never
silent). Within a destination, the smallest ids win (ids are sorted first).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

import numpy as np

from gemjax.sparse.specs import TableSpec

KINDS = ("replicated", "row_wise", "2d", "fs2d", "table_wise")
SPLITS = ("mod", "range")


@dataclasses.dataclass(frozen=True)
class TablePlan:
    """Where one table lives. Axes are mesh axis names."""

    kind: str = "row_wise"
    split: str = "mod"
    model_axes: tuple[str, ...] = ()
    replica_axes: tuple[str, ...] = ()
    capacity_factor: float | None = 2.0
    min_capacity: int = 64
    shard: int | None = None    # table_wise: owning device (index over model_axes)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"plan kind must be one of {KINDS}, got {self.kind!r}")
        if self.split not in SPLITS:
            raise ValueError(f"plan split must be one of {SPLITS}, got {self.split!r}")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(f"capacity_factor must be > 0 or None, got {self.capacity_factor}")

    @property
    def storage_axes(self) -> tuple[str, ...]:
        """Mesh axes the leading (row) dimension of the state arrays is split over."""
        if self.kind == "replicated":
            return ()
        if self.kind == "fs2d":
            return self.model_axes + self.replica_axes
        return self.model_axes


def _axes_size(mesh, axes: Sequence[str]) -> int:
    return int(math.prod(mesh.shape[a] for a in axes)) if axes else 1


@dataclasses.dataclass(frozen=True)
class Layout:
    """Static numbers of one table under one plan on one mesh (used inside shard_map)."""

    vocab: int
    padded_vocab: int
    num_model: int          # S_m: destinations of the id all_to_all
    num_fs: int             # R for fs2d (sub-shards of a model shard), else 1
    rows_per_shard: int     # rows per device
    split: str
    fixed_shard: int = -1   # table_wise: the owning device; rows at base + id
    base: int = 0

    @property
    def num_shards(self) -> int:
        return self.num_model * self.num_fs

    def locate(self, ids):
        """Logical ids -> (model shard m, row index l within model shard m's block).

        Works on numpy or jax int arrays. For fs2d, sub-shard r owns l in
        [r * rows_per_shard, (r + 1) * rows_per_shard).
        """
        s_all, rps = self.num_shards, self.rows_per_shard
        if self.fixed_shard >= 0:
            return ids * 0 + self.fixed_shard, ids + self.base
        if self.split == "mod":
            s, local = ids % s_all, ids // s_all
        else:
            s, local = ids // rps, ids % rps
        return s // self.num_fs, (s % self.num_fs) * rps + local

    def storage_index(self, ids):
        """Logical ids -> row of the global storage array (numpy or jax)."""
        m, l = self.locate(ids)
        return m * self.num_fs * self.rows_per_shard + l


def layout(spec: TableSpec, plan: TablePlan, mesh) -> Layout:
    """Layout of a table stored alone (a table_wise table as the only one of its stack)."""
    if plan.kind == "table_wise":
        return Layout(spec.vocab, spec.vocab * _axes_size(mesh, plan.model_axes),
                      _axes_size(mesh, plan.model_axes), 1, spec.vocab, "range", plan.shard or 0, 0)
    if plan.kind == "replicated":
        nm, nf = 1, 1
    else:
        nm = _axes_size(mesh, plan.model_axes)
        nf = _axes_size(mesh, plan.replica_axes) if plan.kind == "fs2d" else 1
    rps = -(-spec.vocab // (nm * nf))
    return Layout(spec.vocab, rps * nm * nf, nm, nf, rps, plan.split)


def capacity(num_ids: int, lay: Layout, plan: TablePlan) -> int:
    """Static per-destination capacity C for a device holding num_ids ids."""
    if plan.capacity_factor is None or lay.num_model == 1:
        return max(num_ids, 1)
    c = max(plan.min_capacity, math.ceil(plan.capacity_factor * num_ids / lay.num_model))
    return max(1, min(num_ids, c))


def stacks(specs: Sequence[TableSpec], plans: Mapping[str, TablePlan], mesh):
    """Storage units: ({unit: [tables]}, {table: Layout}).

    A unit is a table (its own state entry) or a stack of table_wise tables
    with equal (dim, dtype, optimizer), named "@table_wise_<i>".
    """
    units, layouts, keys = {}, {}, {}
    for s in specs:
        p = plans[s.name]
        if p.kind != "table_wise":
            units[s.name] = [s.name]
            layouts[s.name] = layout(s, p, mesh)
            continue
        k = (s.dim, str(np.dtype(s.dtype)), repr(s.optimizer))
        keys.setdefault(k, f"@table_wise_{len(keys)}")
        units.setdefault(keys[k], []).append(s.name)
    by_name = {s.name: s for s in specs}
    for unit in [u for u in units if u.startswith("@table_wise")]:
        n_dev = _axes_size(mesh, plans[units[unit][0]].model_axes)
        fill = [0] * n_dev
        for t in units[unit]:
            dev = plans[t].shard
            layouts[t] = (dev, fill[dev])
            fill[dev] += by_name[t].vocab
        rows = max(max(fill), 1)
        for t in units[unit]:
            dev, base = layouts[t]
            layouts[t] = Layout(by_name[t].vocab, rows * n_dev, n_dev, 1, rows, "range", dev, base)
    return units, layouts


def local_rows(lay: Layout, plan: TablePlan) -> int:
    """Rows of the table each device stores (not table_wise, whose owner holds the stack)."""
    return lay.padded_vocab if plan.kind == "replicated" else lay.rows_per_shard


def table_axes(plan: TablePlan, mesh=None) -> tuple[tuple[str, ...], tuple[str, ...],
                                                    tuple[str, ...]]:
    """(model axes: ids exchanged over them, fs axes: an fs2d shard gathered over them,
    sync axes: replicas kept in sync over them ("2d" and "replicated" tables)).

    With mesh, sync axes of size 1 are left out: a replica group of one device has
    nothing to keep in sync, so such a table updates as a local one.
    """
    fs = plan.replica_axes if plan.kind == "fs2d" else ()
    sync = plan.replica_axes if plan.kind in ("2d", "replicated") else ()
    if mesh is not None:
        sync = tuple(a for a in sync if mesh.shape[a] > 1)
    return plan.model_axes, fs, sync


def bytes_per_device(spec: TableSpec, plan: TablePlan, mesh) -> int:
    """Table + optimizer-state bytes held by each device under the plan (table_wise: its owner)."""
    if plan.kind == "table_wise":
        return spec.vocab * spec.row_bytes
    return local_rows(layout(spec, plan, mesh), plan) * spec.row_bytes


def resolve(plan: Any, specs: Sequence[TableSpec], mesh, replica_axes: Sequence[str] = (),
            **planner_kw) -> dict[str, TablePlan]:
    """plan: None (planner), a kind string or TablePlan for all tables, or {table: ...}.

    Kind strings: "replicated", "row_wise" / "row_wise_mod", "row_wise_range", "2d",
    "2d_range", "fs2d", "fs2d_range". Axes are filled from the mesh: replica axes as
    given, model axes the rest.
    """
    replica_axes = tuple(replica_axes)
    all_axes = tuple(mesh.axis_names)
    for a in replica_axes:
        if a not in all_axes:
            raise ValueError(f"replica axis {a!r} is not a mesh axis {all_axes}")
    model_axes = tuple(a for a in all_axes if a not in replica_axes)
    if plan is None:
        return plan_tables(specs, mesh, replica_axes=replica_axes, **planner_kw)

    def one(p, spec: TableSpec) -> TablePlan:
        if isinstance(p, TablePlan):
            return p
        if not isinstance(p, str):
            raise TypeError(f"table {spec.name!r}: plan must be a str or TablePlan, got {type(p)}")
        kind, _, split = p.partition("_range")
        split = "range" if p.endswith("_range") else "mod"
        kind = {"row_wise_mod": "row_wise"}.get(kind, kind)
        if kind not in KINDS:
            raise ValueError(f"table {spec.name!r}: unknown plan {p!r}")
        if kind in ("2d", "fs2d") and not replica_axes:
            raise ValueError(f"table {spec.name!r}: plan {p!r} needs replica_axes")
        if kind == "row_wise":
            return TablePlan("row_wise", split, all_axes, ())
        if kind == "table_wise":
            return TablePlan("table_wise", "range", all_axes, (), capacity_factor=None)
        if kind == "replicated":
            return TablePlan("replicated", split, (), all_axes)
        return TablePlan(kind, split, model_axes, replica_axes)

    if isinstance(plan, Mapping):
        missing = [s.name for s in specs if s.name not in plan]
        if missing:
            raise ValueError(f"plan has no entry for tables {missing}")
        return assign_table_wise(specs, {s.name: one(plan[s.name], s) for s in specs}, mesh)
    return assign_table_wise(specs, {s.name: one(plan, s) for s in specs}, mesh)


def assign_table_wise(specs: Sequence[TableSpec], plans: dict[str, TablePlan], mesh):
    """Give each table_wise table without a shard the least-loaded device (largest first)."""
    tw = [s for s in specs if plans[s.name].kind == "table_wise"]
    if not tw:
        return plans
    n_dev = _axes_size(mesh, plans[tw[0].name].model_axes)
    load = [0] * n_dev
    for s in tw:
        p = plans[s.name]
        if p.model_axes != plans[tw[0].name].model_axes:
            raise ValueError(f"table {s.name!r}: table_wise tables must share model_axes")
        if p.shard is not None:
            if not 0 <= p.shard < n_dev:
                raise ValueError(f"table {s.name!r}: table_wise shard {p.shard} not in [0, {n_dev})")
            load[p.shard] += s.vocab * s.row_bytes
    for s in sorted(tw, key=lambda s: -s.vocab * s.row_bytes):
        if plans[s.name].shard is None:
            dev = int(np.argmin(load))
            load[dev] += s.vocab * s.row_bytes
            plans[s.name] = dataclasses.replace(plans[s.name], shard=dev)
    return plans


def plan_tables(specs: Sequence[TableSpec], mesh, *, replica_axes: Sequence[str] = (),
                replicate_below_bytes: int = 32 << 20, table_wise_below_bytes: int = 0,
                device_budget_bytes: int = 16 << 30,
                capacity_factor: float | None = 2.0) -> dict[str, TablePlan]:
    """Pick a plan per table from its size and the mesh.

    - tables under replicate_below_bytes: replicated (no id exchange at all);
    - without replica_axes, tables under table_wise_below_bytes (default 0: off,
      since a static all_to_all sends an [S, N] buffer for them): table_wise,
      on the least-loaded device;
    - with replica_axes: "2d" when a model-axes shard fits device_budget_bytes,
      else "fs2d" (each replica's copy sharded further);
    - otherwise row_wise, mod split (spreads Zipf-hot rows over shards).
    """
    replica_axes = tuple(replica_axes)
    all_axes = tuple(mesh.axis_names)
    model_axes = tuple(a for a in all_axes if a not in replica_axes)
    out = {}
    for s in specs:
        total = s.vocab * s.row_bytes
        if total < replicate_below_bytes:
            p = TablePlan("replicated", "mod", (), all_axes, capacity_factor)
        elif not replica_axes and total < table_wise_below_bytes:
            p = TablePlan("table_wise", "range", all_axes, (), None)
        elif replica_axes:
            p = TablePlan("2d", "mod", model_axes, replica_axes, capacity_factor)
            if bytes_per_device(s, p, mesh) > device_budget_bytes:
                p = dataclasses.replace(p, kind="fs2d")
        else:
            p = TablePlan("row_wise", "mod", all_axes, (), capacity_factor)
        out[s.name] = p
    return assign_table_wise(specs, out, mesh)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def format_plan(specs: Sequence[TableSpec], plans: Mapping[str, TablePlan], mesh) -> str:
    """The plan as a text table: one row per table, bytes per device, and a total."""
    head = ("table", "vocab x dim", "dtype", "optimizer", "plan", "shards", "bytes/device")
    rows, total, tw_load = [], 0, {}
    for s in specs:
        p, lay = plans[s.name], layout(s, plans[s.name], mesh)
        b = bytes_per_device(s, p, mesh)
        if p.kind == "table_wise":
            tw_load[p.shard] = tw_load.get(p.shard, 0) + b
        else:
            total += b
        where = (f"{p.kind}/{p.split} model={','.join(p.model_axes) or '-'}"
                 f" replica={','.join(p.replica_axes) or '-'}")
        if p.kind == "table_wise":
            where = f"table_wise on device {p.shard} of {','.join(p.model_axes)}"
        rows.append((s.name, f"{s.vocab} x {s.dim}", str(np.dtype(s.dtype)),
                     type(s.optimizer).__name__, where,
                     "1" if p.kind == "table_wise" else str(lay.num_shards), _fmt_bytes(b)))
    total += max(tw_load.values(), default=0)
    rows.append(("max per device", "", "", "", "", "", _fmt_bytes(total)))
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths))
    return "\n".join([line(head), line(tuple("-" * w for w in widths))] + [line(r) for r in rows])
