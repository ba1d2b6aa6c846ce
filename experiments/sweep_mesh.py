"""Sweep mesh shapes: the real train step on each, weak scaling, E2E and Local MFU, cost model.

    python -m experiments.sweep_mesh --config=h200 --override=model.kind=teacher --workdir=$OUT
    python -m experiments.sweep_mesh --config=tiny --override=model.kind=teacher --cpu_devices=2 --steps=2
    python -m experiments.sweep_mesh --shapes="fsdp=4;replica=2,fsdp=2" --table_replica_axes=replica
    python -m experiments.sweep_mesh --list_only            # just the valid shapes

Every sweep starts with the 1-device mesh (a sub-mesh of the first device), the
base of the scaling figures. --weak_scaling (default): the preset's
data.batch_size is the PER-DEVICE batch, global batch = it x the mesh's devices,
so each device keeps the same local batch and the same packed capacity (shard s
of step k holds the same samples on every mesh). --noweak_scaling: the preset
batch is the global batch (strong scaling).

Per mesh (bench style, like benchmarks/bench_step.py: `--batches` host batches
built once and cycled, the jitted Trainer step timed on device only; no input
pipeline in the timing): step ms, samples/s, E2E MFU, Local MFU, Scaling Ratio =
E2E / Local, weak-scaling efficiency = samples/s per device / samples/s of 1
device (from the step times alone: XLA's FLOP count of the same step varied 1.6x
between two H200 compiles, so an MFU ratio could report 0.97 where the step
times give 0.83), memory per
device (the compiled step's arguments + outputs + temporaries; XLA buffers only),
and the topology model's predicted step.

FLOPs (model.kind=teacher): E2E step FLOPs = the analytic model count of the
global batch (gemjax.perf.model_flops.batch_step_flops: matmuls and valid-pair
attention, 3 x forward, padding and embeddings not counted); Local MFU
(--local_mfu): each top-level teacher block timed alone on one device at the
per-device batch (gemjax.perf.local_mfu), the same analytic count per block.
XLA's count is kept beside it ("xla_step_flops": its cost analysis of the compiled
per-device step x devices + the Pallas attention FLOPs it cannot see,
local_mfu.step_attention_flops) but not used: on H200s it read 1,905 and 1,167
GFLOP for the same 1-GPU step in two compiles, against 4,755 analytic (it drops
GEMMs). Other models: XLA's count (flops_source says which).

Cost model (gemjax.perf.topology): a Workload from the run (dense / expert
params, embedding lookups per sample from the batches' real tokens, emb dim,
local batch, EP tokens, forward FLOPs per sample from the 1-device step), the
compute scale calibrated on the 1-device step ONLY, then the predicted step of
every other mesh vs measured (relative error), and the calibrated prediction for
--predict_gpus GPUs with the --*_gbps link speeds, on GEM's layout (expert=2
NVLink, FSDP in a zone, replicas across zones) and on the predicted-fastest shape
(topology.best_mesh).

Writes WORKDIR/sweep_mesh.json (+ sweep_mesh.png when matplotlib imports); prints
the tables last.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time

from absl import app, flags

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
flags.DEFINE_bool("with_base", True, "add the 1-device mesh when --shapes lacks one (the base of the "
                  "scaling figures and the cost model's calibration); false for quick A/B runs")
flags.DEFINE_bool("weak_scaling", True, "preset batch = per-device batch; global batch = it x devices")
flags.DEFINE_bool("local_mfu", True, "measure Local MFU (teacher blocks alone on one device)")
flags.DEFINE_integer("local_iters", 10, "timed calls per block for Local MFU")
flags.DEFINE_integer("steps", 10, "timed steps per shape (after 1 warm-up step)")
flags.DEFINE_integer("batches", 2, "distinct host batches cycled through")
flags.DEFINE_bool("save_hlo", True, "write each mesh's compiled step (optimized HLO text, with the "
                  "fusion names the profile shows) to workdir/hlo/<mesh>.txt.gz")
flags.DEFINE_integer("profile_steps", 0, "> 0: after timing, trace this many steps per mesh with "
                     "jax.profiler (WORKDIR/profile/<mesh>) and print where device time goes "
                     "(tools/profile_summary.py)")
flags.DEFINE_float("peak_flops", None, "peak FLOP/s per device (default: table by device kind)")
flags.DEFINE_string("dtype", "bf16", "peak table column")
flags.DEFINE_float("nvlink_gbps", 450.0, "cost model: NVLink GB/s per GPU per direction")
flags.DEFINE_float("roce_gbps", 50.0, "cost model: RoCE in a zone, GB/s per GPU per direction")
flags.DEFINE_float("cross_zone_gbps", 12.5, "cost model: oversubscribed cross-zone RoCE, GB/s per GPU")
flags.DEFINE_integer("gpus_per_zone", 256, "cost model: GPUs per zone")
flags.DEFINE_integer("predict_gpus_per_host", 8, "cost model: GPUs per host for the --predict_gpus table")
flags.DEFINE_string("predict_gpus", "64,1024,4096", "GPU counts of the predicted table")
flags.DEFINE_float("overlap", 0.0, "cost model: fraction of communication hidden behind compute")
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


def spec_devices(spec: str, n_available: int) -> int:
    """Devices a spec uses: the product of its sizes (all available when one is -1)."""
    from gemjax.parallel.mesh import parse_mesh_spec
    sizes = parse_mesh_spec(spec).shape
    return n_available if -1 in sizes else math.prod(sizes)


def batch_sizes(preset_batch: int, n_devices: int, weak: bool) -> tuple[int, int]:
    """(local, global) batch: weak scaling keeps the preset batch per device."""
    if weak:
        return preset_batch, preset_batch * n_devices
    if preset_batch % n_devices:
        raise ValueError(f"strong scaling: batch {preset_batch} not divisible by {n_devices} devices")
    return preset_batch // n_devices, preset_batch


def mesh_config(cfg, n_devices: int, weak: bool):
    """cfg with data.batch_size = the global batch of an n-device mesh."""
    _, global_batch = batch_sizes(cfg.data.batch_size, n_devices, weak)
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, batch_size=global_batch))


def step_job(cfg, spec: str, devices, rules, replica_axes: tuple[str, ...], steps: int, batches: int) -> dict:
    """Time the real train step of cfg on mesh ``spec`` over ``devices``; one result row."""
    import jax
    import numpy as np

    from gemjax.data.feeding import Feeder
    from gemjax.data.synthetic import SEQUENCES, SyntheticStream
    from gemjax.parallel.mesh import build_mesh
    from gemjax.perf import local_mfu, mfu
    from gemjax.train.step import Trainer

    mesh = build_mesh(spec, devices, devices_per_host=FLAGS.devices_per_host)
    replica_axes = tuple(a for a in replica_axes if mesh.shape.get(a, 1) > 1)
    planner = {} if FLAGS.replicate_below_bytes is None else {"replicate_below_bytes": FLAGS.replicate_below_bytes}
    trainer = Trainer.create(cfg, mesh, rules=rules, table_replica_axes=replica_axes, **planner)
    state = trainer.init_state(0)
    feeder = Feeder(SyntheticStream(cfg.data, 0).shard_batch, mesh)
    hosts = [feeder.host_batch(i) for i in range(batches)]
    device_batches = [feeder.to_device(h[0]) for h in hosts]
    tokens = float(np.mean([h[2] for h in hosts])) * jax.process_count()   # local tokens per process
    shards = feeder.num_shards
    analytic = None
    if cfg.model.kind == "teacher":   # model FLOPs of this process's shards (x processes)
        from gemjax.perf import model_flops
        analytic = float(np.mean([model_flops.batch_step_flops(cfg, h[0], len(feeder.local_shards))
                                  for h in hosts])) * jax.process_count()
    attn = 0.0
    if cfg.model.kind == "teacher":   # Pallas attention FLOPs, this process's shards (x processes)
        attn = float(np.mean([local_mfu.step_attention_flops(cfg, h[0], len(feeder.local_shards))
                              for h in hosts])) * jax.process_count()
    step = trainer.make_train_step()
    t0 = time.perf_counter()
    compiled = step.lower(state, device_batches[0]).compile()
    compile_s = time.perf_counter() - t0
    hlo_path = None
    if FLAGS.save_hlo:   # the optimized per-device program: fusion names match the profile's ops
        import gzip
        hlo_path = os.path.join(os.path.abspath(FLAGS.workdir), "hlo", short(spec).replace(",", "_") + ".txt.gz")
        os.makedirs(os.path.dirname(hlo_path), exist_ok=True)
        with gzip.open(hlo_path, "wt") as f:
            f.write(compiled.as_text())
    flops_per_device = mfu.compiled_flops(compiled, default=float("nan"))
    mem = compiled.memory_analysis()
    compiled_bytes = None
    if mem is not None:
        compiled_bytes = int(mem.argument_size_in_bytes + mem.output_size_in_bytes
                             + mem.temp_size_in_bytes - mem.alias_size_in_bytes)
    nb = len(device_batches)
    for i in range(nb):      # warm-up: every batch's branch plan compiled before the clock
        state, m = step(state, device_batches[i], next_batch=device_batches[(i + 1) % nb])
    jax.block_until_ready(m)
    t0 = time.perf_counter()
    for i in range(steps):   # next_batch: the host plans the next step's sparse branches ahead
        state, m = step(state, device_batches[i % nb], next_batch=device_batches[(i + 1) % nb])
    jax.block_until_ready((state, m))
    step_s = (time.perf_counter() - t0) / steps
    profile = None
    if FLAGS.profile_steps > 0:   # after the timing: the trace's overhead stays out of step_s
        profile = os.path.join(os.path.abspath(FLAGS.workdir), "profile", short(spec).replace(",", "_"))
        with jax.profiler.trace(profile, create_perfetto_trace=True):
            for i in range(FLAGS.profile_steps):
                state, m = step(state, device_batches[i % nb], next_batch=device_batches[(i + 1) % nb])
            jax.block_until_ready((state, m))
        from tools import profile_summary
        print(f"[sweep] {short(spec)}: device time of {FLAGS.profile_steps} traced steps ({profile})\n"
              + profile_summary.format_summary(profile_summary.summarize(
                  profile_summary.load_events(profile), FLAGS.profile_steps), top=12), flush=True)
    stats = [d.memory_stats() or {} for d in mesh.devices.flat]
    peak = max((s.get("peak_bytes_in_use", 0) for s in stats), default=0) or None
    leaves = jax.tree_util.tree_leaves_with_path(state["params"])
    expert = sum(x.size for p, x in leaves if "experts" in jax.tree_util.keystr(p))
    return {"mesh": short(spec), "devices": mesh.size, "table_replica_axes": list(replica_axes),
            "axis_names": list(mesh.axis_names),
            "table_plans": sorted({p.kind for p in trainer.coll.plans.values()}),
            "step_s": step_s, "compile_s": compile_s, "tokens_per_step": tokens,
            "sparse_branch_plans": [list(p) for p in step.plans],
            "seq_tokens_per_sample": tokens / cfg.data.batch_size, "num_sequences": len(SEQUENCES),
            "xla_flops_per_device": flops_per_device, "pallas_attention_flops": attn,
            "xla_step_flops": flops_per_device * mesh.size + attn,
            "step_flops": analytic if analytic is not None else flops_per_device * mesh.size + attn,
            "flops_source": "analytic" if analytic is not None else "xla",
            "compiled_bytes_per_device": compiled_bytes, "running_peak_bytes_per_device": peak,
            "loss": float(np.asarray(m["loss"])), "ids_overflow": int(np.asarray(m["ids_overflow"])),
            "dense_params": int(sum(x.size for _, x in leaves)) - int(expert), "expert_params": int(expert),
            "shards": shards, "profile": profile, "hlo": hlo_path}


def workload(cfg, row: dict, base: dict, local_batch: int):
    """topology.Workload of one device of ``row``'s run (FLOPs per sample from the 1-device base row)."""
    from gemjax.perf import topology
    return topology.workload_for(cfg, dense_params=row["dense_params"], expert_params=row["expert_params"],
                                 local_batch=local_batch, seq_tokens_per_sample=base["seq_tokens_per_sample"],
                                 forward_flops_per_sample=base["step_flops"] / 3 / base["global_batch"])


def plot(rows: list[dict], path: str) -> str:
    """Bar charts of step time, samples/s, MFU and memory per mesh; returns a note."""
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
              ("MB per device", [(r["compiled_bytes_per_device"] or 0) / 1e6 for r in ok])]
    fig, axs = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.5))
    for ax, (title, vals) in zip(axs, panels):
        ax.bar(range(len(vals)), vals)
        ax.set_xticks(range(len(vals)), names, rotation=60, ha="right", fontsize=7)
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return f"plot: {path}"


def pallas_probe() -> float | None:
    """XLA's FLOP count of a Pallas gdpa forward (GPU only): ~0 means the Pallas term is needed."""
    import jax
    import jax.numpy as jnp
    if jax.default_backend() != "gpu":
        return None
    from kernels import gdpa
    from gemjax.perf import mfu
    q = jnp.ones((256, 2, 32), jnp.bfloat16)
    off = jnp.array([0, 128, 256], jnp.int32)
    try:
        return mfu.xla_flops(lambda q: gdpa(q, q, q, off, off, impl="pallas"), q)
    except Exception as e:  # noqa: BLE001 -- a diagnostic only
        print(f"[sweep] pallas probe failed: {type(e).__name__}: {str(e)[:200]}")
        return None


def fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def main(argv):
    del argv
    from gemjax.parallel import multihost
    multihost.initialize(cpu_devices=FLAGS.cpu_devices or None)
    import jax
    import numpy as np

    from gemjax.config import get_config
    from gemjax.data.synthetic import SyntheticStream
    from gemjax.parallel import rules as rules_lib
    from gemjax.perf import topology
    from gemjax.parallel.mesh import resolve_mesh_spec
    from gemjax.perf import local_mfu, mfu

    devices = jax.devices()
    n_all = len(devices)
    per_host = FLAGS.devices_per_host or jax.local_device_count()
    one = enumerate_specs(FLAGS.axes, 1, 1)[0]
    specs = [s for s in FLAGS.shapes.split(";") if s.strip()] or enumerate_specs(FLAGS.axes, n_all, per_host)
    if FLAGS.with_base and all(spec_devices(s, n_all) != 1 for s in specs):
        specs = [one] + specs                       # the 1-device base of the scaling figures
    specs.sort(key=lambda s: spec_devices(s, n_all))
    if FLAGS.list_only:
        print(f"{len(specs)} mesh shapes ({n_all} devices, {per_host} per host):")
        print("\n".join(specs))
        return
    cfg = get_config(FLAGS.config, FLAGS.override)
    weak = FLAGS.weak_scaling
    rules = rules_lib.parse_rules(FLAGS.logical_rules)
    replica_axes = tuple(a for a in FLAGS.table_replica_axes.split("+") if a)
    try:
        peak = mfu.peak_flops(devices[0].device_kind, dtype=FLAGS.dtype, override=FLAGS.peak_flops)
    except (KeyError, ValueError) as e:
        print(f"no peak FLOP/s ({e}); MFU left empty")
        peak = None
    out = {"flags": {k: FLAGS[k].value for k in ("config", "override", "axes", "shapes", "logical_rules",
                                                  "table_replica_axes", "steps", "batches", "weak_scaling",
                                                  "replicate_below_bytes", "nvlink_gbps", "roce_gbps",
                                                  "cross_zone_gbps", "overlap", "local_iters")},
           "device_kind": devices[0].device_kind, "devices": n_all, "processes": jax.process_count(),
           "preset_batch": cfg.data.batch_size, "peak_flops": peak, "timing": "device step only: "
           f"{FLAGS.batches} pre-built host batches cycled, {FLAGS.steps} timed steps after 1 warm-up",
           "xla_flops_of_pallas_gdpa_probe": pallas_probe()}

    def dump(note=""):   # after every stage, so a run cut short keeps what it measured
        if jax.process_index() == 0:
            os.makedirs(FLAGS.workdir, exist_ok=True)
            with open(os.path.join(FLAGS.workdir, "sweep_mesh.json"), "w") as f:
                json.dump({**out, "rows": rows, "partial": note}, f, indent=1, default=float)

    rows: list[dict] = []
    local = None
    if FLAGS.local_mfu and cfg.model.kind == "teacher" and peak:
        cfg1 = mesh_config(cfg, 1, weak)
        host1, _ = SyntheticStream(cfg1.data, 0).shard_batch(0, 0, 1)
        with jax.default_device(devices[0]):
            local = local_mfu.measure(cfg1, host1, peak, iters=FLAGS.local_iters)
        out["local"] = local
        print(f"[sweep] Local MFU {local['local_mfu']:.4f} over {len(local['layers'])} blocks", flush=True)
        dump("after local MFU")
    elif FLAGS.local_mfu:
        print("[sweep] Local MFU skipped (needs model.kind=teacher and a peak FLOP/s)")

    for spec in specs:
        n = spec_devices(spec, n_all)
        lb, gb = batch_sizes(cfg.data.batch_size, n, weak)
        try:
            res = step_job(mesh_config(cfg, n, weak), spec, devices[:n], rules, replica_axes,
                           FLAGS.steps, FLAGS.batches)
        except Exception as e:  # noqa: BLE001 -- one failing shape (e.g. OOM) must not end the sweep
            rows.append({"mesh": short(spec), "devices": n, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            print(f"[sweep] {short(spec)}: {rows[-1]['error']}", flush=True)
            continue
        res.update(spec=spec, local_batch=lb, global_batch=gb, samples_per_s=gb / res["step_s"],
                   tokens_per_s=res["tokens_per_step"] / res["step_s"],
                   tflops_per_device=res["step_flops"] / res["step_s"] / n / 1e12,
                   e2e_mfu=mfu.mfu(res["step_flops"], res["step_s"], n, peak) if peak else None,
                   local_mfu=local["local_mfu"] if local else None)
        res["scaling_ratio"] = (mfu.scaling_ratio(res["e2e_mfu"], res["local_mfu"])
                                if res["e2e_mfu"] is not None and res["local_mfu"] else None)
        rows.append(res)
        print(f"[sweep] {res['mesh']}: {res['step_s'] * 1e3:.2f} ms/step", flush=True)
        dump(f"after {res['mesh']}")

    ok = [r for r in rows if "error" not in r]
    base = next((r for r in ok if r["devices"] == 1), None)
    net = topology.Network(bandwidth={"host": FLAGS.nvlink_gbps * 1e9, "zone": FLAGS.roce_gbps * 1e9,
                                      "cross_zone": FLAGS.cross_zone_gbps * 1e9},
                           gpus_per_host=per_host, gpus_per_zone=FLAGS.gpus_per_zone)
    fsdp_axes = tuple(rules.get("mlp", ("fsdp",)))
    if base is not None:
        work = workload(cfg, base, base, base["local_batch"])
        cm_peak = peak or 3 * work.forward_flops_per_sample * work.local_batch / base["step_s"]
        eff = topology.calibrate_compute(work, base["step_s"], cm_peak)
        errors = []
        for r in ok:
            r["weak_scaling_efficiency"] = r["samples_per_s"] / r["devices"] / base["samples_per_s"]
            spec = resolve_mesh_spec(r["spec"], r["devices"], min(per_host, r["devices"]))
            pred = topology.predict(spec, workload(cfg, r, base, r["local_batch"]), peak=cm_peak,
                                    local_mfu=eff, overlap=FLAGS.overlap, net=net,
                                    layout=topology.layout_for(spec.names, fsdp_axes, replica_axes))
            r.update(predicted_step_s=pred["step_s"], predicted_comm_s=pred["comm_s"],
                     predicted_rel_error=topology.relative_error(pred["step_s"], r["step_s"]),
                     predicted_collectives=[dataclasses.asdict(c) for c in pred["collectives"]
                                            if c.ranks > 1])
            if r["devices"] > 1:
                errors.append(abs(r["predicted_rel_error"]))
        big_net = dataclasses.replace(net, gpus_per_host=FLAGS.predict_gpus_per_host)
        table, best_table = [], []
        for g in (int(x) for x in FLAGS.predict_gpus.split(",") if x.strip()):
            spec = topology.default_mesh(g)
            table.append(topology.predict(spec, work, peak=cm_peak, local_mfu=eff, overlap=FLAGS.overlap,
                                          net=big_net, layout=topology.layout_for(spec.names, fsdp_axes,
                                                                                  replica_axes)))
            best, _ = topology.best_mesh(g, work, fsdp_axes=fsdp_axes, table_replica_axes=replica_axes,
                                         net=big_net, peak=cm_peak, local_mfu=eff, overlap=FLAGS.overlap)
            best_table.append(best)
        out["cost_model"] = {
            "workload": dataclasses.asdict(work), "calibrated_compute_mfu": eff, "peak_used": cm_peak,
            "network": dataclasses.asdict(net), "overlap": FLAGS.overlap,
            "max_abs_rel_error_multi_device": max(errors) if errors else None,
            "within_25pct": all(e <= 0.25 for e in errors) if errors else None,
            "predicted": [{**{k: v for k, v in t.items() if k != "collectives"},
                           "collectives": [dataclasses.asdict(c) for c in t["collectives"]]} for t in table],
            "predicted_best_mesh": [{k: v for k, v in t.items() if k != "collectives"} for t in best_table]}
    if jax.process_index() != 0:
        return
    os.makedirs(FLAGS.workdir, exist_ok=True)
    out["plot"] = plot(rows, os.path.join(FLAGS.workdir, "sweep_mesh.png"))
    dump("")

    if local:
        print(f"\nLocal MFU (each block alone on one device, {local['samples']} samples, fwd+bwd):")
        print(f"{'block':<28} {'GFLOP':>10} {'of which Pallas':>15} {'ms':>8} {'MFU':>7}")
        for lr in local["layers"]:
            print(f"{lr['name']:<28} {lr['flops'] / 1e9:>10.2f} {lr['pallas_flops'] / 1e9:>15.2f} "
                  f"{lr['seconds'] * 1e3:>8.3f} {lr['mfu']:>7.4f}")
        print(f"{'Local MFU (FLOP-weighted)':<28} {local['model_flops'] / 1e9:>10.2f} {'':>15} {'':>8} "
              f"{local['local_mfu']:>7.4f}")
    if "cost_model" in out:
        cm = out["cost_model"]
        print(f"\nCost model, calibrated on 1 device (compute MFU {cm['calibrated_compute_mfu']:.4f}), "
              f"predicted for {FLAGS.predict_gpus} GPUs ({FLAGS.predict_gpus_per_host}/host, overlap "
              f"{FLAGS.overlap:.0%}):")
        print(topology.format_table(table))
        print("  the predicted-fastest replica / fsdp / expert shape at each size (topology.best_mesh):")
        print(topology.format_table(best_table))
    print(f"\n{'mesh':<26} {'dev':>3} {'local/global B':>15} {'step ms':>8} {'samples/s':>10} {'E2E MFU':>8} "
          f"{'Local':>7} {'Scaling':>7} {'weak eff':>8} {'MB/dev':>8} {'pred ms':>8} {'pred err':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['mesh']:<26} {r['devices']:>3} failed: {r['error'][:80]}")
            continue
        mem = r["compiled_bytes_per_device"]
        print(f"{r['mesh']:<26} {r['devices']:>3} {str(r['local_batch']) + '/' + str(r['global_batch']):>15} "
              f"{r['step_s'] * 1e3:>8.2f} {r['samples_per_s']:>10.0f} {fmt(r['e2e_mfu'], '.4f'):>8} "
              f"{fmt(r['local_mfu'], '.4f'):>7} {fmt(r['scaling_ratio'], '.3f'):>7} "
              f"{fmt(r.get('weak_scaling_efficiency'), '.3f'):>8} {fmt(mem and mem / 1e6, '.0f'):>8} "
              f"{fmt(r.get('predicted_step_s') and r['predicted_step_s'] * 1e3, '.2f'):>8} "
              f"{fmt(r.get('predicted_rel_error'), '+.1%'):>8}")
    multi = [r for r in ok if r["devices"] > 1]
    if ok:
        best = max(multi or ok, key=lambda r: r["samples_per_s"] / r["devices"])
        print(f"best: {best['mesh']} ({best['samples_per_s'] / best['devices']:.0f} samples/s per device"
              + (f", weak-scaling efficiency {best['weak_scaling_efficiency']:.3f}"
                 if best.get("weak_scaling_efficiency") is not None else "") + ")"
              + (f"; cost model max |error| {out['cost_model']['max_abs_rel_error_multi_device']:.1%}"
                 if out.get("cost_model", {}).get("max_abs_rel_error_multi_device") is not None else "")
              + f"   ({out['plot']})")


if __name__ == "__main__":
    app.run(main)
