"""Host input pipeline throughput: the train loop's Feeder alone, no train step.

    python -m benchmarks.bench_feed --config=h200 --workers=1,2,4,8          # on the GPU host
    python -m benchmarks.bench_feed --config=small --cpu_devices=2 --steps=10
    python -m benchmarks.bench_feed --config=movielens_rank --features=DIR/schema.json \
        --override=data.source=parquet,data.train_path=DIR/train.parquet,data.eval_path=DIR/test.parquet

For each worker count: the Feeder (gemjax.data.feeding) builds every (step, shard)
of the config's train source (gemjax.data.source.make_source: the synthetic stream,
or Parquet files with --features and data.source=parquet) in its thread pool, validates it (ids checked against the
tables as the loop does) and puts it on its device; the script waits for each
step's arrays. Reports wall ms/step, samples/s and process CPU ms/step, next to
the samples/s the devices need (--step_ms: a device step time to compare with,
e.g. 190 ms for the h200 teacher on one H200). Writes JSON (--out), table last.
"""

from __future__ import annotations

import json
import os
import time

from absl import app, flags  # noqa: E402

flags.DEFINE_string("config", "h200", "preset")
flags.DEFINE_string("override", "", "section.field=value,...")
flags.DEFINE_string("features", "", "JSON feature schema of a Parquet source (FeatureSchema.to_dict)")
flags.DEFINE_list("workers", ["1", "2", "4", "8"], "Feeder thread counts to try")
flags.DEFINE_integer("steps", 20, "timed steps per worker count (after 2 warm-up steps)")
flags.DEFINE_integer("cpu_devices", 0, "simulate this many CPU devices (0: the real devices)")
flags.DEFINE_float("step_ms", 0.0, "device step time to compare with (0: leave out)")
flags.DEFINE_string("out", "", "JSON output path")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    f = flags.FLAGS
    try:
        workers = [int(w) for w in f.workers]
    except ValueError:
        raise app.UsageError(f"--workers: integers expected, got {f.workers}") from None
    if not workers or min(workers) < 1 or f.steps < 1:
        raise app.UsageError("--workers must be >= 1 and --steps >= 1")
    import jax
    if f.cpu_devices:
        jax.config.update("jax_num_cpu_devices", f.cpu_devices)
    import dataclasses

    from gemjax.config import apply_overrides, get_config
    from gemjax.features import FeatureSchema
    from gemjax.data.feeding import Feeder
    from gemjax.data.source import make_source
    from gemjax.train.step import Trainer, default_mesh

    cfg = get_config(f.config)
    if f.features:
        with open(f.features) as fh:
            cfg = dataclasses.replace(cfg, features=FeatureSchema.from_dict(json.load(fh)))
    cfg = apply_overrides(cfg, f.override) if f.override else cfg
    mesh = default_mesh()
    trainer = Trainer.create(cfg, mesh)          # for the id check and fields only: no tables allocated
    stream = make_source(cfg, "train")
    rows = []
    for w in workers:
        feeder = Feeder(stream.shard_batch, trainer.mesh, check_ids=trainer.coll.check_ids,
                        id_fields=trainer.id_fields, workers=w)
        it = feeder.batches(0, f.steps + 2)
        for _ in range(2):
            jax.block_until_ready(next(it)[1])
        t, c = time.perf_counter(), time.process_time()
        for _, batch, _, _ in it:
            jax.block_until_ready(batch)
        wall, cpu = (time.perf_counter() - t) / f.steps, (time.process_time() - c) / f.steps
        rows.append({"workers": w, "ms_per_step": 1e3 * wall, "samples_per_s": cfg.data.batch_size / wall,
                     "cpu_ms_per_step": 1e3 * cpu})
        print(f"[feed] workers={w}: {1e3 * wall:.0f} ms/step", flush=True)
    need = cfg.data.batch_size / (f.step_ms / 1e3) if f.step_ms else None
    if f.out:
        os.makedirs(os.path.dirname(os.path.abspath(f.out)), exist_ok=True)
        with open(f.out, "w") as fh:
            json.dump({"config": f.config, "override": f.override, "features": f.features,
                       "source": cfg.data.source, "devices": mesh.size,
                       "batch": cfg.data.batch_size, "host_cores": os.cpu_count(), "step_ms": f.step_ms,
                       "needed_samples_per_s": need, "rows": rows}, fh, indent=1)
    print(f"\nfeeder, config={f.config} ({cfg.data.source}), {mesh.size} devices, batch {cfg.data.batch_size}, "
          f"{os.cpu_count()} host cores" + (f"; devices need {need:,.0f} samples/s" if need else ""))
    print(f"{'workers':>8} {'ms/step':>9} {'samples/s':>11} {'CPU ms/step':>12}")
    for r in rows:
        print(f"{r['workers']:>8} {r['ms_per_step']:>9.1f} {r['samples_per_s']:>11,.0f} {r['cpu_ms_per_step']:>12.1f}")


if __name__ == "__main__":
    app.run(main)
