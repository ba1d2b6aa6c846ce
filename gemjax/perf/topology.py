"""Topology cost model: bytes and time of each collective a layout implies, and the scaling ratio.

Network (GEM's three tiers): 8 GPUs per host on NVLink, hosts of a zone on RoCE,
zones on oversubscribed RoCE. Bandwidths are per GPU per direction. An axis's
*effective* tier comes from how far it reaches in the device order (its span =
size x the product of the inner axis sizes): within a host -> NVLink, within a
zone -> RoCE, else cross-zone; so ``fsdp=8`` on 8-GPU hosts costs NVLink rates
even though ``fsdp`` is declared a zone axis.

Collectives use the ring cost (NCCL's bus-bandwidth convention) over n ranks,
``S`` = the full buffer in bytes per rank:

  all-gather      (n-1)/n * S   received per rank, n-1 steps      (S = gathered size)
  reduce-scatter  (n-1)/n * S   sent per rank, n-1 steps          (S = unreduced size)
  all-reduce      2 (n-1)/n * S,                  2 (n-1) steps
  all-to-all      (n-1)/n * S   sent per rank, n-1 steps          (S = local send buffer)

time = steps * latency(tier) + bytes / bandwidth(tier).

Layout (2D FSDP + EP for dense, fully sharded 2D for sparse), per training step
and per GPU:
  dense params    all-gather over fsdp (fwd and again in bwd), reduce-scatter of
                  gradients over fsdp, all-reduce of the gradient shard over replica
  expert params   the same over fsdp/replica, for the 1/expert share a GPU holds
                  (the all-reduce leaves out the expert axes: each shard has one owner)
  expert tokens   4 all-to-alls over expert (dispatch + combine, fwd + bwd)
  sparse ids      all-to-all over the sparse model-parallel axes
  embeddings      all-to-all back (fwd) and of their gradients (bwd)
  sparse copy     all-gather of looked-up rows over the copy-shard axis (fwd),
                  reduce-scatter of their gradients (bwd)

Compute = 3 * forward FLOPs per GPU / (peak * local MFU). Step time =
compute + (1 - overlap) * communication; predicted scaling ratio = compute / step.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from gemjax.parallel.mesh import TIERS, MeshSpec, parse_mesh_spec, resolve_mesh_spec, valid_shapes

DEFAULT_BANDWIDTH = {"host": 450e9, "zone": 50e9, "cross_zone": 12.5e9}  # bytes/s per GPU per direction
DEFAULT_LATENCY = {"host": 3e-6, "zone": 10e-6, "cross_zone": 30e-6}     # seconds per ring step


@dataclasses.dataclass(frozen=True)
class Network:
    """Per-tier bandwidth (bytes/s per GPU per direction), per-step latency, and tier sizes."""

    bandwidth: dict = dataclasses.field(default_factory=lambda: dict(DEFAULT_BANDWIDTH))
    latency: dict = dataclasses.field(default_factory=lambda: dict(DEFAULT_LATENCY))
    gpus_per_host: int = 8
    gpus_per_zone: int = 256


@dataclasses.dataclass(frozen=True)
class Workload:
    """What one training step moves and computes, per GPU (weak scaling: fixed local batch).

    dense_params / expert_params: parameter counts (expert_params = all experts).
    param_bytes: bytes per gathered param (2 bf16, 1 fp8); grad_bytes: per reduced gradient.
    local_batch: samples per GPU; lookups_per_sample: embedding rows per sample;
    emb_dim, emb_bytes, id_bytes: sparse payloads; expert_tokens_per_sample, d_model,
    act_bytes: the EP token exchange; forward_flops_per_sample: analytic (gemjax.perf.mfu).
    """

    dense_params: float
    expert_params: float = 0.0
    param_bytes: int = 2
    grad_bytes: int = 4
    local_batch: int = 1024
    lookups_per_sample: int = 0
    emb_dim: int = 128
    emb_bytes: int = 2
    id_bytes: int = 4
    expert_tokens_per_sample: int = 0
    d_model: int = 0
    act_bytes: int = 2
    forward_flops_per_sample: float = 0.0


def workload_for(cfg, *, dense_params: float, expert_params: float, local_batch: int,
                 seq_tokens_per_sample: float, forward_flops_per_sample: float) -> Workload:
    """The Workload of one device training ``cfg`` (gemjax.config.Config) at ``local_batch``.

    Parameter counts and FLOPs come from the caller (measured); the traffic shapes from
    the config and its feature schema: one embedding row per sparse feature and per
    sequence token and field (seq_tokens_per_sample counts every sequence's tokens;
    sequences with different field counts weigh in at their mean), fp32 rows; the EP
    exchange per MoE layer sends the [E, C, n_in, d] dispatch buffer and gets
    [E, C, n_out, d] back (gemjax.layers.experts), forward and backward, i.e.
    layers * (E * C / B) * (n_in + n_out) / 2 tokens per sample for the 4 all-to-alls
    `step_collectives` counts.
    """
    from gemjax.config import schema_of
    from gemjax.layers.experts import expert_capacity
    from gemjax.models.interformer import teacher_arch
    m, a = cfg.model, teacher_arch(cfg)
    slots = (a.experts * expert_capacity(local_batch, a.experts, a.top_k, a.capacity_factor)
             / local_batch) if a.experts and expert_params else 0
    ep_tokens = a.layers * slots * (a.tokens_in + a.tokens) / 2
    schema = schema_of(cfg)
    fields = [len(s.fields) for s in schema.sequences]
    lookups = len(schema.sparse) + (sum(fields) / len(fields) if fields else 0) * seq_tokens_per_sample
    return Workload(dense_params=dense_params, expert_params=expert_params, param_bytes=4, grad_bytes=4,
                    local_batch=local_batch, lookups_per_sample=int(round(lookups)), emb_dim=m.dim,
                    emb_bytes=4, id_bytes=4, expert_tokens_per_sample=int(round(ep_tokens)), d_model=m.dim,
                    act_bytes=2 if m.dtype == "bfloat16" else 4,
                    forward_flops_per_sample=forward_flops_per_sample)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Which physical axes carry each parallelism dimension (names from the mesh spec)."""

    fsdp: tuple[str, ...] = ("fsdp",)
    replica: tuple[str, ...] = ("replica",)
    expert: tuple[str, ...] = ("expert",)
    sparse_mp: tuple[str, ...] = ("fsdp",)
    sparse_copy: tuple[str, ...] = ("expert",)


@dataclasses.dataclass(frozen=True)
class Collective:
    """One predicted collective per step: kind, axes, group size, tier, bytes per GPU, seconds."""

    name: str
    kind: str
    axes: tuple[str, ...]
    ranks: int
    tier: str
    bytes: float
    seconds: float


def ring_bytes(kind: str, ranks: int, size: float) -> float:
    """Bytes each rank moves (per direction) for a ring collective of ``size`` bytes per rank."""
    if ranks < 1:
        raise ValueError(f"ring_bytes: ranks must be >= 1, got {ranks}")
    f = (ranks - 1) / ranks
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return f * size
    if kind == "all_reduce":
        return 2 * f * size
    raise ValueError(f"unknown collective kind {kind!r}")


def ring_steps(kind: str, ranks: int) -> int:
    return (2 if kind == "all_reduce" else 1) * (ranks - 1)


def axis_tiers(spec: MeshSpec, net: Network) -> dict[str, str]:
    """Effective tier of each axis from its span in the device order (see module doc)."""
    out, stride = {}, 1
    for a in reversed(spec.axes):
        span = stride * a.size
        if a.size == 1 or span <= net.gpus_per_host:
            out[a.name] = "host"
        elif span <= net.gpus_per_zone:
            out[a.name] = "zone"
        else:
            out[a.name] = "cross_zone"
        stride = span
    return out


def group(spec: MeshSpec, axes: tuple[str, ...], net: Network) -> tuple[int, str]:
    """(ranks, slowest effective tier) of a collective over ``axes`` (missing axes ignored)."""
    sizes, tiers = dict(zip(spec.names, spec.shape)), axis_tiers(spec, net)
    present = [a for a in axes if a in sizes and sizes[a] > 1]
    if not present:
        return 1, "host"
    return math.prod(sizes[a] for a in present), min((tiers[a] for a in present), key=TIERS.index)


def collective(name: str, kind: str, spec: MeshSpec, axes: tuple[str, ...], size: float, net: Network,
               count: int = 1) -> Collective:
    """``count`` collectives of one kind over ``axes`` with ``size`` bytes per rank each."""
    ranks, tier = group(spec, axes, net)
    b = count * ring_bytes(kind, ranks, size)
    t = count * ring_steps(kind, ranks) * net.latency[tier] + b / net.bandwidth[tier] if ranks > 1 else 0.0
    return Collective(name, kind, tuple(axes), ranks, tier, b, t)


def step_collectives(spec: MeshSpec, work: Workload, layout: Layout = Layout(),
                     net: Network = Network()) -> list[Collective]:
    """Every collective of one training step for ``work`` laid out on ``spec`` (resolved)."""
    sizes = dict(zip(spec.names, spec.shape))
    n_fsdp = math.prod(sizes.get(a, 1) for a in layout.fsdp)
    n_exp = math.prod(sizes.get(a, 1) for a in layout.expert)
    dense_full = work.dense_params
    expert_local = work.expert_params / n_exp
    out = []
    expert_replica = tuple(a for a in layout.replica if a not in layout.expert)   # one owner per shard
    for label, params, replica in (("dense", dense_full, layout.replica),
                                   ("expert", expert_local, expert_replica)):
        if params <= 0:
            continue
        out.append(collective(f"{label} param all-gather", "all_gather", spec, layout.fsdp,
                              params * work.param_bytes, net, count=2))
        out.append(collective(f"{label} grad reduce-scatter", "reduce_scatter", spec, layout.fsdp,
                              params * work.grad_bytes, net))
        out.append(collective(f"{label} grad all-reduce", "all_reduce", spec, replica,
                              params * work.grad_bytes / n_fsdp, net))
    if work.expert_tokens_per_sample and work.d_model:
        tok = work.local_batch * work.expert_tokens_per_sample * work.d_model * work.act_bytes
        out.append(collective("expert token all-to-all", "all_to_all", spec, layout.expert, tok, net, count=4))
    if work.lookups_per_sample:
        rows = work.local_batch * work.lookups_per_sample
        emb = rows * work.emb_dim * work.emb_bytes
        out.append(collective("sparse id all-to-all", "all_to_all", spec, layout.sparse_mp, rows * work.id_bytes, net))
        out.append(collective("embedding all-to-all", "all_to_all", spec, layout.sparse_mp, emb, net, count=2))
        out.append(collective("sparse copy all-gather", "all_gather", spec, layout.sparse_copy, emb, net))
        out.append(collective("sparse copy reduce-scatter", "reduce_scatter", spec, layout.sparse_copy, emb, net))
    return out


def predict(spec: MeshSpec | str, work: Workload, *, peak: float = 989e12, local_mfu: float = 0.4,
            overlap: float = 0.0, layout: Layout = Layout(), net: Network = Network()) -> dict:
    """Predicted step: compute, communication, step time, scaling ratio, and the collectives."""
    if isinstance(spec, str):
        spec = parse_mesh_spec(spec)
    if any(s < 1 for s in spec.shape):
        raise ValueError(f"predict: resolve the mesh first ({spec})")
    if not 0 <= overlap <= 1 or not 0 < local_mfu <= 1:
        raise ValueError(f"predict: overlap in [0, 1] and local_mfu in (0, 1] required; got {overlap}, {local_mfu}")
    colls = step_collectives(spec, work, layout, net)
    compute = 3 * work.forward_flops_per_sample * work.local_batch / (peak * local_mfu)
    comm = sum(c.seconds for c in colls)
    step = compute + (1 - overlap) * comm
    return {"mesh": ",".join(f"{n}={s}" for n, s in zip(spec.names, spec.shape)), "devices": math.prod(spec.shape), "compute_s": compute, "comm_s": comm,
            "step_s": step, "scaling_ratio": compute / step if step > 0 else 1.0,
            "e2e_mfu": local_mfu * (compute / step if step > 0 else 1.0), "collectives": colls}


def calibrate(predictions: list[dict], measured_step_s: list[float]) -> dict:
    """Fit step = a * compute_s + b * comm_s (a, b >= 0) to measured step times.

    predictions: ``predict(...)`` results (made with overlap=0); a rescales compute
    (a = assumed local MFU / real one), b rescales communication (b < 1: overlap or
    faster links than assumed). Returns {"compute_scale": a, "comm_scale": b,
    "max_rel_error": worst |fit - measured| / measured}.
    """
    if len(predictions) != len(measured_step_s) or not predictions:
        raise ValueError("calibrate: need one measured step time per prediction")
    A = np.array([[p["compute_s"], p["comm_s"]] for p in predictions], np.float64)
    y = np.asarray(measured_step_s, np.float64)
    if np.all(A[:, 1] == 0):  # no communication measured (e.g. 1 GPU only): fit compute alone
        a, b = float(A[:, 0] @ y / (A[:, 0] @ A[:, 0])), 0.0
    else:
        (a, b), *_ = np.linalg.lstsq(A, y, rcond=None)
        if b < 0:
            a, b = float(A[:, 0] @ y / (A[:, 0] @ A[:, 0])), 0.0
        elif a < 0:
            a, b = 0.0, float(A[:, 1] @ y / (A[:, 1] @ A[:, 1]))
    fit = A @ np.array([a, b])
    return {"compute_scale": float(a), "comm_scale": float(b), "max_rel_error": float(np.max(np.abs(fit - y) / y))}


def calibrate_compute(work: Workload, measured_step_s: float, peak: float) -> float:
    """The one compute scale, from a 1-device step (no communication): effective MFU.

    Returns e = 3 F B / (peak x measured) (F forward FLOPs per sample, B local batch),
    so ``predict(..., local_mfu=e)`` reproduces the 1-device step exactly and every
    other mesh's prediction adds only its modelled communication.
    """
    if measured_step_s <= 0 or peak <= 0:
        raise ValueError(f"calibrate_compute: measured_step_s and peak must be > 0, got {measured_step_s}, {peak}")
    flops = 3 * work.forward_flops_per_sample * work.local_batch
    if flops <= 0:
        raise ValueError("calibrate_compute: work.forward_flops_per_sample x local_batch must be > 0")
    e = flops / (peak * measured_step_s)
    if e > 1:
        raise ValueError(f"calibrate_compute: implied MFU {e:.3f} > 1 (FLOPs or peak wrong)")
    return float(e)


def relative_error(predicted: float, measured: float) -> float:
    """(predicted - measured) / measured."""
    if measured <= 0:
        raise ValueError(f"relative_error: measured must be > 0, got {measured}")
    return (float(predicted) - float(measured)) / float(measured)


def layout_for(axis_names: tuple[str, ...], fsdp_axes: tuple[str, ...] = ("fsdp",),
               table_replica_axes: tuple[str, ...] = ("replica",),
               expert_axes: tuple[str, ...] = ("expert",)) -> Layout:
    """The trainer's layout (gemjax.train.step) on a mesh with ``axis_names``.

    Dense params FSDP over fsdp_axes and replicated over every other axis (the batch
    is sharded over all axes, so gradients are all-reduced over the rest); experts
    over expert_axes; tables row-wise over the axes not in table_replica_axes
    (sparse model-parallel group) and copied / copy-sharded over table_replica_axes.
    """
    fsdp = tuple(a for a in fsdp_axes if a in axis_names)
    return Layout(fsdp=fsdp, replica=tuple(a for a in axis_names if a not in fsdp),
                  expert=tuple(a for a in expert_axes if a in axis_names),
                  sparse_mp=tuple(a for a in axis_names if a not in table_replica_axes),
                  sparse_copy=tuple(a for a in table_replica_axes if a in axis_names))


def default_mesh(n_gpus: int, expert: int = 2, fsdp_max: int = 128) -> MeshSpec:
    """GEM's layout: expert on NVLink, FSDP up to fsdp_max GPUs in a zone, replicas across zones."""
    fsdp = min(fsdp_max, n_gpus // expert)
    return resolve_mesh_spec(f"replica=-1,fsdp={fsdp},expert={expert}", n_gpus, 8 if n_gpus >= 8 else n_gpus)


def best_mesh(n_gpus: int, work: Workload, *, axes: str = "replica,fsdp,expert",
              fsdp_axes: tuple[str, ...] = ("fsdp",), table_replica_axes: tuple[str, ...] = ("replica",),
              net: Network = Network(), max_zone_axes: tuple[str, ...] = ("fsdp", "expert"),
              **predict_kw) -> tuple[dict, int]:
    """The predicted-fastest shape of ``axes`` on n_gpus -> (predict() result, shapes tried).

    Every factorisation whose axes fit the hosts (mesh.valid_shapes, net.gpus_per_host)
    and whose max_zone_axes together stay inside one zone (net.gpus_per_zone) is
    predicted with the trainer's layout (layout_for); ties go to the earlier shape.
    predict_kw: peak, local_mfu, overlap (as predict).
    """
    spec = parse_mesh_spec(",".join(f"{a}=1" if "=" not in a else a for a in axes.split(",")))
    per_host = min(net.gpus_per_host, n_gpus)
    best, tried = None, 0
    for shape in valid_shapes(spec, n_gpus, per_host):
        sized = spec.with_shape(shape)
        if math.prod(s for n, s in zip(sized.names, shape) if n in max_zone_axes) > net.gpus_per_zone:
            continue
        tried += 1
        r = predict(sized, work, net=net, layout=layout_for(sized.names, fsdp_axes, table_replica_axes),
                    **predict_kw)
        if best is None or r["step_s"] < best["step_s"]:
            best = r
    if best is None:
        raise ValueError(f"best_mesh: no shape of {axes} fits {n_gpus} GPUs "
                         f"({per_host}/host, {net.gpus_per_zone}/zone)")
    return best, tried


# Illustrative GEM-scale workload (our assumption, not published): 2B dense + 4B expert params,
# 1024 samples/GPU, 2,000 embedding lookups/sample of dim 128, 64 expert tokens/sample of width 1024,
# 1.2e11 forward FLOPs/sample (sequence towers over ~2,000 events).
GEM_LIKE = Workload(dense_params=2e9, expert_params=4e9, local_batch=1024, lookups_per_sample=2000, emb_dim=128,
                    expert_tokens_per_sample=64, d_model=1024, forward_flops_per_sample=1.2e11)


def format_table(rows: list[dict]) -> str:
    lines = [f"{'gpus':>6} {'mesh':<30} {'compute':>9} {'comm':>9} {'step':>9} {'scaling':>8} {'e2e_mfu':>8}"]
    for r in rows:
        lines.append(f"{r['devices']:>6} {r['mesh']:<30} {r['compute_s']*1e3:>8.1f}ms {r['comm_s']*1e3:>8.1f}ms "
                     f"{r['step_s']*1e3:>8.1f}ms {r['scaling_ratio']:>8.3f} {r['e2e_mfu']:>8.3f}")
    return "\n".join(lines)


def format_collectives(result: dict) -> str:
    lines = [f"  {'collective':<28} {'axes':<18} {'ranks':>5} {'tier':<10} {'MB/GPU':>9} {'ms':>8}"]
    for c in result["collectives"]:
        lines.append(f"  {c.name:<28} {'+'.join(c.axes):<18} {c.ranks:>5} {c.tier:<10} {c.bytes/1e6:>9.1f} "
                     f"{c.seconds*1e3:>8.2f}")
    return "\n".join(lines)


if __name__ == "__main__":
    results = [predict(default_mesh(n), GEM_LIKE, overlap=0.0) for n in (64, 1024, 4096)]
    for r in results:
        print(f"{r['devices']} GPUs, {r['mesh']}")
        print(format_collectives(r))
    for overlap in (0.0, 0.8):
        print(f"predicted (overlap {overlap:.0%} of communication, local MFU 0.40, GEM_LIKE workload):")
        print(format_table([predict(default_mesh(n), GEM_LIKE, overlap=overlap) for n in (64, 1024, 4096)]))
