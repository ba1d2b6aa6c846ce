"""Time the jitted train step of a preset on fixed batches (device only, no input pipeline).

    python -m benchmarks.bench_step --config=h200 --override=model.kind=teacher --out=step.json

Reports step time, samples/s, sequence tokens/s, the dense FLOPs per sample of the
train step and the resulting MFU against the device's peak. FLOPs: for the
teacher the analytic model count (gemjax.perf.model_flops; XLA's GPU cost
analysis drops GEMMs and misses Pallas calls, see experiments/sweep_mesh.py),
otherwise XLA's cost analysis of the compiled step; both are printed, the sparse
side counts ~0 FLOPs.
Compare with experiments/train.py's samples/s to see what the input pipeline costs.
--steps_per_call=K times the program that train.steps_per_call=K trains with: K steps per
jitted call (gemjax.train.multistep) on --batches groups of K stacked batches, --iters
calls; step_ms and the rates are per step.
"""

from __future__ import annotations

import json
import time

from absl import app, flags

flags.DEFINE_string("config", "small", "preset")
flags.DEFINE_string("override", "", "section.field=value,...")
flags.DEFINE_integer("iters", 10, "timed steps")
flags.DEFINE_integer("batches", 3, "distinct batches cycled through")
flags.DEFINE_integer("steps_per_call", 1, "train steps per jitted call (train.steps_per_call)")
flags.DEFINE_float("peak_flops", None, "peak FLOP/s per device (default: table by device kind)")
flags.DEFINE_string("out", "", "JSON output path")


def main(argv):
    del argv
    from gemjax.train import runtime
    runtime.enable_gpu_graphs()     # before any device use, as experiments/train.py
    import jax
    import numpy as np

    from gemjax.config import get_config
    from gemjax.data.feeding import Feeder
    from gemjax.data.synthetic import SyntheticStream
    from gemjax.perf import mfu
    from gemjax.train import multistep
    from gemjax.train.step import Trainer

    f = flags.FLAGS
    k = f.steps_per_call
    if k < 1:
        raise app.UsageError(f"--steps_per_call must be >= 1, got {k}")
    cfg = get_config(f.config, f.override)
    trainer = Trainer.create(cfg)
    state = trainer.init_state(0)
    stream = SyntheticStream(cfg.data, 0)
    feeder = Feeder(stream.shard_batch, trainer.mesh)
    t0 = time.perf_counter()
    hosts = [feeder.host_batch(i) for i in range(f.batches * k)]
    host_s = (time.perf_counter() - t0) / len(hosts)
    if k == 1:
        batches = [feeder.to_device(h[0]) for h in hosts]
        step = trainer.make_train_step()
    else:       # the StackedFeeder's placement: [K, B, ...] sharded on the batch dim
        stacked = multistep.stacked_sharding(trainer.mesh, feeder.axis)
        batches = [jax.device_put(multistep.stack([h[0] for h in hosts[g * k:(g + 1) * k]]),
                                  stacked) for g in range(f.batches)]
        step = multistep.MultiStep(trainer, k)
    tokens = float(np.mean([h[2] for h in hosts]))
    t0 = time.perf_counter()      # the FLOPs of one step: the one-step program's
    one = batches[0] if k == 1 else feeder.to_device(hosts[0][0])
    compiled = trainer.make_train_step().lower(state, one).compile()
    compile_s = time.perf_counter() - t0
    flops = mfu.compiled_flops(compiled, default=float("nan"))
    nb = len(batches)
    for i in range(nb):      # warm-up: every batch's sparse branch plan compiled (PlannedStep)
        state, m = step(state, batches[i], next_batch=batches[(i + 1) % nb])
    jax.block_until_ready(m)
    t0 = time.perf_counter()
    for i in range(f.iters):
        state, m = step(state, batches[i % nb], next_batch=batches[(i + 1) % nb])
    jax.block_until_ready((state, m))
    step_s = (time.perf_counter() - t0) / f.iters / k
    n_dev = trainer.num_shards
    try:
        peak = mfu.peak_flops(jax.devices()[0].device_kind, "bf16", f.peak_flops)
    except (KeyError, ValueError):
        peak = float("nan")
    b = cfg.data.batch_size
    xla = flops
    if cfg.model.kind == "teacher":
        from gemjax.perf import model_flops
        flops = float(np.mean([model_flops.batch_step_flops(cfg, h[0], trainer.num_shards)
                               for h in hosts]))
    res = {"config": cfg.name, "model": cfg.model.kind, "devices": n_dev,
           "flops_source": "analytic" if cfg.model.kind == "teacher" else "xla",
           "xla_train_step_flops_per_sample": xla / b,
           "device_kind": jax.devices()[0].device_kind, "batch": b, "tokens_per_batch": tokens,
           "step_ms": step_s * 1e3, "samples_per_sec": b / step_s, "tokens_per_sec": tokens / step_s,
           "train_step_flops_per_sample": flops / b, "forward_flops_per_sample": flops / b / 3,
           "tflops_per_sec_per_device": flops / step_s / n_dev / 1e12,
           "mfu": flops / step_s / n_dev / peak, "compile_s": compile_s,
           "host_batch_s": host_s, "loss": float(np.ravel(m["loss"])[-1]), "steps_per_call": k,
           "dense_params": int(sum(x.size for x in jax.tree.leaves(state["params"]))),
           "embedding_params": int(sum(s.vocab * s.dim for s in trainer.coll.specs.values()))}
    width = max(len(k) for k in res)
    for k, v in res.items():
        print(f"{k:<{width}}  {v:.4g}" if isinstance(v, float) else f"{k:<{width}}  {v}")
    if f.out:
        with open(f.out, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    app.run(main)
