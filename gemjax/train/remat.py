"""The activation-checkpointing planner: given a device-memory budget, the per-region plan
(gemjax.layers.regions) of the train step, from measured memory and measured step time.

    path = plan_path(cfg)                   # measures the candidates (compiles, runs)
    chosen = choose(path, budget_bytes)     # the first plan on the path within budget
    cfg = resolve(cfg)                      # train.remat=auto -> the chosen plan's text

Measured, never modelled: a plan's memory is the compiled train step's
memory_analysis() (temp_size + argument_size bytes: the step's arguments, state
included, plus XLA's scratch for everything live inside it); its time is the wall
time of the compiled step on the current backend (mean of `steps` runs after one
warm-up). Both come from `measure`.

What the planner optimises: the least added step time for the memory it must save.
It measures the baseline (every region "save") and each single change (one region
under one other policy), which gives each change's saving (bytes) and cost (seconds,
floored at 1 us). Greedy: from the baseline, apply the change with the most bytes
saved per second of added time (a region already changed moves on to another of its
policies by the difference of the two singles), measure the combined plan, and
repeat while some change saves bytes; the measured plans in that order are the
*path*. `choose` takes the first plan on the path whose measured memory fits the
budget, so a smaller budget never gets a plan with more measured memory than a
larger budget's (the first plan under a smaller budget also fits the larger one,
and any plan before it measured more than the smaller budget). A budget below every
measured plan raises ValueError naming train.memory_budget_gb.

Policies measured: save, recompute, quantize, and offload where the backend has a
pinned_host memory space (on CPU offload runs but copies within host RAM; it is
measured like the others).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Iterable, Sequence

import jax

from gemjax.config import Config, apply_overrides
from gemjax.layers.regions import POLICIES, REGIONS, format_plan

GIB = 1 << 30
BUDGET_FLAG = "train.memory_budget_gb"
MIN_COST_S = 1e-6


@dataclasses.dataclass(frozen=True)
class Measured:
    """One plan's figures: its flag text, compiled memory (bytes) and step time (s)."""
    plan: str
    temp_bytes: int
    argument_bytes: int
    host_bytes: int           # host temp + argument bytes (offloaded residuals)
    step_s: float

    @property
    def peak_bytes(self) -> int:
        """temp + argument bytes of the compiled step: the device memory it needs."""
        return self.temp_bytes + self.argument_bytes


def available_policies() -> tuple[str, ...]:
    """POLICIES, offload only where the default device has a pinned_host memory space."""
    try:
        kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
    except (AttributeError, NotImplementedError):
        kinds = set()
    return tuple(p for p in POLICIES if p != "offload" or "pinned_host" in kinds)


class StepMeasurer:
    """measure(plan_text) -> Measured for the train step of `cfg` under each plan.

    One train state and `batches` batches of cfg's train source, shared by every plan (the plan
    changes the program, not the state's structure); each plan gets its own Trainer, on
    `mesh` with `trainer_kw` (gemjax.train.layout.build's) when given.
    """

    def __init__(self, cfg: Config, *, steps: int = 3, batches: int = 2, seed: int = 0,
                 mesh=None, trainer_kw: dict | None = None):
        from gemjax.data.feeding import Feeder
        from gemjax.data.source import make_source
        from gemjax.train.step import Trainer

        self.cfg, self.steps, self.trainer_kw = cfg, steps, dict(trainer_kw or {})
        trainer = Trainer.create(apply_overrides(cfg, {"train.remat": "none"}), mesh, **self.trainer_kw)
        self.state = trainer.init_state(seed)
        feeder = Feeder(make_source(cfg, seed=seed).shard_batch, trainer.mesh)
        self.batches = [feeder.to_device(feeder.host_batch(i)[0]) for i in range(batches)]
        self.mesh = trainer.mesh

    def __call__(self, plan: str) -> Measured:
        from gemjax.train.step import Trainer

        trainer = Trainer.create(apply_overrides(self.cfg, {"train.remat": plan}), self.mesh,
                                 **self.trainer_kw)
        step = trainer.make_train_step()
        state, nb = self.state, len(self.batches)
        for i in range(nb):               # warm-up: every batch's program compiled
            state, m = step(state, self.batches[i], next_batch=self.batches[(i + 1) % nb])
        jax.block_until_ready((state, m))
        # after the calls, so the jit cache serves this compile (the other order compiles twice)
        mem = step.lower(state, self.batches[0]).compile().memory_analysis()
        t0 = time.perf_counter()
        for i in range(self.steps):
            state, m = step(state, self.batches[i % nb], next_batch=self.batches[(i + 1) % nb])
        jax.block_until_ready((state, m))
        step_s = (time.perf_counter() - t0) / max(self.steps, 1)
        self.state = state                # the old one was donated
        host = getattr(mem, "host_temp_size_in_bytes", 0) + getattr(mem, "host_argument_size_in_bytes", 0)
        return Measured(plan, int(mem.temp_size_in_bytes), int(mem.argument_size_in_bytes),
                        int(host), step_s)


@dataclasses.dataclass
class Path:
    """The planner's measurements: the baseline, each single change, and the greedy path
    (baseline first), each entry a Measured."""
    baseline: Measured
    singles: dict[tuple[str, str], Measured]
    steps: list[Measured]


def plan_path(measure: Callable[[str], Measured], *, regions: Sequence[str] = REGIONS,
              policies: Iterable[str] | None = None) -> Path:
    """Measure the baseline and single changes, then walk the greedy path (module
    docstring). measure: plan flag text -> Measured (a StepMeasurer)."""
    policies = tuple(p for p in (policies or available_policies()) if p != "save")
    seen: dict[str, Measured] = {}

    def measure_once(plan: str) -> Measured:     # a path step may be a single already measured
        if plan not in seen:
            seen[plan] = measure_fn(plan)
        return seen[plan]
    measure_fn, measure = measure, measure_once
    base = measure("none")
    singles = {(r, p): measure(f"{r}:{p}") for r in regions for p in policies}

    def gain(r: str, p: str) -> tuple[int, float]:
        s = singles[(r, p)]
        return base.peak_bytes - s.peak_bytes, max(s.step_s - base.step_s, 0.0)

    current: dict[str, str] = {}
    steps = [base]
    while True:
        best, best_score = None, 0.0
        for (r, p) in singles:
            if current.get(r) == p:
                continue
            saved, cost = gain(r, p)
            if r in current:                    # moving a changed region on: the difference
                saved0, cost0 = gain(r, current[r])
                saved, cost = saved - saved0, cost - cost0
            if saved <= 0:
                continue
            score = saved / max(cost, MIN_COST_S)
            if score > best_score:
                best, best_score = (r, p), score
        if best is None:
            break
        current[best[0]] = best[1]
        steps.append(measure(format_plan(current)))
    return Path(base, singles, steps)


def choose(path: Path, budget_bytes: float, flag: str = BUDGET_FLAG) -> Measured:
    """The first plan on the path whose measured memory fits budget_bytes; ValueError
    naming `flag` when none does."""
    for m in path.steps:
        if m.peak_bytes <= budget_bytes:
            return m
    least = min(path.steps, key=lambda m: m.peak_bytes)
    raise ValueError(f"{flag}={budget_bytes / GIB:.4g} GiB is below every measured plan: the "
                     f"smallest is {least.peak_bytes / GIB:.4g} GiB ({least.plan}); raise {flag} "
                     f"or shrink the model / data.batch_size")


def table(path: Path, chosen: Measured | None = None) -> str:
    """The planner's figures, one row per measured plan (baseline, singles, path)."""
    rows = [("baseline", path.baseline)] + [("single", m) for m in path.singles.values()] + \
        [(f"path {i}", m) for i, m in enumerate(path.steps) if i]
    if chosen is not None and not any(m is chosen for _, m in rows):
        rows.append(("chosen", chosen))
    head = f"{'kind':<8} {'plan':<48} {'peak GiB':>9} {'temp GiB':>9} {'host GiB':>9} {'step ms':>9}  chosen"
    lines = [head]
    for kind, m in rows:
        mark = "  <-" if chosen is not None and m is chosen else ""
        lines.append(f"{kind:<8} {m.plan:<48} {m.peak_bytes / GIB:>9.4f} {m.temp_bytes / GIB:>9.4f} "
                     f"{m.host_bytes / GIB:>9.4f} {m.step_s * 1e3:>9.2f}{mark}")
    return "\n".join(lines)


def resolve(cfg: Config, log: Callable[[str], None] = print, **measure_kw) -> Config:
    """cfg with train.remat=auto replaced by the planner's plan for train.memory_budget_gb
    (its table logged); any other cfg unchanged."""
    if cfg.train.remat != "auto":
        return cfg
    path = plan_path(StepMeasurer(cfg, **measure_kw))
    chosen = choose(path, cfg.train.memory_budget_gb * GIB)
    log(f"remat planner: budget {cfg.train.memory_budget_gb:g} GiB -> {chosen.plan} (least "
        f"added step time per byte saved, measured on {jax.devices()[0].platform})\n"
        + table(path, chosen))
    return apply_overrides(cfg, {"train.remat": chosen.plan})
