"""Step time against peak memory: the activation-checkpointing planner's plan for several
device-memory budgets (gemjax.train.remat), each plan's compiled peak memory and measured
step time on the current backend.

    python -m benchmarks.bench_remat --config=h200 --override=model.kind=teacher \\
        --fractions=1.0,0.8,0.6,0.4 --out=remat.json
    python -m benchmarks.bench_remat --smoke --out=/tmp/remat.json     # CPU, tiny teacher

Budgets: --budgets in GiB, or --fractions of the baseline's measured peak (every region
"save"; the default). The planner measures once (baseline, every single change, the
greedy path) and each budget takes the first plan on the path that fits; a budget
below every plan is reported as infeasible with the planner's error. Prints the
planner's table, then the curve (one row per budget: plan, peak GiB, step ms) last.
JSON (--out): {"config", "overrides", "platform", "baseline", "singles", "path",
"curve": [{"budget_gib", "plan", "peak_gib", "temp_gib", "step_ms"} or
{"budget_gib", "error"}]}.
"""

from __future__ import annotations

import json

from absl import app, flags

flags.DEFINE_string("config", "tiny", "preset")
flags.DEFINE_string("override", "", "section.field=value,... (model.kind=teacher is required)")
flags.DEFINE_string("budgets", "", "comma-separated budgets in GiB (default: --fractions)")
flags.DEFINE_string("fractions", "1.0,0.8,0.6,0.4", "budgets as fractions of the baseline peak")
flags.DEFINE_string("regions", "", "regions the planner may change (default: all)")
flags.DEFINE_string("policies", "", "policies it may use (default: every one the backend has)")
flags.DEFINE_integer("steps", 5, "timed steps per plan")
flags.DEFINE_bool("smoke", False, "tiny teacher, the pyramid region, recompute only: a CPU check")
flags.DEFINE_string("out", "", "JSON output path")

SMOKE_OVERRIDE = ("model.kind=teacher,model.interformer_layers=1,model.pyramid_levels=16:2:1,"
                  "data.batch_size=32")


def _row(m, budget_gib: float) -> dict:
    from gemjax.train.remat import GIB
    return {"budget_gib": budget_gib, "plan": m.plan, "peak_gib": m.peak_bytes / GIB,
            "temp_gib": m.temp_bytes / GIB, "host_gib": m.host_bytes / GIB, "step_ms": m.step_s * 1e3}


def curve(path, budgets_gib: list[float]) -> list[dict]:
    """One row per budget: the chosen plan's figures, or the planner's error."""
    from gemjax.train.remat import GIB, choose
    rows = []
    for b in budgets_gib:
        try:
            rows.append(_row(choose(path, b * GIB), b))
        except ValueError as e:
            rows.append({"budget_gib": b, "error": str(e)})
    return rows


def main(argv):
    del argv
    from gemjax.train import runtime
    runtime.enable_gpu_graphs()     # before any device use, as experiments/train.py
    import jax

    from gemjax.config import get_config
    from gemjax.train import remat

    f = flags.FLAGS
    config, override = f.config, f.override
    regions, policies, steps = f.regions, f.policies, f.steps
    if f.smoke:
        config, override = "tiny", ",".join(x for x in (SMOKE_OVERRIDE, override) if x)
        regions, policies, steps = regions or "pyramid", policies or "recompute", 1
    cfg = get_config(config, override)
    if cfg.model.kind != "teacher":
        raise app.UsageError("--override must set model.kind=teacher (the regions are the teacher's)")
    measurer = remat.StepMeasurer(cfg, steps=steps, batches=1 if f.smoke else 2)
    path = remat.plan_path(measurer, regions=tuple(regions.split(",")) if regions else remat.REGIONS,
                           policies=tuple(policies.split(",")) if policies else None)
    base = path.baseline.peak_bytes / remat.GIB
    budgets = ([float(b) for b in f.budgets.split(",")] if f.budgets
               else [float(x) * base for x in f.fractions.split(",")])
    rows = curve(path, budgets)
    print(remat.table(path))
    print()
    print(f"{'budget GiB':>10} {'peak GiB':>9} {'step ms':>9}  plan")
    for r in rows:
        if "error" in r:
            print(f"{r['budget_gib']:>10.4f} {'-':>9} {'-':>9}  infeasible: {r['error']}")
        else:
            print(f"{r['budget_gib']:>10.4f} {r['peak_gib']:>9.4f} {r['step_ms']:>9.2f}  {r['plan']}")
    if f.out:
        res = {"config": config, "overrides": override, "platform": jax.devices()[0].platform,
               "device_kind": jax.devices()[0].device_kind,
               "baseline": _row(path.baseline, base),
               "singles": [_row(m, base) for m in path.singles.values()],
               "path": [_row(m, base) for m in path.steps], "curve": rows}
        with open(f.out, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    app.run(main)
