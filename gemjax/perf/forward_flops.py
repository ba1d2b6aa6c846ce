"""Analytic forward FLOPs per sample of every ranking model kind, on a batch's lengths.

    gflop = forward_flops(cfg, batch) / batch.dense.shape[0] / 1e9

gemjax.perf.mfu's conventions: matmuls only ([m, k] x [k, n] = 2 m k n), embedding
lookups, pooling, norms and activations 0, attention 4 H D x valid (query, key) pairs;
per-token work over the batch's valid tokens (the sum of its jagged lengths), never the
packed capacity. By model.kind:

  teacher   gemjax.perf.model_flops (the block-by-block count of the GEM teacher)
  student   gemjax.models.student.forward_flops (no per-token work: its sequence
            summaries are means)
  gem       model v0 (gemjax.models.gem.GEMv0): dense projection [F] -> [dense_tokens d];
            per sequence (model.use_sequences) and encoder layer, on its t valid tokens:
            q, k, v, out projections 4 x 2 t d^2, the FFN d -> 2d -> d 8 t d^2, and the
            self-attention's pairs (model.block-token blocks for attention "block", else
            every pair of a sample); Wukong (mfu.wukong_flops) over n tokens; the head MLP
            over Wukong's out_tokens x d -> head_mlp -> S K
  lr        the dense features' linear map [F] -> [S K] (the id weights are lookups)
"""

from __future__ import annotations

import numpy as np

from gemjax.config import Config, schema_of
from gemjax.layers.inputs import num_feature_tokens
from gemjax.perf.mfu import attention_flops, dense_flops, mlp_flops, wukong_flops

FFN_MULT = 2         # SequenceEncoder's FFN width multiple in GEMv0


def _lengths(batch, name: str) -> np.ndarray:
    off = np.asarray(batch.sequences[name].offsets, np.int64)
    return np.diff(off)


def gem_forward_flops(cfg: Config, batch) -> int:
    """Model v0's forward FLOPs on the whole batch (module docstring)."""
    f, m = schema_of(cfg), cfg.model
    b, d = int(np.asarray(batch.dense).shape[0]), m.dim
    total = dense_flops(b, f.num_dense, m.dense_tokens * d) if f.num_dense else 0
    n = num_feature_tokens(f, m.dense_tokens)
    if m.use_sequences:
        for s in f.sequence_names:
            lens = _lengths(batch, s)
            t = int(lens.sum())
            per_layer = 4 * dense_flops(t, d, d) + mlp_flops(t, (d, FFN_MULT * d, d))
            per_layer += attention_flops(lens, heads=m.seq_heads, head_dim=d // m.seq_heads,
                                         block=m.block if m.attention == "block" else None)
            total += m.seq_layers * per_layer
            n += 2
    total += wukong_flops(b, n, d, num_layers=m.wukong_layers, fmb_tokens=m.fmb_tokens,
                          lcb_tokens=m.lcb_tokens, rank=m.fm_rank, mlp_hidden=m.wukong_mlp)
    total += mlp_flops(b, ((m.fmb_tokens + m.lcb_tokens) * d, *m.head_mlp, f.num_surfaces * f.num_tasks))
    return total


def forward_flops(cfg: Config, batch) -> int:
    """Forward FLOPs of cfg's model on a host batch (one shard), by model.kind."""
    kind = cfg.model.kind
    b = int(np.asarray(batch.dense).shape[0])
    if kind == "teacher":
        from gemjax.perf.model_flops import batch_block_detail
        return sum(v.total for v in batch_block_detail(cfg, batch)["model"].values())
    if kind == "student":
        from gemjax.models.student import forward_flops as student_flops
        return b * student_flops(cfg)
    if kind == "gem":
        return gem_forward_flops(cfg, batch)
    if kind == "lr":
        f = schema_of(cfg)
        return dense_flops(b, f.num_dense, f.num_surfaces * f.num_tasks)
    raise ValueError(f"forward_flops: model.kind={kind!r} is not a ranking model "
                     f"(teacher, gem, student, lr)")
