"""Analytic model FLOPs of the GEM teacher, block by block (a stable MFU numerator).

XLA's cost analysis of the compiled step is not a stable numerator: on GPU it can
drop GEMMs depending on autotuning (the same pyramid block read 964 and 226 GFLOP
fwd+bwd in two compiles on an H200) and sees nothing inside Pallas calls. This
module counts the teacher's forward from its description (the TeacherArch of the
config, gemjax.models.interformer.teacher_arch: the same shapes and block names the
model is built from) and the batch's jagged lengths alone, with gemjax.perf.mfu's
conventions:

- matmuls only, [m, k] x [k, n] = 2 m k n; norms, activations, gates, RoPE,
  residual adds, masks, gathers/scatters (expert dispatch, concat_jagged,
  last_tokens) are 0;
- jagged attention (the kernels/ calls: block attention, softmax / GDPA cross
  attention, PMA, the personalized FFN, CLS attention and the pyramid's
  per-block pooling) = 4 H D x valid (query, key) pairs, the pairs of
  attention_calls (so the attention term agrees exactly with what the
  Pallas kernels compute). The pyramid pooling is an attention of `pooled`
  learned queries over each block's tokens: it counts as such on every backend
  (on GPU it is a jagged_attention kernel call; elsewhere an einsum);
- embedding lookups (and the sum of a sequence's field embeddings) are 0;
- a train step = 3 x forward (mfu.train_step_flops).

Rows of the per-token work (projections, FFNs) are the *valid* tokens of the
batch, sum of the jagged lengths (level l+1 of the pyramid: ceil(L / block) *
pooled tokens per sample), never the static packed capacity; the mixture of
Wukong experts runs top_k experts per sample (plus the router), never the
[E, C] dispatch buffer. Padding is hardware work, not model work, so MFU made
with this count charges the padding to the step time.

``capacities`` (optional) switches to the padded program instead: per-token work
over the static buffers (T per sequence at level 0, NB * pooled after each pooling
with NB = layers.pyramid.num_blocks: ceil(T_l / block) + B, rounded up so that NB *
pooled is a multiple of 128; the merged InterFormer buffer the sum of the top ones), the experts over all E x C dispatch slots, the per-block pool queries
over all NB static blocks. That is what the compiled program executes (apart
from attention, still valid pairs: the Pallas kernels skip the rest), so it is
comparable with XLA's own count; tests/test_model_flops.py checks it against
XLA's CPU cost analysis block by block.

Per-block formulas (B samples, d = model.dim, n non-sequence tokens, t = tokens
of the sequence buffer the block reads; every "proj" is d -> d):

  inputs        dense_proj [B, num_dense] -> [B, dense_tokens * d]
  pyramid       per sequence, per level: each block-attention layer 4 proj + FFN
                (d -> 2d -> d) on t tokens; pooling: k, v proj on t tokens, q and
                out proj on pooled x (valid) blocks rows (the learned queries are
                tiled per block, as the kernel path runs them); + attention
  cross         x_summary MLP (n d -> wukong_mlp -> m d) on B rows, x gate on
                B m rows, PMA q / out proj on B p rows and k / v proj on t rows,
                s gate on B (c + p + r) rows; + PMA attention
  interaction   [router n_in d -> E on B rows] + Wukong (mfu.wukong_layer_flops
                per layer, n_in -> n then n -> n tokens) on B (or top_k B) rows,
                + cross-layer attention before layer i >= 1 (TokenCrossAttention,
                per sample: q / out proj on n tokens, k / v proj on n_in + i n,
                and its dense attention, every pair valid, 4 d n (n_in + i n))
  sequence      personalized FFN q / out proj on t rows, k / v proj on B m rows;
                self-attention 4 proj on t rows; FFN on t rows; CLS attention
                q / out proj on B c rows, k / v proj on t rows; + attention
  final_cross   as cross
  head          MultiDomainHead: every surface's tower on every sample, as the
                model computes them (per_surface: S MLPs F -> head_mlp -> K on B
                rows; shared: one MLP F -> head_mlp -> S K on B S rows), F =
                (m + c + p + r) d

    PYTHONPATH=. python -m gemjax.perf.model_flops --config=h200 \\
        --override=model.kind=teacher,model.teacher.num_experts=4,model.teacher.top_k=2

prints the per-block forward GFLOP and the step total for one batch of the config's source.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Mapping, Sequence

import numpy as np

from gemjax.config import Config, schema_of
from gemjax.layers.experts import expert_capacity
from gemjax.layers.pyramid import num_blocks
from gemjax.models.interformer import teacher_arch
from gemjax.perf.mfu import attention_flops, dense_flops, mlp_flops, train_step_flops, wukong_layer_flops
from kernels.common import default_impl


@dataclasses.dataclass(frozen=True)
class BlockFlops:
    """Forward FLOPs of one block: matmul (every non-kernel matmul) + attention (kernel calls)."""

    matmul: int
    attention: int

    @property
    def total(self) -> int:
        return self.matmul + self.attention


# --------------------------------------------------------------------------- attention calls


@dataclasses.dataclass(frozen=True)
class AttentionCall:
    """One kernels/ attention call of the teacher's forward, with its jagged lengths.

    op: "gdpa" | "softmax" | "block" (kernels.gdpa / jagged_attention / block_attention);
    q_lengths, kv_lengths: [N] per-segment lengths of the call's offsets.
    """

    block: str
    name: str
    op: str
    q_lengths: np.ndarray
    kv_lengths: np.ndarray
    heads: int
    head_dim: int
    block_size: int | None = None

    @property
    def forward_flops(self) -> int:
        """4 H D x valid (query, key) pairs (mfu.attention_flops)."""
        return attention_flops(self.q_lengths, self.kv_lengths, heads=self.heads,
                               head_dim=self.head_dim, block=self.block_size)


_KERNEL_OPS = {"gdpa": "gdpa", "softmax": "jagged_attention", "block": "block_attention"}


def runs_in_pallas(op: str, head_dim: int, backend: str | None = None) -> bool:
    """Whether kernels/ picks its Pallas kernel for ``op`` (impl=None) on ``backend``
    (the ops' own rule, kernels.common.default_impl)."""
    return default_impl(_KERNEL_OPS[op], head_dim, backend) == "pallas"


def block_lengths(lengths: np.ndarray, block: int) -> np.ndarray:
    """[B] sample lengths -> [sum ceil(L / block)] lengths of their `block`-token blocks."""
    lengths = np.asarray(lengths, np.int64)
    n = -(-lengths // block)
    out = np.full(int(n.sum()), block, np.int64)
    last = np.cumsum(n)[n > 0] - 1
    out[last] = lengths[n > 0] - (n[n > 0] - 1) * block
    return out


def attention_calls(cfg: Config, seq_lengths: Mapping[str, np.ndarray],
                    backend: str | None = None) -> list[AttentionCall]:
    """Every attention call of GEMTeacher's forward on one device's batch, in call order.

    seq_lengths: {sequence name: [B] tokens per sample} (the batch's jagged lengths).
    backend (default jax.default_backend()): the pyramid's per-block pooling is a
    kernel call only where jagged_attention runs in Pallas there.
    """
    a = teacher_arch(cfg)
    hd = a.dim // a.heads
    calls: list[AttentionCall] = []

    def add(block, name, op, q, kv, block_size=None):
        calls.append(AttentionCall(block, name, op, np.asarray(q, np.int64), np.asarray(kv, np.int64),
                                   a.heads, hd, block_size))

    top = []
    for s in a.sequences:
        lengths = np.asarray(seq_lengths[s], np.int64)
        for li, (b, pooled, layers) in enumerate(a.levels):
            for j in range(layers):
                add("pyramid", f"{s}.level{li}.attn{j}", "block", lengths, lengths, b)
            if pooled is not None:
                # per-block pooling (PyramidLevel.pools_in_kernel): a jagged_attention call
                # (pooled queries per block over its tokens) where that kernel runs in
                # Pallas on `backend`, else a plain einsum that XLA counts itself
                if runs_in_pallas("softmax", hd, backend):
                    kv = block_lengths(lengths, b)
                    add("pyramid", f"{s}.level{li}.pool", "softmax", np.full(kv.shape, pooled), kv)
                lengths = -(-lengths // b) * pooled
        top.append(lengths)
    merged = np.sum(top, axis=0)
    b_samples = merged.shape[0]

    def cross(block):
        if a.pma:
            add(block, "pma", "gdpa", np.full(b_samples, a.pma), merged)

    for i in range(a.layers):
        cross(f"interformer{i}.cross")
        name = f"interformer{i}.sequence"
        add(name, "pffn", "gdpa", merged, np.full(b_samples, a.summary))
        add(name, "self_attn", a.attention, merged, merged, a.block if a.attention == "block" else None)
        if a.cls:
            add(name, "cls_attn", "softmax", np.full(b_samples, a.cls), merged)
    cross("final_cross")
    return calls


def shard_seq_lengths(batch, num_shards: int) -> list[dict[str, np.ndarray]]:
    """Per device shard {sequence: [B_local] lengths} of a host batch of concatenated shards."""
    out = [dict() for _ in range(num_shards)]
    for s, jag in batch.sequences.items():
        off = np.asarray(jag.offsets).reshape(num_shards, -1)
        for i in range(num_shards):
            out[i][s] = np.diff(off[i])
    return out


# --------------------------------------------------------------------------- per-block count


def _ceil_div(a, b):
    return -(-a // b)


def _proj(rows: int, d: int, count: int = 1) -> int:
    """`count` d -> d projections of `rows` tokens."""
    return count * dense_flops(rows, d, d)


def _check(cfg: Config, seq_lengths: Mapping[str, np.ndarray],
           capacities: Mapping[str, int] | None) -> dict[str, np.ndarray]:
    if cfg.model.kind != "teacher":
        raise ValueError(f"model_flops: model.kind must be 'teacher', got {cfg.model.kind!r}")
    if not cfg.model.use_sequences:
        raise ValueError("model_flops: the teacher needs model.use_sequences=True")
    seqs = schema_of(cfg).sequence_names
    missing = [s for s in seqs if s not in seq_lengths]
    if missing:
        raise ValueError(f"model_flops: seq_lengths lacks sequences {missing} (need {seqs})")
    lens = {s: np.asarray(seq_lengths[s], np.int64) for s in seqs}
    shapes = {v.shape for v in lens.values()}
    if len(shapes) != 1 or len(next(iter(shapes))) != 1 or any((v < 0).any() for v in lens.values()):
        raise ValueError(f"model_flops: seq_lengths must be [B] arrays of lengths >= 0 with one B, "
                         f"got shapes {sorted(map(str, shapes))}")
    if capacities is not None:
        bad = {s: capacities.get(s) for s in seqs
               if capacities.get(s) is None or capacities[s] < lens[s].sum()}
        if bad:
            raise ValueError(f"model_flops: capacities must give every sequence's packed "
                             f"capacity >= its tokens, got {bad}")
    return lens


def teacher_block_detail(cfg: Config, seq_lengths: Mapping[str, np.ndarray],
                         capacities: Mapping[str, int] | None = None) -> dict[str, BlockFlops]:
    """{block: BlockFlops} of GEMTeacher's forward on one batch (or one device's shard).

    cfg: a config with model.kind == "teacher"; seq_lengths: {sequence: [B] tokens
    per sample} for every sequence (shard_seq_lengths of a batch);
    capacities: None for model FLOPs (valid tokens), or {sequence: packed capacity
    T} for the padded program's count (module docstring). Blocks: the teacher's
    TeacherArch.block_names(), in model order. attention: the kernels/ calls
    (attention_calls, the pyramid pooling always included); matmul:
    everything else, the dense cross-layer attention of Wukong included.
    """
    lens = _check(cfg, seq_lengths, capacities)
    a = teacher_arch(cfg)
    d, heads = a.dim, a.heads
    padded = capacities is not None
    b = int(next(iter(lens.values())).shape[0])
    matmul: dict[str, int] = {k: 0 for k in a.block_names()}
    attn: dict[str, int] = {}

    def add(block: str, flops: int) -> None:
        matmul[block] += int(flops)

    # inputs: the dense projection (feature tokens and sequence field sums are lookups / adds)
    add("inputs", dense_flops(b, a.num_dense, a.dense_tokens * d))

    # pyramid: per sequence, per level; lengths / buffer rows carried level to level
    pools: list[AttentionCall] = []
    top_tokens = 0
    ffn = (d, a.ffn_mult * d, d)
    for s in lens:
        lengths = lens[s]
        cap = int(capacities[s]) if padded else 0
        for li, (blk, pooled, layers) in enumerate(a.levels):
            t = cap if padded else int(lengths.sum())
            add("pyramid", layers * (_proj(t, d, 4) + mlp_flops(t, ffn)))
            if pooled is None:
                continue
            # blocks: valid ones (sum ceil(L / block)) or the static bound (num_blocks)
            nb = num_blocks(cap, blk, b, pooled) if padded else int(_ceil_div(lengths, blk).sum())
            add("pyramid", _proj(t, d, 2) + _proj(nb * pooled, d, 2))     # k, v; tiled q, out
            kv = block_lengths(lengths, blk)
            pools.append(AttentionCall("pyramid", f"{s}.level{li}.pool", "softmax",
                                       np.full(kv.shape, pooled), kv, heads, d // heads))
            lengths = _ceil_div(lengths, blk) * pooled
            cap = nb * pooled
        top_tokens += cap if padded else int(lengths.sum())

    # InterFormer: t = the merged sequence buffer every layer reads
    t = top_tokens
    n_in, n, msum = a.tokens_in, a.tokens, a.summary

    def cross(block: str) -> None:
        add(block, mlp_flops(b, (n * d, *a.wukong_mlp, msum * d)) + _proj(b * msum, d))
        if a.pma:
            add(block, _proj(b * a.pma, d, 2) + _proj(t, d, 2))
        add(block, _proj(b * a.seq_summary, d))

    if a.experts:        # Wukong rows: samples x experts run (or every dispatch slot, padded)
        rows = (a.experts * expert_capacity(b, a.experts, a.top_k, a.capacity_factor) if padded
                else a.top_k * b)
    else:
        rows = b
    for i in range(a.layers):
        cross(f"interformer{i}.cross")
        block = f"interformer{i}.interaction"
        if a.experts:
            add(block, dense_flops(b, n_in * d, a.experts))               # router
        tokens = n_in
        for j in range(a.wukong_layers):
            if j and a.cross_layer_attention:
                mem = n_in + j * n            # X_0, then the outputs of layers 0 .. j-1
                add(block, _proj(rows * tokens, d, 2) + _proj(rows * mem, d, 2)
                    + 4 * rows * tokens * mem * d)                        # dense: every pair valid
            add(block, wukong_layer_flops(rows, tokens, d, fmb_tokens=a.fmb, lcb_tokens=a.lcb,
                                          rank=a.rank, mlp_hidden=a.wukong_mlp))
            tokens = n
        block = f"interformer{i}.sequence"
        add(block, _proj(t, d, 2) + _proj(b * msum, d, 2))                # personalized FFN
        add(block, _proj(t, d, 4) + mlp_flops(t, ffn))                    # self-attention, FFN
        if a.cls:
            add(block, _proj(b * a.cls, d, 2) + _proj(t, d, 2))           # CLS attention
    cross("final_cross")

    feats = a.out_tokens * d
    if a.head_towers == "per_surface":
        add("head", a.surfaces * mlp_flops(b, (feats, *a.head_mlp, a.tasks)))
    else:
        add("head", mlp_flops(b * a.surfaces, (feats, *a.head_mlp, a.surfaces * a.tasks)))

    # attention: the kernels' valid pairs; backend "cpu" lists every call but the pooling,
    # which is added above on every backend
    for call in attention_calls(cfg, lens, backend="cpu") + pools:
        attn[call.block] = attn.get(call.block, 0) + call.forward_flops
    return {k: BlockFlops(v, attn.get(k, 0)) for k, v in matmul.items()}


def teacher_block_flops(cfg: Config, seq_lengths: Mapping[str, np.ndarray],
                        capacities: Mapping[str, int] | None = None) -> dict[str, int]:
    """{block: forward FLOPs} of the teacher on one batch / shard (teacher_block_detail's totals).

    Block names and order as TeacherArch.block_names(): inputs, pyramid,
    interformer{i}.cross / .interaction / .sequence, final_cross, head.
    """
    return {k: v.total for k, v in teacher_block_detail(cfg, seq_lengths, capacities).items()}


def teacher_step_flops(cfg: Config, seq_lengths: Mapping[str, np.ndarray],
                       capacities: Mapping[str, int] | None = None) -> int:
    """Model FLOPs of one train step on the batch: 3 x the forward sum of the blocks."""
    return train_step_flops(sum(teacher_block_flops(cfg, seq_lengths, capacities).values()))


def batch_block_detail(cfg: Config, batch, num_shards: int = 1) -> dict[str, dict[str, BlockFlops]]:
    """{"model" | "padded": {block: BlockFlops summed over the shards}} of a host batch.

    batch: num_shards device shards concatenated (as the Feeder builds it; one
    shard = one source batch, e.g. SyntheticStream.shard_batch); every shard's capacity is its share
    of batch.sequences[s].capacity.
    """
    out: dict[str, dict[str, BlockFlops]] = {"model": {}, "padded": {}}
    caps = {s: batch.sequences[s].capacity // num_shards for s in schema_of(cfg).sequence_names}
    for lens in shard_seq_lengths(batch, num_shards):
        for kind, cap in (("model", None), ("padded", caps)):
            for k, v in teacher_block_detail(cfg, lens, cap).items():
                o = out[kind].get(k, BlockFlops(0, 0))
                out[kind][k] = BlockFlops(o.matmul + v.matmul, o.attention + v.attention)
    return out


def batch_step_flops(cfg: Config, batch, num_shards: int = 1) -> int:
    """Model FLOPs of one train step on a host batch of num_shards device shards (all
    devices together): the MFU numerator, sum over shards of teacher_step_flops."""
    return sum(teacher_step_flops(cfg, lens) for lens in shard_seq_lengths(batch, num_shards))


def format_report(flops: dict[str, dict[str, BlockFlops]], samples: int) -> str:
    """Per-block forward GFLOP table (model and padded counts) and the step totals."""
    g = 1e-9
    rows = [f"{'block':28s} {'fwd GFLOP':>10s} {'of which attn':>14s} {'padded fwd':>11s} "
            f"{'step (3x)':>10s}"]
    for name, v in flops["model"].items():
        pv = flops["padded"][name]
        rows.append(f"{name:28s} {v.total * g:10.2f} {v.attention * g:14.2f} {pv.total * g:11.2f} "
                    f"{train_step_flops(v.total) * g:10.2f}")
    fwd = sum(v.total for v in flops["model"].values())
    attn = sum(v.attention for v in flops["model"].values())
    pad = sum(v.total for v in flops["padded"].values())
    rows.append(f"{'total':28s} {fwd * g:10.2f} {attn * g:14.2f} {pad * g:11.2f} "
                f"{train_step_flops(fwd) * g:10.2f}")
    rows.append(f"train step: {train_step_flops(fwd) * g:.2f} GFLOP model "
                f"({train_step_flops(fwd) / max(samples, 1) * 1e-6:.2f} MFLOP / sample), "
                f"{train_step_flops(pad) * g:.2f} GFLOP padded program")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> None:
    from gemjax.config import get_config
    from gemjax.data.feeding import concat_shards
    from gemjax.data.source import make_source

    ap = argparse.ArgumentParser(description="Analytic per-block forward FLOPs of the GEM teacher "
                                             "(model.kind=teacher is applied before --override).")
    ap.add_argument("--config", default="small", help="preset")
    ap.add_argument("--override", default="", help="section.field=value,...")
    ap.add_argument("--step", type=int, default=0, help="batch index of the source")
    ap.add_argument("--shards", type=int, default=1, help="batch shards (devices); totals sum them")
    args = ap.parse_args(argv)
    overrides = ",".join(o for o in ("model.kind=teacher", args.override) if o)
    if args.shards < 1 or args.step < 0:
        ap.error(f"--shards must be >= 1 and --step >= 0, got {args.shards} and {args.step}")
    try:
        cfg = get_config(args.config, overrides)
        _check(cfg, {s: np.zeros(1, np.int64) for s in schema_of(cfg).sequence_names}, None)
        stream = make_source(cfg, seed=0)
        batch = concat_shards([stream.shard_batch(args.step, i, args.shards)[0] for i in range(args.shards)])
    except ValueError as e:
        ap.error(str(e))
    flops = batch_block_detail(cfg, batch, args.shards)
    print(f"{cfg.name} ({overrides}): batch {args.step}, "
          f"{batch.dense.shape[0]} samples in {args.shards} shard(s), sequence tokens "
          + ", ".join(f"{s} {int(np.diff(np.asarray(batch.sequences[s].offsets)).sum())}"
                      f"/{batch.sequences[s].capacity}" for s in schema_of(cfg).sequence_names))
    print(format_report(flops, batch.dense.shape[0]))


if __name__ == "__main__":
    main()
