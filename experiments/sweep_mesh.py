"""Sweep mesh shapes for the devices present: the real train step on each, timed, tabulated.

    python experiments/sweep_mesh.py --config=h200 --axes=replica,fsdp,expert --workdir=runs/sweep
    python experiments/sweep_mesh.py --config=tiny --cpu_devices=8 --steps=3
    python experiments/sweep_mesh.py --shapes="fsdp=4;replica=2,fsdp=2" --table_replica_axes=replica
    python experiments/sweep_mesh.py --list_only            # just the valid shapes

Per mesh shape (bench style, like experiments/bench_step.py: fixed host batches
built once, the jitted Trainer step timed on device only): step time,
samples/s, model TFLOP/s per device, E2E MFU, memory per device, and the
topology model's predicted communication time. FLOPs come from XLA's cost
analysis of the compiled step; the compiled module is the per-device program,
so the step's FLOPs are its count times the device count (sparse lookups count
~0). Memory per device: peak bytes in use where the backend reports it (GPU),
else the compiled step's arguments + outputs + temporaries (memory_analysis).
Writes WORKDIR/sweep_mesh.json and, when matplotlib imports, WORKDIR/sweep_mesh.png;
prints the table last.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

flags.DEFINE_string("config", "tiny", "preset")
flags.DEFINE_string("override", "", "section.field=value,... applied to the preset")
flags.DEFINE_string("axes", "replica,fsdp,expert", "physical axes outer to inner (name or name@tier)")
flags.DEFINE_string("shapes", "", "';'-separated mesh specs to run instead of enumerating")
flags.DEFINE_string("logical_rules", "", "logical-axis rule overrides, e.g. mlp=fsdp,embed=")
flags.DEFINE_string("table_replica_axes", "replica", "'+'-separated axes the tables are replicated over "
                    "(axes a mesh lacks, or of size 1, are dropped)")
flags.DEFINE_integer("replicate_below_bytes", None, "sparse planner: replicate tables smaller than this "
                     "(default: the planner's 32 MiB; 0 shards every table)")
flags.DEFINE_integer("devices_per_host", None, "devices per host (default: one process's devices)")
flags.DEFINE_bool("list_only", False, "print the valid shapes and exit")
flags.DEFINE_integer("steps", 10, "timed steps per shape (after 1 warm-up step)")
flags.DEFINE_integer("batches", 2, "distinct host batches cycled through")
flags.DEFINE_float("peak_flops", None, "peak FLOP/s per device (default: table by device kind)")
flags.DEFINE_string("dtype", "bf16", "peak table column")
flags.DEFINE_string("workdir", "runs/sweep_mesh", "output directory")
flags.DEFINE_integer("cpu_devices", 0, "simulate this many CPU devices (0: real devices)")

FLAGS = flags.FLAGS


def enumerate_specs(axes: str, n_devices: int, devices_per_host: int) -> list[str]:
    """All mesh spec strings over ``axes`` that fit n_devices (host-tier axes inside a host)."""
    from gemjax.parallel.mesh import parse_mesh_spec, valid_shapes
    template = parse_mesh_spec(",".join(a.replace("@", "=1@") if "@" in a else f"{a}=1"
                                        for a in axes.split(",")))
    return [",".join(f"{a.name}={s}@{a.tier}" for a, s in zip(template.axes, shape))
            for shape in valid_shapes(template, n_devices, devices_per_host)]


def short(spec: str) -> str:
    """'replica=2@cross_zone,fsdp=4@zone' -> 'replica=2,fsdp=4'."""
    return ",".join(p.split("@")[0] for p in spec.split(","))


def step_job(cfg, spec: str, rules, replica_axes: tuple[str, ...], steps: int, batches: int) -> dict:
    """Time the real train step of cfg on mesh ``spec``; returns one result row."""
    import jax
    import numpy as np

    from gemjax.data.feeding import Feeder
    from gemjax.data.synthetic import SyntheticStream
    from gemjax.parallel.mesh import build_mesh
    from gemjax.train import mfu
    from gemjax.train.step import Trainer

    mesh = build_mesh(spec, devices_per_host=FLAGS.devices_per_host)
    replica_axes = tuple(a for a in replica_axes if mesh.shape.get(a, 1) > 1)
    planner = {} if FLAGS.replicate_below_bytes is None else {"replicate_below_bytes": FLAGS.replicate_below_bytes}
    trainer = Trainer.create(cfg, mesh, rules=rules, table_replica_axes=replica_axes, **planner)
    state = trainer.init_state(0)
    feeder = Feeder(SyntheticStream(cfg.data, 0).shard_batch, mesh)
    hosts = [feeder.host_batch(i) for i in range(batches)]
    device_batches = [feeder.to_device(h[0]) for h in hosts]
    tokens = float(np.mean([h[2] for h in hosts])) * jax.process_count()   # local tokens per process
    step = trainer.make_train_step()
    t0 = time.perf_counter()
    compiled = step.lower(state, device_batches[0]).compile()
    compile_s = time.perf_counter() - t0
    flops_per_device = mfu.compiled_flops(compiled, default=float("nan"))
    mem = compiled.memory_analysis()
    compiled_bytes = None
    if mem is not None:
        compiled_bytes = int(mem.argument_size_in_bytes + mem.output_size_in_bytes
                             + mem.temp_size_in_bytes - mem.alias_size_in_bytes)
    state, m = step(state, device_batches[0])
    jax.block_until_ready(m)
    t0 = time.perf_counter()
    for i in range(steps):
        state, m = step(state, device_batches[i % len(device_batches)])
    jax.block_until_ready((state, m))
    step_s = (time.perf_counter() - t0) / steps
    stats = [d.memory_stats() or {} for d in jax.local_devices()]
    peak = max((s.get("peak_bytes_in_use", 0) for s in stats), default=0) or None
    return {"mesh": short(spec), "devices": mesh.size, "table_replica_axes": list(replica_axes),
            "table_plans": sorted({p.kind for p in trainer.coll.plans.values()}),
            "step_s": step_s, "compile_s": compile_s, "tokens_per_step": tokens,
            "step_flops": flops_per_device * mesh.size, "flops_per_device": flops_per_device,
            "peak_bytes_per_device": peak, "compiled_bytes_per_device": compiled_bytes,
            "loss": float(np.asarray(m["loss"])), "ids_overflow": int(np.asarray(m["ids_overflow"])),
            "dense_params": int(sum(x.size for x in jax.tree.leaves(state["params"])))}


def plot(rows: list[dict], path: str) -> str:
    """Bar charts of step time, samples/s, E2E MFU and memory per mesh; returns a note."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not importable: no plot written"
    ok = [r for r in rows if "error" not in r]
    names = [r["mesh"] for r in ok]
    panels = [("step ms", [r["step_s"] * 1e3 for r in ok]), ("samples/s", [r["samples_per_s"] for r in ok]),
              ("E2E MFU", [r["e2e_mfu"] or 0 for r in ok]),
              ("MB per device", [(r["peak_bytes_per_device"] or r["compiled_bytes_per_device"] or 0) / 1e6
                                 for r in ok])]
    fig, axs = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.5))
    for ax, (title, vals) in zip(axs, panels):
        ax.bar(range(len(vals)), vals)
        ax.set_xticks(range(len(vals)), names, rotation=60, ha="right", fontsize=7)
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return f"plot: {path}"


def main(argv):
    del argv
    from gemjax.parallel import multihost
    multihost.initialize(cpu_devices=FLAGS.cpu_devices or None)
    import jax

    from gemjax.config import get_config
    from gemjax.parallel import rules as rules_lib
    from gemjax.parallel import topology
    from gemjax.parallel.mesh import parse_mesh_spec
    from gemjax.train import mfu

    n = jax.device_count()
    per_host = FLAGS.devices_per_host or jax.local_device_count()
    specs = [s for s in FLAGS.shapes.split(";") if s.strip()] or enumerate_specs(FLAGS.axes, n, per_host)
    if FLAGS.list_only:
        print(f"{len(specs)} mesh shapes fit {n} devices ({per_host} per host):")
        print("\n".join(specs))
        return
    cfg = get_config(FLAGS.config, FLAGS.override)
    rules = rules_lib.parse_rules(FLAGS.logical_rules)
    replica_axes = tuple(a for a in FLAGS.table_replica_axes.split("+") if a)
    try:
        peak = mfu.peak_flops(jax.devices()[0].device_kind, dtype=FLAGS.dtype, override=FLAGS.peak_flops)
    except (KeyError, ValueError) as e:
        print(f"no peak FLOP/s ({e}); MFU left empty")
        peak = None
    b = cfg.data.batch_size
    rows = []
    for spec in specs:
        try:
            res = step_job(cfg, spec, rules, replica_axes, FLAGS.steps, FLAGS.batches)
        except Exception as e:  # noqa: BLE001 -- one failing shape (e.g. OOM) must not end the sweep
            rows.append({"mesh": short(spec), "error": f"{type(e).__name__}: {str(e)[:300]}"})
            print(f"[sweep] {short(spec)}: {rows[-1]['error']}")
            continue
        work = topology.Workload(dense_params=res["dense_params"], param_bytes=4, local_batch=max(1, b // n),
                                 forward_flops_per_sample=res["step_flops"] / 3 / b)
        pred = topology.predict(parse_mesh_spec(spec), work, peak=peak or 1.0, local_mfu=1.0,
                                net=topology.Network(gpus_per_host=per_host))
        res.update(samples_per_s=b / res["step_s"], tokens_per_s=res["tokens_per_step"] / res["step_s"],
                   tflops_per_device=res["step_flops"] / res["step_s"] / n / 1e12,
                   e2e_mfu=mfu.mfu(res["step_flops"], res["step_s"], n, peak) if peak else None,
                   predicted_comm_s=pred["comm_s"])
        rows.append(res)
        print(f"[sweep] {res['mesh']}: {res['step_s'] * 1e3:.2f} ms/step", flush=True)
    if jax.process_index() != 0:
        return
    os.makedirs(FLAGS.workdir, exist_ok=True)
    note = plot(rows, os.path.join(FLAGS.workdir, "sweep_mesh.png"))
    with open(os.path.join(FLAGS.workdir, "sweep_mesh.json"), "w") as f:
        json.dump({"flags": {k: FLAGS[k].value for k in ("config", "override", "axes", "shapes", "logical_rules",
                                                          "table_replica_axes", "steps", "batches",
                                                          "replicate_below_bytes")},
                   "device_kind": jax.devices()[0].device_kind, "devices": n, "processes": jax.process_count(),
                   "batch": b, "peak_flops": peak, "plot": note, "rows": rows}, f, indent=1)
    ok = [r for r in rows if "error" not in r]
    print(f"{'mesh':<28} {'tables':<10} {'step ms':>9} {'samples/s':>10} {'TFLOP/s/dev':>11} {'MFU':>7} "
          f"{'MB/dev':>8} {'pred comm ms':>12}")
    for r in rows:
        if "error" in r:
            print(f"{r['mesh']:<28} failed: {r['error'][:80]}")
            continue
        mfu_txt = f"{r['e2e_mfu']:.4f}" if r["e2e_mfu"] is not None else "-"
        mem = r["peak_bytes_per_device"] or r["compiled_bytes_per_device"]
        mem_txt = f"{mem / 1e6:.1f}" if mem else "-"
        print(f"{r['mesh']:<28} {'+'.join(r['table_plans']):<10} {r['step_s'] * 1e3:>9.2f} "
              f"{r['samples_per_s']:>10.0f} {r['tflops_per_device']:>11.4f} {mfu_txt:>7} {mem_txt:>8} "
              f"{r['predicted_comm_s'] * 1e3:>12.3f}")
    if ok:
        print(f"best: {min(ok, key=lambda r: r['step_s'])['mesh']}   ({note})")


if __name__ == "__main__":
    app.run(main)
