"""A run's parallel layout from its Config, and the Config that records a built layout.

    mesh, kw = layout.build(cfg)                  # cfg.parallel -> Trainer.create's arguments
    trainer = Trainer.create(cfg, mesh, **kw)
    cfg = layout.record(cfg, trainer, kw)         # what runs, back in cfg.parallel

Config.parallel (gemjax.config.ParallelConfig) holds four strings in
experiments/train.py's flag syntax: the mesh spec, the logical-axis rule overrides,
the '+'-separated table replica axes and the table plan. `record` rewrites them from
the trainer that was built (mesh axes with their sizes and tiers, rules as overrides
of DEFAULT_RULES, the table plan), so the config.json that train()
writes rebuilds the same mesh, parameter shardings and table plans with `build`
alone. Table plans in config form: "" (the planner), one kind for every table
(gemjax.sparse.plans.resolve's kind strings), or per table
"table:kind[@capacity_factor]/..." with capacity_factor a number or none (default:
the kind's own, 2.0; none for table_wise).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from jax.sharding import Mesh

from gemjax.config import Config
from gemjax.parallel import rules as rules_lib
from gemjax.parallel.mesh import DEFAULT_TIERS, build_mesh, mesh_tiers
from gemjax.sparse import plans as plans_lib
from gemjax.sparse.plans import TablePlan
from gemjax.train.optim import table_specs
from gemjax.train.step import default_mesh


def replica_axes(text: str) -> tuple[str, ...]:
    """'+'-separated axis names -> tuple."""
    return tuple(a.strip() for a in text.split("+") if a.strip())


def parse_table_plan(text: str) -> None | str | dict[str, tuple[str, float | None | str]]:
    """The table_plan field: "" -> None (the planner); "kind" -> "kind"; per table
    "t:kind[@cf]/..." -> {t: (kind, cf)}, cf "default" when absent."""
    text = text.strip()
    if not text:
        return None
    if ":" not in text:
        return text
    out: dict[str, tuple[str, float | None | str]] = {}
    for part in text.split("/"):
        name, sep, rest = part.partition(":")
        kind, at, cf = rest.partition("@")
        if not sep or not name.strip() or not kind.strip() or name.strip() in out:
            raise ValueError(f"parallel.table_plan={text!r}: expected 'table:kind[@capacity_factor]/...' "
                             f"with each table once, got {part!r}")
        cap: float | None | str = "default"
        if at:
            try:
                cap = None if cf.strip().lower() == "none" else float(cf)
            except ValueError:
                raise ValueError(f"parallel.table_plan={text!r}: capacity factor {cf!r} of table "
                                 f"{name.strip()!r} is not a number or none") from None
        out[name.strip()] = (kind.strip(), cap)
    return out


def build(cfg: Config, devices=None) -> tuple[Mesh, dict[str, Any]]:
    """(mesh, Trainer.create keyword arguments) of cfg.parallel, over `devices` (default
    all). ValueError names the bad field."""
    p = cfg.parallel
    try:
        mesh = build_mesh(p.mesh, devices) if p.mesh.strip() else default_mesh(devices)
    except ValueError as e:
        raise ValueError(f"parallel.mesh={p.mesh!r}: {e}") from None
    try:
        rules = rules_lib.parse_rules(p.logical_rules)
    except ValueError as e:
        raise ValueError(f"parallel.logical_rules={p.logical_rules!r}: {e}") from None
    replica = replica_axes(p.table_replica_axes)
    missing = [a for a in replica if a not in mesh.axis_names]
    if missing:
        raise ValueError(f"parallel.table_replica_axes={p.table_replica_axes!r}: {missing} not among "
                         f"the mesh axes {tuple(mesh.axis_names)}")
    kw: dict[str, Any] = {"rules": rules, "table_replica_axes": replica}
    plan = parse_table_plan(p.table_plan)
    try:
        if isinstance(plan, dict):
            specs = table_specs(cfg)
            resolved = plans_lib.resolve({t: k for t, (k, _) in plan.items()}, specs, mesh, replica)
            plan = {t: q if plan[t][1] == "default" else dataclasses.replace(q, capacity_factor=plan[t][1])
                    for t, q in resolved.items()}
        elif plan is not None:
            plans_lib.resolve(plan, table_specs(cfg), mesh, replica)        # checked here
    except (ValueError, TypeError) as e:
        raise ValueError(f"parallel.table_plan={p.table_plan!r}: {e}") from None
    if plan is not None:
        kw["table_plan"] = plan
    return mesh, kw


def format_mesh(mesh: Mesh, spec: str = "") -> str:
    """The mesh as a spec that rebuilds it: axis=size@tier outer to inner, tiers from
    `spec` (the one it was built from) or parallel.mesh's defaults; "" for one "batch" axis."""
    names = tuple(mesh.axis_names)
    if names == ("batch",):
        return ""
    tiers = mesh_tiers(spec) if spec.strip() else {}
    out = []
    for n in names:
        tier = tiers.get(n) or DEFAULT_TIERS.get(n)
        if tier is None:
            raise ValueError(f"mesh axis {n!r} has no tier to record in parallel.mesh: build the "
                             f"mesh from cfg.parallel.mesh ('{n}=<size>@<tier>')")
        out.append(f"{n}={mesh.shape[n]}@{tier}")
    return ",".join(out)


def format_rules(rules: Mapping[str, tuple[str, ...]] | None) -> str:
    """Rules as overrides of DEFAULT_RULES (parse_rules' syntax); "" for the defaults."""
    if rules is None:
        return ""
    out = [f"{k}={'+'.join(v)}" for k, v in rules.items() if rules_lib.DEFAULT_RULES.get(k) != tuple(v)]
    out += [f"{k}=" for k in rules_lib.DEFAULT_RULES if k not in rules]
    return ",".join(out)


def _kind(p: TablePlan) -> str:
    return p.kind if p.kind == "table_wise" or p.split == "mod" else f"{p.kind}_range"


def format_table_plan(plans: Mapping[str, TablePlan], specs, mesh, replica: tuple[str, ...]) -> str:
    """Every table's plan as "t:kind[@cf]/..."; ValueError when the text would not
    rebuild a plan exactly (axes or min_capacity other than the kind's own)."""
    parts = []
    base = plans_lib.resolve({t: _kind(p) for t, p in plans.items()}, specs, mesh, replica)
    for t, p in plans.items():
        cf = "" if p.capacity_factor == base[t].capacity_factor else f"@{p.capacity_factor}".lower()
        parts.append(f"{t}:{_kind(p)}{cf}")
        if dataclasses.replace(base[t], capacity_factor=p.capacity_factor) != p:
            raise ValueError(f"table {t!r}: plan {p} has no parallel.table_plan form (the kind "
                             f"{_kind(p)!r} on this mesh gives {base[t]})")
    return "/".join(parts)


def record(cfg: Config, trainer, kw: Mapping[str, Any]) -> Config:
    """cfg with cfg.parallel rewritten from what `trainer` runs (built with Trainer.create
    keyword arguments `kw`). The table plan stays "" (the planner) or a kind string when
    that is what ran; plans given any other way (TablePlans, planner arguments) are
    written per table."""
    replica = tuple(kw.get("table_replica_axes", ()))
    plan, planner_kw = kw.get("table_plan"), set(kw) - {"rules", "table_replica_axes", "table_plan"}
    if plan is None and not planner_kw:
        text = ""                               # the planner's defaults pick the same plans again
    elif isinstance(plan, str):
        text = plan
    else:
        coll = trainer.coll
        text = format_table_plan(coll.plans, list(coll.specs.values()), trainer.mesh, replica)
    parallel = dataclasses.replace(
        cfg.parallel, mesh=format_mesh(trainer.mesh, cfg.parallel.mesh),
        logical_rules=format_rules(kw.get("rules")), table_replica_axes="+".join(replica),
        table_plan=text)
    return dataclasses.replace(cfg, parallel=parallel)
