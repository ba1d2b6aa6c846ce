"""Local MFU of the GEM teacher: each top-level block timed alone on one device.

GEM's definition: every layer runs alone on one GPU, forward +
backward, no recompute, no communication; Local MFU is the FLOP-weighted mean of
the per-layer MFUs (``mfu.local_mfu``). The blocks are the teacher's own
(TeacherArch.block_names()), in model order, at the per-device batch (B samples,
one device's packed sequences):

  inputs                  dense projection, feature tokens, sequence field sums
  pyramid                 ParallelPyramid: block attention + per-block pooling
  interformer{i}.cross    Cross Arch: x_sum, s_sum (PMA = GDPA)
  interformer{i}.interaction   Wukong (or the mixture of Wukong experts) on [x | s_sum]
  interformer{i}.sequence Sequence Arch: personalized FFN (GDPA), self-attention,
                          FFN, CLS attention
  final_cross             the last Cross Arch
  head                    multi-domain head -> logits

Each block's training work is ``jax.vjp`` of its forward with a random cotangent:
gradients for its parameters AND its inputs (what the real backward computes).
Inputs are the real activations of the model's own forward on that batch
(``teacher_taps``: GEMTeacher.__call__ with ``taps``, which records each block's inputs).

A block's FLOPs (the MFU numerator) are its analytic model count, 3 x
gemjax.perf.model_flops' forward count of the same block. ``measure`` also reports
XLA's cost analysis of each compiled block and the Pallas attention term XLA
cannot see (``pallas_attention_flops``: 3 x the valid-pair FLOPs of every
attention call that runs in a Pallas kernel on this backend; none where the jnp
reference runs, e.g. on CPU). ``step_attention_flops`` gives that Pallas term for
a whole train step (E2E FLOPs = XLA step FLOPs + Pallas attention FLOPs).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gemjax.config import Config, schema_of
from gemjax.data.jagged import Jagged
from gemjax.models.gem import build_model
from gemjax.perf import mfu, model_flops
from gemjax.perf.model_flops import AttentionCall, attention_calls, runs_in_pallas, shard_seq_lengths


def pallas_attention_flops(calls: Sequence[AttentionCall], backend: str | None = None) -> dict[str, float]:
    """{block: fwd+bwd FLOPs (3 x forward) of its calls that run in Pallas kernels}."""
    out: dict[str, float] = {}
    for c in calls:
        if runs_in_pallas(c.op, c.head_dim, backend):
            out[c.block] = out.get(c.block, 0.0) + float(mfu.train_step_flops(c.forward_flops))
    return out


def step_attention_flops(cfg: Config, batch, num_shards: int, backend: str | None = None) -> float:
    """Pallas attention FLOPs (fwd+bwd) of one train step over all shards of ``batch``.

    Add to XLA's step count (per device x devices) for the E2E FLOPs; 0 where no
    attention runs in Pallas (then XLA's own count includes the jnp attention).
    """
    if cfg.model.kind != "teacher":
        raise ValueError(f"step_attention_flops: model.kind must be 'teacher', got {cfg.model.kind!r}")
    return float(sum(sum(pallas_attention_flops(attention_calls(cfg, lens, backend), backend).values())
                     for lens in shard_seq_lengths(batch, num_shards)))


# --------------------------------------------------------------------------- the teacher's blocks


@dataclasses.dataclass
class Block:
    """One block's training work: ``fn(*args)`` = vjp of its forward (params and inputs)."""

    name: str
    fn: Callable
    args: tuple


def _inputs_call(model, acts, dense, sequences):
    """GEMTeacher.inputs -> (x, {seq: tokens}) (the jagged layouts are not differentiated)."""
    x, seqs = model.inputs(acts, dense, sequences)
    return x, {s: v for s, (v, _) in seqs.items()}


def _interaction(layer, tokens):
    return layer.interaction(tokens)[0] if layer.use_experts else layer.interaction(tokens)


def teacher_taps(model, acts: dict, batch) -> dict:
    """Every block's inputs on ``batch``, from the model's own forward (jitted):
    GEMTeacher.__call__'s taps plus "logits" [B, K]."""
    graphdef, state = nnx.split(model)

    def run(st, a, bt):
        taps: dict = {}
        logits = nnx.merge(graphdef, st)(a, bt, taps=taps)
        return dict(taps, logits=logits)

    return jax.jit(run)(state, acts, batch)


_SEQUENCE_ARCH = ("pffn_norm", "pffn", "attn_norm", "self_attn", "ffn_norm", "ffn", "cls_norm", "cls_attn")


def _block(name: str, module, call: Callable, diff: tuple, static: tuple, key, param_filter=nnx.Param) -> Block:
    """vjp of call(module, *diff, *static) w.r.t. (the filtered params, diff), random cotangent."""
    graphdef, params, rest = nnx.split(module, param_filter, ...)

    def forward(params, rest, diff, static):
        return call(nnx.merge(graphdef, params, rest), *diff, *static)

    shapes = jax.eval_shape(forward, params, rest, diff, static)
    leaves, tree = jax.tree.flatten(shapes)
    keys = jax.random.split(key, max(len(leaves), 1))
    cot = jax.tree.unflatten(tree, [jax.random.normal(k, s.shape, jnp.float32).astype(s.dtype)
                                    for k, s in zip(keys, leaves)])

    def train(params, rest, diff, static, cot):
        out, pull = jax.vjp(lambda p, d: forward(p, rest, d, static), params, diff)
        return out, pull(cot)

    return Block(name, train, (params, rest, diff, static, cot))


def teacher_blocks(model, acts: dict, batch, seed: int = 0) -> list[Block]:
    """The teacher's top-level blocks (model.arch.block_names(), in that order) on one
    device's batch.

    model: a GEMTeacher; acts: {feature: [B, D]}, {"<seq>.<field>": [T, D]};
    batch: a device-local Batch (arrays on the default device).
    """
    fwd = teacher_taps(model, acts, batch)
    keys = iter(jax.random.split(jax.random.key(seed), 64))
    inter = model.interformer
    blocks = [_block("inputs", model, _inputs_call, (acts,), (batch.dense, batch.sequences), next(keys),
                     nnx.All(nnx.Param, nnx.PathContains("dense_proj")))]
    jags = {s: j for s, (_, j) in fwd["seqs"].items()}
    blocks.append(_block("pyramid", model.pyramid,
                         lambda m, v, j: m({s: (v[s], j[s]) for s in v})[0],
                         ({s: t for s, (t, _) in fwd["seqs"].items()},), (jags,), next(keys)))
    jag = fwd["jagged"]
    for i, (layer, st) in enumerate(zip(inter.layers, fwd["layers"])):
        blocks.append(_block(f"interformer{i}.cross", layer.cross,
                             lambda m, x, s, c, j: m(x, s, c, j), (st["x"], st["seq"], st["cls"]), (jag,),
                             next(keys)))
        blocks.append(_block(f"interformer{i}.interaction", layer, lambda m, t: _interaction(m, t),
                             (st["tokens"],), (), next(keys),
                             nnx.All(nnx.Param, nnx.PathContains("interaction"))))
        blocks.append(_block(f"interformer{i}.sequence", layer,
                             lambda m, s, c, xs, j: m.sequence_arch(s, c, xs, j),
                             (st["seq"], st["cls"], st["x_sum"]), (jag,), next(keys),
                             nnx.All(nnx.Param, nnx.Any(*(nnx.PathContains(n) for n in _SEQUENCE_ARCH)))))
    fin = fwd["final"]
    blocks.append(_block("final_cross", inter.final_cross, lambda m, x, s, c, j: m(x, s, c, j),
                         (fin["x"], fin["seq"], fin["cls"]), (jag,), next(keys)))
    blocks.append(_block("head", model.head, lambda m, h, surf: m(h, surf), (fwd["summary"],),
                         (batch.surface,), next(keys)))
    names = tuple(b.name for b in blocks)
    if names != model.arch.block_names():
        raise AssertionError(f"teacher_blocks: built {names}, the teacher has {model.arch.block_names()}")
    return blocks


def random_acts(cfg: Config, batch, key, scale: float = 0.1) -> dict:
    """Stand-in looked-up embeddings for ``batch`` (float32, like the tables): a row per
    id ([*ids.shape, D]), one per sample for a pooled bag (a Jagged: [B, D])."""
    d = cfg.model.dim
    b = batch.dense.shape[0]
    schema = schema_of(cfg)
    shapes = {f: ((b,) if isinstance(batch.sparse[f], Jagged) else np.shape(batch.sparse[f])) + (d,)
              for f in schema.sparse_names}
    for s, fields in schema.id_fields.items():
        t = batch.sequences[s].capacity
        shapes.update({f"{s}.{f}": (t, d) for f in fields})
    keys = jax.random.split(key, len(shapes))
    return {f: scale * jax.random.normal(k, shp, jnp.float32) for k, (f, shp) in zip(keys, shapes.items())}


def measure(cfg: Config, batch, peak: float, *, seed: int = 0, iters: int = 10, warmup: int = 2,
            backend: str | None = None, timer: Callable | None = None) -> dict:
    """Local MFU of the teacher on one device's ``batch`` (numpy or device Batch).

    Returns mfu.local_mfu_report's dict, each layer row extended with xla_flops and
    pallas_flops, plus "model_flops" (sum over layers). A layer's flops (the MFU
    numerator) are its analytic model FLOPs, 3 x gemjax.perf.model_flops'
    forward count: XLA's GPU cost analysis of the same block varied 4x between two
    H200 compiles (it dropped GEMMs), and it never sees inside Pallas calls.
    """
    if cfg.model.kind != "teacher":
        raise ValueError(f"local_mfu.measure: model.kind must be 'teacher', got {cfg.model.kind!r}")
    dev_batch = jax.device_put(batch)
    model = build_model(cfg, nnx.Rngs(seed))
    acts = random_acts(cfg, dev_batch, jax.random.key(seed + 1))
    blocks = teacher_blocks(model, acts, dev_batch, seed)
    lens = {s: np.diff(np.asarray(batch.sequences[s].offsets)) for s in schema_of(cfg).sequence_names}
    pallas = pallas_attention_flops(attention_calls(cfg, lens, backend), backend)
    analytic = model_flops.teacher_block_flops(cfg, lens)
    layers, extra = [], {}
    for blk in blocks:
        compiled = jax.jit(blk.fn).lower(*blk.args).compile()
        xla = mfu.compiled_flops(compiled)
        p = pallas.get(blk.name, 0.0)
        extra[blk.name] = (xla, p)
        layers.append((blk.name, compiled, blk.args, float(mfu.train_step_flops(analytic[blk.name]))))
    if timer is None:       # the blocks are compiled already
        timer = lambda f, *a: mfu.time_fn(f, *a, warmup=warmup, iters=iters, jit=False)  # noqa: E731
    report = mfu.local_mfu_report(layers, peak, timer=timer)
    for row in report["layers"]:
        row["xla_flops"], row["pallas_flops"] = extra[row["name"]]
    report["model_flops"] = float(sum(r["flops"] for r in report["layers"]))
    report["samples"] = int(batch.dense.shape[0])
    return report


def main(argv: Sequence[str] | None = None) -> None:
    """python -m gemjax.perf.local_mfu --config=gem1b: each teacher block timed alone on this
    process's first device at the preset's batch (step 0 of its train source); prints each
    block's time and MFU, then Local MFU."""
    import json

    from gemjax.data.source import make_source
    from gemjax.perf.model_size import parse_preset, preset_parser

    ap = preset_parser("Local MFU of a preset's teacher (model.kind=teacher): each block "
                       "timed alone on one device (forward + backward).")
    ap.add_argument("--iters", type=int, default=5, help="timed calls per block")
    ap.add_argument("--peak_flops", type=float, default=None,
                    help="peak FLOP/s of the device (default: the table by device kind, bf16)")
    ap.add_argument("--json", default="", help="write the report here")
    args, cfg = parse_preset(ap, argv)
    if cfg.model.kind != "teacher":
        ap.error(f"--config={args.config}: model.kind must be teacher, got {cfg.model.kind!r}")
    if args.iters < 1:
        ap.error(f"--iters must be >= 1, got {args.iters}")
    device = jax.devices()[0]
    try:
        peak = mfu.peak_flops(device.device_kind, "bf16", args.peak_flops)
    except ValueError as e:
        ap.error(f"{e} (pass --peak_flops)")
    batch, _ = make_source(cfg, "train").shard_batch(0, 0, 1)
    with jax.default_device(device):
        rep = measure(cfg, batch, peak, iters=args.iters, warmup=1)
    for row in rep["layers"]:
        print(f"{row['name']:<28} {row['seconds'] * 1e3:9.3f} ms  {row['flops'] / 1e12:8.3f} TFLOP"
              f"  MFU {row['mfu']:.4f}")
    print(f"Local MFU {rep['local_mfu']:.4f} over {len(rep['layers'])} blocks "
          f"(peak {peak / 1e12:.4g} TFLOP/s, {device.device_kind})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep, f, indent=1, default=float)


if __name__ == "__main__":
    main()
