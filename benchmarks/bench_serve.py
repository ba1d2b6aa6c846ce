"""Serving figures of a distilled student next to its teacher: the exported programs
(jax.export StableHLO through gemjax.serve.export) and the jitted models of the same
checkpoints, per batch size, with each model's eval NE.

    python -m benchmarks.bench_serve --teacher=runs/distill/synthetic/teacher_s0 \\
        --student=runs/distill/synthetic/students/all_s0 --batches=1,64,1024

Per model (--teacher, --student: run workdirs; a student made by experiments/distill.py
or gemjax.distill.runs.train_student) and batch size B:
  exported  the model exported for B (export_model; a student: export_student, whose
            repr variant computes the teacher's features inside) and read back with
            load_exported; timed: the deserialized program's call, compiled once (jit),
            on arguments already on the device (params, tables, the batch's leaves);
  jitted    the run's eval step on a batch already placed (load_for_inference; a
            student: load_student, whose repr variant takes the teacher's features
            through the host first, as its training's eval does).
Each row: p50 and p99 latency (ms, each call blocked on) over --iters calls after
--warmup, throughput (B / mean latency, samples/s), and the model's eval NE
(summary.json's eval_ne), so the student's NE stands next to the teacher's. The batch is
the eval stream's first batch at data.batch_size=B, one shard. Writes --out (JSON: rows,
eval NE per model, the device) and prints a table.
"""

from __future__ import annotations

import json
import os
import tempfile
import time

from absl import app, flags, logging

flags.DEFINE_string("teacher", None, "the teacher's run workdir")
flags.DEFINE_string("student", None, "the student's run workdir")
flags.DEFINE_list("batches", ["1", "64", "1024"], "batch sizes")
flags.DEFINE_integer("warmup", 5, "untimed calls per figure")
flags.DEFINE_integer("iters", 100, "timed calls per figure")
flags.DEFINE_string("export_dir", "", "where the exports go (default: a temporary directory)")
flags.DEFINE_string("out", "bench_serve.json", "JSON output")


def latencies_ms(fn, warmup: int, iters: int) -> list[float]:
    """ms of each of `iters` calls of fn() (blocked on), after `warmup` untimed calls."""
    import jax
    for _ in range(warmup):
        jax.block_until_ready(fn())
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        out.append(1e3 * (time.perf_counter() - t0))
    return out


def figures(ms: list[float], batch: int) -> dict:
    """p50 / p99 ms and samples/s (batch / mean latency) of per-call latencies."""
    import numpy as np
    p50, p99 = np.percentile(ms, [50, 99])
    return {"p50_ms": float(p50), "p99_ms": float(p99),
            "samples_per_s": batch / (float(np.mean(ms)) / 1e3)}


def example_batch(cfg, batch: int):
    """The eval stream's first batch of `batch` samples on one shard."""
    from gemjax.config import apply_overrides
    from gemjax.data.source import make_source
    b, _ = make_source(apply_overrides(cfg, f"data.batch_size={batch}"), "eval").shard_batch(0, 0, 1)
    return b


def bench_model(name: str, workdir: str, batches: list[int], export_root: str, warmup: int,
                iters: int) -> list[dict]:
    """Rows of `name` (the run in `workdir`): jitted and exported, per batch size."""
    import jax
    from gemjax.serve.export import export_model, flatten_by_path, load_exported
    from gemjax.serve.inference import load_for_inference
    student = os.path.isfile(os.path.join(workdir, "student.json"))
    if student:
        from gemjax.distill.runs import export_student, load_student
    pred = (load_student if student else load_for_inference)(workdir)
    rows = []
    for b in batches:
        batch = example_batch(pred.cfg, b)
        placed = pred.place(batch)
        ms = latencies_ms(lambda: pred.eval_step(pred.state, placed), warmup, iters)
        rows.append({"model": name, "batch": b, "path": "jitted", **figures(ms, b)})
        out = os.path.join(export_root, f"{name}_b{b}")
        (export_student if student else export_model)(workdir, out, batch=batch,
                                                      log=lambda s: None)
        model = load_exported(out)
        args = jax.device_put((model.params, model.tables, flatten_by_path(batch)))
        call = jax.jit(model.exported.call)     # compiled once, as a server would
        ms = latencies_ms(lambda: call(*args), warmup, iters)
        rows.append({"model": name, "batch": b, "path": "exported", **figures(ms, b)})
        print(f"[bench_serve] {name} batch {b}: jitted p50 {rows[-2]['p50_ms']:.3f} ms, "
              f"exported p50 {rows[-1]['p50_ms']:.3f} ms", flush=True)
    return rows


def eval_ne(workdir: str) -> float | None:
    path = os.path.join(workdir, "summary.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f).get("eval_ne")


def table(rows: list[dict], ne: dict) -> str:
    lines = ["| model | batch | path | p50 ms | p99 ms | samples/s | eval NE |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        n = ne.get(r["model"])
        lines.append(f"| {r['model']} | {r['batch']} | {r['path']} | {r['p50_ms']:.3f} | "
                     f"{r['p99_ms']:.3f} | {r['samples_per_s']:,.0f} | "
                     f"{'' if n is None else f'{n:.4f}'} |")
    return "\n".join(lines)


def main(argv):
    del argv
    f = flags.FLAGS
    if not f.teacher or not f.student:
        raise app.UsageError("--teacher and --student name the run workdirs to serve")
    for flag in ("teacher", "student"):
        if not os.path.isfile(os.path.join(getattr(f, flag), "config.json")):
            raise app.UsageError(f"--{flag}={getattr(f, flag)}: no config.json there (not a "
                                 f"gemjax run directory)")
    try:
        batches = [int(b) for b in f.batches]
    except ValueError:
        raise app.UsageError(f"--batches={','.join(f.batches)}: expected integers") from None
    if not batches or min(batches) < 1 or f.iters < 1 or f.warmup < 0:
        raise app.UsageError("--batches must be positive, --iters >= 1, --warmup >= 0")
    logging.set_verbosity(logging.WARNING)      # orbax's per-restore info lines
    import jax
    root = f.export_dir or tempfile.mkdtemp(prefix="bench_serve-")
    rows = []
    for name in ("teacher", "student"):
        rows += bench_model(name, getattr(f, name), batches, root, f.warmup, f.iters)
    ne = {name: eval_ne(getattr(f, name)) for name in ("teacher", "student")}
    text = table(rows, ne)
    with open(f.out, "w") as fh:
        json.dump({"rows": rows, "eval_ne": ne, "device": jax.devices()[0].device_kind,
                   "teacher": os.path.abspath(f.teacher), "student": os.path.abspath(f.student),
                   "warmup": f.warmup, "iters": f.iters, "exports": root}, fh, indent=1)
    print(text)


if __name__ == "__main__":
    app.run(main)
