"""Eval NE of the synthetic run under several activation-checkpointing plans, against a
reference plan, on the same seeds: what FP8-kept saved activations (train.remat
"region:quantize", gemjax.precision.saved) cost in NE, and what they save in memory.

    python -m benchmarks.bench_saved_ne --out=saved_ne.json          # the protocol, CPU
    python -m benchmarks.bench_saved_ne --smoke --out=/tmp/s.json     # a CI check, ~1 min
    python -m benchmarks.bench_saved_ne --plans=none,all:recompute,none@model.precision=fp8

A plan is a train.remat value, optionally followed by config overrides after "@" (one
"section.field=value" each): "none@model.precision=fp8" trains the FP8 GEMMs
(gemjax.precision.policy) against the BF16 reference "none" on the same protocol.

Each (plan, seed) trains cfg from train.seed=seed's initial state on its own synthetic
stream (the planted model, the data and the init all follow the seed) for train.steps
steps, then evaluates on the seed's eval stream, as gemjax.train.loop.train does (its
Evaluator; the same batches, the same order): the eval NE is the one train() writes. A
plan is compiled once (one Trainer, train and eval steps) and trains every seed.

Delta: (NE(plan) - NE(reference)) / NE(reference) per seed, the reference being the first
of --plans ("none": autodiff keeps what it needs). `all:recompute` computes the gradients
of "none" up to float32 rounding, so its deltas are the protocol's noise floor: how far
rounding differences grow through training. (On CPU, recompute of the attention,
interaction and heads regions gives bit-identical gradients; that of pyramid, cross and
seq, the regions holding the softmax-pooling cross attentions, differs in the last bits,
relative L2 1e-7 to 5e-7: XLA fuses the recomputed forward with the backward around it
differently, while masked_softmax_av alone under jax.checkpoint is bit-identical.)
The table's "floor x" column is each plan's largest |delta| over the floor's; a plan
whose deltas stay within the floor is not resolved from rounding by this run. Memory:
temp bytes of the compiled train step (memory_analysis) and their saving against the
reference's. Step time: mean of --time_steps calls of the compiled step after training
seed `seeds[0]` (informative; CPU times say little about a GPU).

The protocol (PROTOCOL_OVERRIDE on the tiny preset): the teacher at batch 256, 150 steps,
16 eval batches (4,096 samples), a small sparse learning rate. Row-wise Adagrad moves a
first-touched row by about sparse_lr per element whatever its gradient's size and Adam
moves every parameter by about dense_lr, so float32 rounding differences grow several-fold
per step at tiny's rates (0.1 / 2e-3): a relative 1e-7 change of the dense parameters
reaches 0.16 in the tables within 10 steps at 0.05 / 2e-4. At 0.005 / 1e-3 it grows
about 1.1x per step, and the floor after 150 steps is still 0.01-0.2% of NE per seed.
Runs short or slow enough to keep it under 0.01% learn too little to be a test (NE
0.996-1.01, Bayes 0.684).

Prints one row per (plan, seed), then the table (per plan: each seed's delta, mean and
largest |delta|, floor multiple, temp MiB and saving, step ms) last. JSON (--out):
{"config", "overrides", "platform", "device_kind", "reference", "floor_plan", "seeds",
"runs": [{"plan", "seed", "ne", "auc", "delta"}], "plans": [{"plan", "temp_bytes",
"temp_saved", "step_ms", "deltas", "mean_delta", "max_abs_delta", "floor_multiple"}]}.
"""

from __future__ import annotations

import json
import time

from absl import app, flags

flags.DEFINE_string("config", "tiny", "preset")
flags.DEFINE_string("override", "", "section.field=value,... applied after the protocol's")
flags.DEFINE_bool("protocol", True, "apply PROTOCOL_OVERRIDE before --override")
flags.DEFINE_string("plans", "", "comma-separated train.remat plans (each optionally with "
                    "@section.field=value overrides), the first the reference "
                    "(default: DEFAULT_PLANS)")
flags.DEFINE_string("seeds", "0,1,2", "comma-separated train.seed values")
flags.DEFINE_string("floor_plan", "all:recompute", "the plan whose deltas are the noise floor "
                    "(rounding only); the floor column is empty when it is not in --plans")
flags.DEFINE_integer("time_steps", 5, "timed calls of the compiled step per plan")
flags.DEFINE_bool("smoke", False, "a small teacher for a few steps, one seed: a CI check")
flags.DEFINE_string("out", "", "JSON output path")

PROTOCOL_OVERRIDE = ("model.kind=teacher,data.batch_size=256,data.eval_batches=16,train.steps=150,"
                     "train.warmup_steps=20,train.dense_lr=1e-3,train.sparse_lr=0.005")
DEFAULT_PLANS = "none,all:recompute,pyramid:quantize,seq:quantize/attention:quantize,all:quantize"
SMOKE_OVERRIDE = ("model.kind=teacher,model.interformer_layers=1,model.pyramid_levels=16:2:1,"
                  "model.summary_tokens=2,model.cls_tokens=1,model.pma_tokens=1,model.recent_tokens=1,"
                  "model.fmb_tokens=2,model.lcb_tokens=2,data.batch_size=16,data.eval_batches=1,"
                  "train.steps=3,train.warmup_steps=1,train.dense_lr=1e-3,train.sparse_lr=0.005")
SMOKE_PLANS = "none,all:quantize"


def train_and_eval(trainer, train_step, eval_step, cfg, seed: int) -> tuple[dict, dict]:
    """(eval metrics, final state): cfg trained from init_state(seed) on seed's stream for
    cfg.train.steps steps, evaluated on seed's eval stream (gemjax.train.loop.Evaluator)."""
    import dataclasses

    from gemjax.data.feeding import Feeder
    from gemjax.data.source import make_source
    from gemjax.train.loop import Evaluator

    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seed=seed))
    state = trainer.init_state(seed)
    feeder = Feeder(make_source(cfg, "train", seed=seed).shard_batch, trainer.mesh, prefetch=0)
    steps = cfg.train.steps
    nxt = feeder.to_device(feeder.host_batch(0)[0])
    for i in range(steps):
        batch = nxt
        nxt = feeder.to_device(feeder.host_batch(i + 1)[0]) if i + 1 < steps else None
        state, _ = train_step(state, batch, next_batch=nxt)
    evaluator = Evaluator(trainer, cfg)
    evaluator.step_fn = eval_step             # one compiled eval step for every seed
    return evaluator(state), state


def plan_overrides(plan: str) -> dict[str, str]:
    """"remat[@section.field=value...]" -> the config overrides of that plan."""
    remat, *extra = plan.split("@")
    out = {"train.remat": remat}
    for item in extra:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"plan {plan!r}: {item!r} is not section.field=value")
        out[key] = value
    return out


def measure_plan(cfg, plan: str, seeds: list[int], time_steps: int, log=print) -> tuple[list[dict], dict]:
    """(one run row per seed, the plan's figures): the plan compiled once (train and eval
    steps), every seed trained and evaluated, then its memory and step time."""
    import jax

    from gemjax.config import apply_overrides
    from gemjax.data.feeding import Feeder
    from gemjax.data.source import make_source
    from gemjax.train.step import Trainer

    pcfg = apply_overrides(cfg, plan_overrides(plan))
    trainer = Trainer.create(pcfg)
    train_step, eval_step = trainer.make_train_step(), trainer.make_eval_step()
    runs, state = [], None
    for seed in seeds:
        t0 = time.perf_counter()
        res, state = train_and_eval(trainer, train_step, eval_step, pcfg, seed)
        runs.append({"plan": plan, "seed": seed, "ne": float(res["ne"]), "auc": float(res["auc"])})
        log(f"{plan:<40} seed {seed}: NE {res['ne']:.6f} AUC {res['auc']:.4f} "
            f"({time.perf_counter() - t0:.0f} s)")
    feeder = Feeder(make_source(pcfg, "train", seed=seeds[0]).shard_batch, trainer.mesh, prefetch=0)
    batch = feeder.to_device(feeder.host_batch(0)[0])
    mem = train_step.lower(state, batch).compile().memory_analysis()
    state, m = train_step(state, batch, next_batch=batch)        # warm
    jax.block_until_ready((state, m))
    t0 = time.perf_counter()
    for _ in range(time_steps):
        state, m = train_step(state, batch, next_batch=batch)
    jax.block_until_ready((state, m))
    step_ms = (time.perf_counter() - t0) / max(time_steps, 1) * 1e3
    return runs, {"plan": plan, "temp_bytes": int(mem.temp_size_in_bytes), "step_ms": step_ms}


def summarize(runs: list[dict], figures: list[dict], reference: str,
              floor_plan: str | None = None) -> list[dict]:
    """Per plan: each seed's relative NE delta against the reference plan's same seed
    (written into the run rows as "delta"), their mean and largest magnitude, that
    magnitude over floor_plan's ("floor_multiple"; None without a floor plan or when its
    deltas are all 0), and the temp bytes saved against the reference's."""
    ref_ne = {r["seed"]: r["ne"] for r in runs if r["plan"] == reference}
    ref_temp = next(f["temp_bytes"] for f in figures if f["plan"] == reference)
    out = []
    for f in figures:
        mine = [r for r in runs if r["plan"] == f["plan"]]
        for r in mine:
            r["delta"] = (r["ne"] - ref_ne[r["seed"]]) / ref_ne[r["seed"]]
        deltas = [r["delta"] for r in mine]
        out.append({**f, "temp_saved": 1.0 - f["temp_bytes"] / ref_temp,
                    "deltas": deltas, "mean_delta": sum(deltas) / len(deltas),
                    "max_abs_delta": max(abs(d) for d in deltas)})
    floor = next((p["max_abs_delta"] for p in out if p["plan"] == floor_plan), 0.0)
    for p in out:
        p["floor_multiple"] = p["max_abs_delta"] / floor if floor > 0 else None
    return out


def table(plans: list[dict], seeds: list[int]) -> str:
    """The figures, one row per plan (deltas in percent of the reference's NE)."""
    head = (f"{'plan':<40} " + " ".join(f"{'seed ' + str(s):>9}" for s in seeds) +
            f" {'mean %':>9} {'max|%|':>8} {'floor x':>7} {'temp MiB':>9} {'saved':>6} {'step ms':>8}")
    lines = [head]
    for p in plans:
        lines.append(f"{p['plan']:<40} " + " ".join(f"{d * 100:>+9.4f}" for d in p["deltas"]) +
                     f" {p['mean_delta'] * 100:>+9.4f} {p['max_abs_delta'] * 100:>8.4f} "
                     f"{'-' if p['floor_multiple'] is None else format(p['floor_multiple'], '.2f'):>7} "
                     f"{p['temp_bytes'] / 2 ** 20:>9.2f} {p['temp_saved'] * 100:>5.1f}% "
                     f"{p['step_ms']:>8.2f}")
    return "\n".join(lines)


def main(argv):
    del argv
    from gemjax.train import runtime
    runtime.enable_gpu_graphs()     # before any device use, as experiments/train.py
    import jax

    from gemjax.config import apply_overrides, get_config

    f = flags.FLAGS
    base = SMOKE_OVERRIDE if f.smoke else (PROTOCOL_OVERRIDE if f.protocol else "")
    override = ",".join(x for x in (base, f.override) if x)
    plans = (f.plans or (SMOKE_PLANS if f.smoke else DEFAULT_PLANS)).split(",")
    seeds = [int(s) for s in f.seeds.split(",")][: 1 if f.smoke else None]
    cfg = get_config(f.config, override)
    if cfg.model.kind != "teacher":
        raise app.UsageError("--override must keep model.kind=teacher (the regions are the teacher's)")
    for plan in plans:                   # every plan's overrides checked before any training
        try:
            apply_overrides(cfg, plan_overrides(plan.strip()))
        except (ValueError, TypeError) as e:
            raise app.UsageError(f"--plans: {plan!r}: {e}") from None
    runs, figures = [], []
    for plan in plans:
        r, fig = measure_plan(cfg, plan.strip(), seeds, f.time_steps)
        runs += r
        figures.append(fig)
    floor_plan = f.floor_plan if f.floor_plan in plans else None
    rows = summarize(runs, figures, plans[0], floor_plan)
    print(f"\nreference {plans[0]}: NE " + " ".join(
        f"{r['ne']:.6f}" for r in runs if r["plan"] == plans[0]) +
        f" (seeds {','.join(map(str, seeds))}); deltas relative to it, in %")
    print(table(rows, seeds))
    if f.out:
        res = {"config": f.config, "overrides": override, "platform": jax.devices()[0].platform,
               "device_kind": jax.devices()[0].device_kind, "reference": plans[0],
               "floor_plan": floor_plan, "seeds": seeds,
               "runs": runs, "plans": rows}
        with open(f.out, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    app.run(main)
