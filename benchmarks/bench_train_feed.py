"""Does the feed keep the device busy? The train loop's samples/s against the step alone.

    python -m benchmarks.bench_train_feed --out=runs/train_feed.json

For each case (--cases; default movielens_rank and h200), in this one process:

  train     gemjax.train.loop.train, the loop experiments/train.py runs (Feeder threads,
            device_put, the step, a host sync per log interval), for --warmup + --steps
            steps. samples/s over the last --steps (between the host syncs of two log
            rows, compile and warm-up excluded), and the host-wait share: the time the
            loop spent blocked on the Feeder for its next batch, over that window.
            Checkpoint writes are skipped (the end-of-run save, outside the window,
            would write every table) and the eval is one batch, after the window.
  step      the same preset's jitted train step alone (as benchmarks/bench_step.py):
            --batches batches of the same source put on the devices once, then --iters
            steps cycling through them, queued back to back.
  feed      the Feeder alone (as benchmarks/bench_feed.py): --feed_steps steps built,
            checked and put on the devices, waited for one by one; no step runs.
  ratio     train samples/s / step samples/s (the acceptance asks >= 0.95).

--steps_per_call=K sets train.steps_per_call for every case: the train loop then runs
K steps per jitted call (gemjax.train.multistep) and the step alone times that same
program (MultiStep on --batches stacked groups of K batches), so both rates are of one
program; --warmup, --steps and --log_every must be multiples of K.

Cases: "movielens_rank" trains the movielens_rank preset on a MovieLens-shaped Parquet
dataset (benchmarks/movielens_shaped.py: the ranking converter's schema, row layout and
history lengths, random ids), written under --data_dir unless it is already there, or
on --movielens_dir (convert_movielens.py --tasks=ranking output, e.g. the real data).
Any other name is a preset trained on its synthetic stream (h200: the model v0 of the
preset; --case_override=h200:model.kind=teacher,model.num_experts=4,model.top_k=2
for docs/performance.md's teacher). --case_override=CASE:OVERRIDES (repeatable) applies on top
of a case's preset.

On GPU the run uses CUDA graphs unless GEMJAX_GPU_GRAPHS=0, and packed shard copies unless
GEMJAX_FEED_PACK=0 (gemjax.train.runtime, gemjax.data.feeding); the train loop runs with the
GIL switch interval of $GEMJAX_GIL_SWITCH_US (gemjax.train.runtime.short_gil_switch; 5000 is
Python's default); all three are printed with the table.

Per-case errors are recorded and the next case runs. Writes everything to --out (JSON);
the table is printed last.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import re
import shutil
import tempfile
import time
import traceback

from absl import app, flags, logging

PARQUET_CASES = ("movielens_rank",)
STEP_LINE = re.compile(r"^step\s+(\d+)/")


def define_flags():
    """The command line's flags (defined when run as a script)."""
    flags.DEFINE_list("cases", ["movielens_rank", "h200"], "presets to measure")
    flags.DEFINE_multi_string("case_override", [], "CASE:section.field=value,... (repeatable)")
    flags.DEFINE_integer("warmup", 40, "train steps before the timed window (compile included)")
    flags.DEFINE_integer("steps", 200, "timed train steps (a multiple of --log_every)")
    flags.DEFINE_integer("log_every", 20, "train steps per log row (one host sync each)")
    flags.DEFINE_integer("iters", 100, "timed steps of the step alone")
    flags.DEFINE_integer("batches", 3, "distinct device batches the step alone cycles through")
    flags.DEFINE_integer("feed_steps", 20, "timed steps of the Feeder alone (0: skip)")
    flags.DEFINE_string("data_dir", "", "MovieLens-shaped data (default: under --workdir)")
    flags.DEFINE_string("movielens_dir", "", "train movielens_rank on this converted ranking "
                        "directory (schema.json, train.parquet, test.parquet) instead")
    flags.DEFINE_string("workdir", "", "scratch directory (default: a temporary one, removed)")
    flags.DEFINE_integer("steps_per_call", 1, "train.steps_per_call of every case (K steps "
                         "per jitted call in the loop and in the step alone)")
    flags.DEFINE_integer("cpu_devices", 0, "simulate this many CPU devices (0: the real devices)")
    flags.DEFINE_string("out", "", "JSON output path")


def case_config(case: str, overrides: str, data_dir: str, warmup: int, steps: int,
                log_every: int, steps_per_call: int = 1):
    """The Config a case trains: its preset (on `data_dir`'s Parquet files for a Parquet
    case), --warmup + --steps steps, a log row every log_every, one eval batch and the
    only eval and save at the end (no model selection), steps_per_call steps per jitted call."""
    from gemjax.config import apply_overrides, get_config
    from gemjax.features import FeatureSchema
    cfg = get_config(case)
    if case in PARQUET_CASES:
        with open(os.path.join(data_dir, "schema.json")) as f:
            cfg = dataclasses.replace(cfg, features=FeatureSchema.from_dict(json.load(f)))
        cfg = apply_overrides(cfg, f"data.source=parquet,data.train_path={data_dir}/train.parquet,"
                                   f"data.eval_path={data_dir}/test.parquet")
    total = warmup + steps
    cfg = apply_overrides(cfg, f"data.eval_batches=1,train.steps={total},"
                               f"train.log_every={log_every},train.eval_every={total},"
                               f"train.checkpoint_every={total},train.tensorboard=false,"
                               f"train.baselines=false,train.steps_per_call={steps_per_call},"
                               # throughput only: no model selection (no validation rows)
                               f"train.select_metric=,train.patience=0,train.valid_every=0")
    return apply_overrides(cfg, overrides) if overrides else cfg


def time_train(cfg, workdir: str, warmup: int) -> dict:
    """train() with the Feeder's waits and the log rows timed; checkpoint writes skipped."""
    import gemjax.train.loop as loop
    from gemjax.data.feeding import Feeder

    waits: list[tuple[float, float]] = []       # (blocked from, until) per next batch
    synced: dict[int, float] = {}               # step -> time its log row was written
    untimed = Feeder.batches        # the loop's Feeder or StackedFeeder (steps_per_call > 1)

    def timed_batches(self, start, stop_step):
        it = untimed(self, start, stop_step)
        while True:
            t = time.perf_counter()
            try:
                item = next(it)
            except StopIteration:
                return
            waits.append((t, time.perf_counter()))
            yield item

    def log(line: str) -> None:
        m = STEP_LINE.match(line)
        if m:
            synced[int(m.group(1))] = time.perf_counter()

    saved = loop.save_train_state
    Feeder.batches, loop.save_train_state = timed_batches, lambda *a, **k: True
    try:
        t0 = time.perf_counter()
        summary = loop.train(cfg, workdir, log=log)
        wall = time.perf_counter() - t0
    finally:
        Feeder.batches, loop.save_train_state = untimed, saved
    first = min((s for s in synced if s >= warmup), default=None)
    last = max(synced, default=None)
    if first is None or last is None or last <= first:
        raise RuntimeError(f"no timed window: log rows at steps {sorted(synced)}, warm-up {warmup}")
    a, b = synced[first], synced[last]
    waited = sum(max(0.0, min(e, b) - max(s, a)) for s, e in waits)
    samples = (last - first) * cfg.data.batch_size
    return {"window_steps": [first, last], "samples_per_s": samples / (b - a),
            "ms_per_step": 1e3 * (b - a) / (last - first), "host_wait_share": waited / (b - a),
            "meter_samples_per_s": summary.get("samples_per_sec"), "wall_s": wall,
            "eval_auc": summary.get("eval_auc")}


def time_step(cfg, iters: int, batches: int) -> dict:
    """The jitted train step alone on device-resident batches of the case's source
    (train.steps_per_call K > 1: the K-step program on `batches` groups of K batches,
    `iters` calls; ms_per_step and samples/s are per step)."""
    import jax
    import numpy as np

    from gemjax.train import multistep
    from gemjax.data.source import make_source
    from gemjax.train.step import Trainer

    k = cfg.train.steps_per_call
    trainer = Trainer.create(cfg)
    state = trainer.init_state(cfg.train.seed)
    source = make_source(cfg, "train")
    feeder = multistep.feeder(k, source.shard_batch, trainer.mesh,
                              check_ids=trainer.coll.check_ids, id_fields=trainer.id_fields)
    it = feeder.batches(0, batches * k)
    device = [b for _, b, _, _ in it]      # placed as the train loop's (stacked for K > 1)
    hosts = [feeder.host_batch(i) for i in range(batches * k)]
    step = trainer.make_train_step() if k == 1 else multistep.MultiStep(trainer, k)
    t0 = time.perf_counter()
    for i in range(batches):         # compile, and every batch's sparse branch plan
        state, m = step(state, device[i], next_batch=device[(i + 1) % batches])
    jax.block_until_ready((state, m))
    warm = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(iters):
        state, m = step(state, device[i % batches], next_batch=device[(i + 1) % batches])
    jax.block_until_ready((state, m))
    sec = (time.perf_counter() - t0) / iters / k
    tokens = float(np.mean([h[2] for h in hosts]))
    return {"samples_per_s": cfg.data.batch_size / sec, "ms_per_step": 1e3 * sec,
            "tokens_per_batch": tokens, "compile_and_warmup_s": warm,
            "loss": float(np.ravel(m["loss"])[-1]), "steps_per_call": k}


def time_feed(cfg, steps: int) -> dict:
    """The Feeder alone (cfg.data.host_workers threads; with train.steps_per_call K > 1 the
    StackedFeeder, `steps` rounded up to calls of K): ms per step, process CPU ms."""
    import jax

    from gemjax.data.source import make_source
    from gemjax.train import multistep
    from gemjax.train.step import Trainer

    k = cfg.train.steps_per_call
    calls = -(-steps // k)
    trainer = Trainer.create(cfg)        # the id check and fields only: no tables allocated
    source = make_source(cfg, "train")
    feeder = multistep.feeder(k, source.shard_batch, trainer.mesh,
                              check_ids=trainer.coll.check_ids, id_fields=trainer.id_fields,
                              workers=cfg.data.host_workers)
    it = feeder.batches(0, (calls + 2) * k)
    for _ in range(2):
        jax.block_until_ready(next(it)[1])
    t, c = time.perf_counter(), time.process_time()
    for _, batch, _, _ in it:
        jax.block_until_ready(batch)
    return {"ms_per_step": 1e3 * (time.perf_counter() - t) / (calls * k),
            "cpu_ms_per_step": 1e3 * (time.process_time() - c) / (calls * k),
            "workers": cfg.data.host_workers}


def run_case(case: str, overrides: str, data_dir: str, workdir: str, f) -> dict:
    cfg = case_config(case, overrides, data_dir, f.warmup, f.steps, f.log_every, f.steps_per_call)
    row = {"case": case, "overrides": overrides, "batch": cfg.data.batch_size,
           "steps_per_call": cfg.train.steps_per_call,
           "model": cfg.model.kind, "host_workers": cfg.data.host_workers,
           "source": cfg.data.source, "data": data_dir if case in PARQUET_CASES else None}
    print(f"[{case}] train loop: {f.warmup} + {f.steps} steps", flush=True)
    row["train"] = time_train(cfg, os.path.join(workdir, case), f.warmup)
    gc.collect()                           # the run's state and tables go before the next
    print(f"[{case}] step alone: {f.iters} steps", flush=True)
    row["step"] = time_step(cfg, f.iters, f.batches)
    gc.collect()
    if f.feed_steps:
        print(f"[{case}] feeder alone: {f.feed_steps} steps", flush=True)
        row["feed"] = time_feed(cfg, f.feed_steps)
    row["ratio"] = row["train"]["samples_per_s"] / row["step"]["samples_per_s"]
    return row


def table(rows: list[dict]) -> str:
    lines = [f"{'case':16s} {'model':8s} {'batch':>6s} {'train/s':>10s} {'step/s':>10s} "
             f"{'ratio':>6s} {'host wait':>9s} {'train ms':>9s} {'step ms':>8s} {'feed ms':>8s}"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['case']:16s} error: {r['error']}")
            continue
        feed = f"{r['feed']['ms_per_step']:8.1f}" if "feed" in r else f"{'-':>8s}"
        lines.append(f"{r['case']:16s} {r['model']:8s} {r['batch']:6d} "
                     f"{r['train']['samples_per_s']:10,.0f} {r['step']['samples_per_s']:10,.0f} "
                     f"{r['ratio']:6.3f} {r['train']['host_wait_share']:9.1%} "
                     f"{r['train']['ms_per_step']:9.1f} {r['step']['ms_per_step']:8.1f} {feed}")
    return "\n".join(lines)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    f = flags.FLAGS
    if f.steps < f.log_every or f.steps % f.log_every or f.warmup < f.log_every \
            or f.warmup % f.log_every:
        raise app.UsageError("--steps and --warmup must be multiples of --log_every (>= 1 each)")
    if f.steps_per_call < 1 or f.log_every % f.steps_per_call:
        raise app.UsageError(f"--log_every ({f.log_every}) must be a multiple of --steps_per_call "
                             f"({f.steps_per_call} >= 1)")
    if f.iters < 1 or f.batches < 1 or f.feed_steps < 0:
        raise app.UsageError("--iters and --batches must be >= 1, --feed_steps >= 0")
    overrides = {}
    for item in f.case_override:
        case, sep, over = item.partition(":")
        if not sep or case not in f.cases:
            raise app.UsageError(f"--case_override={item!r}: expected CASE:OVERRIDES with CASE "
                                 f"one of --cases {f.cases}")
        overrides[case] = ",".join(x for x in (overrides.get(case), over) if x)
    logging.set_verbosity(logging.WARNING)
    import jax
    if f.cpu_devices:
        jax.config.update("jax_num_cpu_devices", f.cpu_devices)
    from gemjax.train import runtime
    runtime.enable_gpu_graphs()     # before any device use, as experiments/train.py
    workdir = f.workdir or tempfile.mkdtemp(prefix="gemjax-train-feed-")
    os.makedirs(workdir, exist_ok=True)
    if not jax.config.jax_compilation_cache_dir:     # the step alone reuses train()'s compile
        jax.config.update("jax_compilation_cache_dir", os.path.join(workdir, "jax-cache"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    data_dir = f.movielens_dir
    if any(c in PARQUET_CASES for c in f.cases) and not data_dir:
        from benchmarks import movielens_shaped
        data_dir = f.data_dir or os.path.join(workdir, "ml-shaped")
        if not os.path.exists(os.path.join(data_dir, "counts.json")):
            print(f"writing the MovieLens-shaped dataset to {data_dir}", flush=True)
            movielens_shaped.write(data_dir)
    from gemjax.data.feeding import pack_default
    facts = {"devices": [str(d) for d in jax.devices()], "device_kind": jax.devices()[0].device_kind,
             "host_cores": os.cpu_count(), "xla_flags": os.environ.get("XLA_FLAGS", ""),
             "feed_pack": pack_default(), "warmup": f.warmup, "steps": f.steps,
             "log_every": f.log_every, "iters": f.iters, "batches": f.batches,
             "steps_per_call": f.steps_per_call, "gil_switch_us": runtime.gil_switch_us()}
    rows = []
    t0 = time.perf_counter()
    for case in f.cases:
        try:
            rows.append(run_case(case, overrides.get(case, ""), data_dir, workdir, f))
        except Exception as e:      # noqa: BLE001  the next case still runs
            traceback.print_exc()
            rows.append({"case": case, "error": f"{type(e).__name__}: {e}"[:300]})
        if f.out:
            os.makedirs(os.path.dirname(os.path.abspath(f.out)), exist_ok=True)
            with open(f.out, "w") as fh:
                json.dump({**facts, "rows": rows, "seconds": time.perf_counter() - t0}, fh,
                          indent=1)
    if not f.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"\ntrain loop vs step alone, {len(jax.devices())} x {facts['device_kind']}, "
          f"{os.cpu_count()} host cores; {time.perf_counter() - t0:.0f} s"
          + (f"; {f.out}" if f.out else ""))
    print(f"feed packed: {facts['feed_pack']}; steps per call: {f.steps_per_call}; "
          f"GIL switch: {facts['gil_switch_us']} us; XLA_FLAGS: {facts['xla_flags'] or '(none)'}")
    print(table(rows))


if __name__ == "__main__":
    define_flags()
    app.run(main)
