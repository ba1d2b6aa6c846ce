"""Sweep mesh shapes for the devices present: enumerate, run a short job on each, tabulate.

    python experiments/sweep_mesh.py --axes=replica,fsdp,expert --workdir=runs/sweep
    python experiments/sweep_mesh.py --shapes="replica=1,fsdp=2,expert=2;replica=2,fsdp=2,expert=1"
    python experiments/sweep_mesh.py --list_only            # just the valid shapes

Skeleton (issue 5 item 5): the job per shape is the toy sharded MLP step of
gemjax/parallel/toy_step.py (data parallel + FSDP, SGD) so the sweep machinery,
timing and MFU plumbing are testable now; the lead's real train step replaces
``toy_job`` later. Each row: step time, samples/s, model TFLOP/s per device,
E2E MFU (analytic FLOPs from gemjax.train.mfu, peak from the device table or
--peak_flops), peak memory per device (GPU only), and the topology model's
predicted communication time. Writes WORKDIR/sweep_mesh.json; prints the table
last. No plot yet.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

flags.DEFINE_string("axes", "replica,fsdp,expert", "physical axes outer to inner (name or name@tier)")
flags.DEFINE_string("shapes", "", "';'-separated mesh specs to run instead of enumerating")
flags.DEFINE_integer("devices_per_host", None, "devices per host (default: one process's devices)")
flags.DEFINE_bool("list_only", False, "print the valid shapes and exit")
flags.DEFINE_integer("steps", 10, "timed steps per shape (after 2 warm-up steps)")
flags.DEFINE_integer("batch", 1024, "global batch of the toy job")
flags.DEFINE_integer("dim", 512, "toy input width")
flags.DEFINE_integer("hidden", 2048, "toy hidden width")
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


def toy_job(spec: str, steps: int, batch: int, dim: int, hidden: int) -> dict:
    """Time the toy sharded step on mesh ``spec``; returns step_s and peak memory per device."""
    import jax
    import optax

    from gemjax.parallel import multihost, rules
    from gemjax.parallel.mesh import build_mesh
    from gemjax.parallel.toy_step import toy_data, toy_loss

    mesh = build_mesh(spec)
    params0, x_all, y_all = toy_data(0, batch, dim, hidden)
    opt = optax.sgd(1e-3, momentum=0.9)
    p_sh = rules.param_shardings(params0, mesh)
    params = jax.tree.map(lambda a, s: jax.make_array_from_callback(a.shape, s, lambda i: a[i]), params0, p_sh)
    opt_state = opt.init(params)
    o_sh = rules.param_shardings(opt_state, mesh)
    x_sh = rules.logical_sharding(("batch", None), mesh, shape=x_all.shape)
    y_sh = rules.logical_sharding(("batch",), mesh, shape=y_all.shape)
    rows = multihost.process_rows(x_sh, batch)
    x = multihost.put_process_local(x_all[rows], x_sh, batch)
    y = multihost.put_process_local(y_all[rows], y_sh, batch)

    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(toy_loss)(params, x, y)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    step = jax.jit(step, in_shardings=(p_sh, o_sh, x_sh, y_sh), out_shardings=(p_sh, o_sh, None),
                   donate_argnums=(0, 1))
    with jax.set_mesh(mesh):
        for _ in range(2):
            params, opt_state, loss = step(params, opt_state, x, y)
        loss.block_until_ready()
        t = time.perf_counter()
        for _ in range(steps):
            params, opt_state, loss = step(params, opt_state, x, y)
        loss.block_until_ready()
        step_s = (time.perf_counter() - t) / steps
    mem = [d.memory_stats() or {} for d in jax.local_devices()]
    peak_mem = max((m.get("peak_bytes_in_use", 0) for m in mem), default=0) or None
    return {"step_s": step_s, "peak_bytes_per_device": peak_mem, "loss": float(multihost.to_host(loss))}


def main(argv):
    del argv
    from gemjax.parallel import multihost
    multihost.initialize(cpu_devices=FLAGS.cpu_devices or None)
    import jax

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
    try:
        peak = mfu.peak_flops(dtype=FLAGS.dtype, override=FLAGS.peak_flops)
    except ValueError as e:
        print(f"no peak FLOP/s ({e}); MFU left empty")
        peak = None
    fwd = mfu.mlp_flops(FLAGS.batch, (FLAGS.dim, FLAGS.hidden, 1))
    step_flops = mfu.train_step_flops(fwd)
    work = topology.Workload(dense_params=FLAGS.dim * FLAGS.hidden + 2 * FLAGS.hidden + 1, param_bytes=4,
                             local_batch=max(1, FLAGS.batch // n),
                             forward_flops_per_sample=fwd / FLAGS.batch)
    rows = []
    for spec in specs:
        res = toy_job(spec, FLAGS.steps, FLAGS.batch, FLAGS.dim, FLAGS.hidden)
        pred = topology.predict(parse_mesh_spec(spec), work, peak=peak or 1.0, local_mfu=1.0,
                                net=topology.Network(gpus_per_host=per_host))
        row = {"mesh": spec.replace("@cross_zone", "").replace("@zone", "").replace("@host", ""), "devices": n, **res, "samples_per_s": FLAGS.batch / res["step_s"],
               "tflops_per_device": step_flops / res["step_s"] / n / 1e12,
               "e2e_mfu": mfu.mfu(step_flops, res["step_s"], n, peak) if peak else None,
               "predicted_comm_s": pred["comm_s"]}
        rows.append(row)
    os.makedirs(FLAGS.workdir, exist_ok=True)
    with open(os.path.join(FLAGS.workdir, "sweep_mesh.json"), "w") as f:
        json.dump({"flags": {k: FLAGS[k].value for k in ("axes", "shapes", "steps", "batch", "dim", "hidden")},
                   "device_kind": jax.devices()[0].device_kind, "peak_flops": peak, "rows": rows}, f, indent=1)
    best = min(rows, key=lambda r: r["step_s"])
    print(f"{'mesh':<32} {'step ms':>9} {'samples/s':>11} {'TFLOP/s/dev':>12} {'MFU':>7} {'mem MB':>8} "
          f"{'pred comm ms':>12}")
    for r in rows:
        mfu_txt = f"{r['e2e_mfu']:.3f}" if r["e2e_mfu"] is not None else "-"
        mem = f"{r['peak_bytes_per_device'] / 1e6:.0f}" if r["peak_bytes_per_device"] else "-"
        print(f"{r['mesh']:<32} {r['step_s'] * 1e3:>9.2f} {r['samples_per_s']:>11.0f} "
              f"{r['tflops_per_device']:>12.3f} {mfu_txt:>7} {mem:>8} {r['predicted_comm_s'] * 1e3:>12.3f}")
    print(f"best: {best['mesh']}")


if __name__ == "__main__":
    app.run(main)
