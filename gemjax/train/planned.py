"""The plan-ahead pipeline: a jitted step compiled once per sparse branch plan, with the
next batch's plan computed while this step runs.

    step = planned_jit(coll, id_fields, fn, "train step", fixed=True, donate_argnums=(0,))
    state, metrics = step(state, batch, next_batch=nxt)

fn: (state, batch: Batch) -> outputs, traced inside `coll.fixed_branches(plan)`.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

import jax

from gemjax.data.batch import Batch, id_features


def _run_with_plan(coll, plan: tuple, fn: Callable, state, batch):
    """fn(state, batch) traced with the collection's switch branches fixed to `plan`."""
    with coll.fixed_branches(plan):
        return fn(state, batch)


def jit_per_plan(coll, fn: Callable, **jit_kw) -> Callable[[tuple], Callable]:
    """plan -> fn (state, batch) -> ... jitted with jit_kw, traced with that plan fixed."""
    def build(plan: tuple) -> Callable:
        return jax.jit(functools.partial(_run_with_plan, coll, plan, fn), **jit_kw)
    return build


def planned_jit(coll, id_fields: dict[str, tuple[str, ...]], fn: Callable, name: str,
                fixed: bool = True, **jit_kw) -> "PlannedStep":
    """PlannedStep `name` of fn (state, batch) -> ..., each plan's program jitted with jit_kw."""
    return PlannedStep(coll, id_fields, jit_per_plan(coll, fn, **jit_kw), fixed=fixed, name=name)


class PlannedStep:
    """A jitted step (the train step, the eval step), one program per sparse branch plan.

    Tables whose bucketed exchange or replica sync hold collectives inside a
    lax.switch (EmbeddingCollection.has_switches: sparse.exchange_buckets on
    model-parallel tables, sparse.sync_buckets on replicated ones) would make
    XLA:GPU stop the host at that conditional until the device reaches it, so the
    host could not queue the next step while this one runs (2 H200s: 20-30 ms of
    idle device per step). Instead the step is traced with the branches fixed
    (`coll.fixed_branches`), from the batch's `branch_plan`: a small jitted count
    of unique ids per table. Call with next_batch= and that count for the next
    batch is queued before this step and read after it is queued, so the host
    stays one step ahead. A plan at least as large as the batch needs in every
    table that is compiled already is reused (same results, fewer compiles);
    `plans` lists the compiled ones. Without switched tables, or with fixed=False
    (sparse.fixed_branches: the switches stay in the step): one program.

    build: plan -> the jitted step for that plan (`planned_jit` builds one).
    """

    def __init__(self, coll, id_fields, build: Callable[[tuple], Callable],
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
        return self.covering(self.coll.branch_plan(feats, jax.device_get(needs)))

    def covering(self, want: tuple) -> tuple:
        """The smallest compiled plan at least as large as `want` in every table, else want."""
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
