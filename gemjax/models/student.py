"""Students: small vertical models on the teacher's feature schema (model.kind="student").

Tokens per sample (each [w], w = model.student.width or model.dim; the features' tokens
from gemjax.layers.inputs):
  one per sparse feature (its looked-up row),
  `dense_tokens` from a projection of the dense features,
  per event sequence a short summary, no attention: the mean of the event embeddings
  (sum of the fields' rows) over the whole history and over the `student_recent`
  newest events (two tokens),
  with model.student.teacher_repr_dim = E > 0: one token projected from the teacher features
  the batch carries (DistillBatch.teacher_repr [B, E]; representation transfer).
When student_width differs from model.dim, the looked-up rows (model.dim wide: tables
shared with a teacher of that width) pass through one projection [dim, w] (after the
sequence pooling, which commutes with it).

Interaction (model.student.arch):
  "dlrm"    the pairwise dot products of the n tokens (upper triangle, n (n-1) / 2)
            next to the flattened tokens, then the head MLP;
  "wukong"  a Wukong stack (model.wukong_layers, fmb/lcb tokens, fm_rank, wukong_mlp),
            then the head MLP over its flattened output.
The head (model.head_mlp) gives logits for every (surface, task); each sample keeps
its surface's row: logits [B, K] float32.

`forward_flops(cfg)` counts the forward's matmul FLOPs per sample (2 m k n per
[m, k] x [k, n], lookups and pooling 0: gemjax.perf.mfu's conventions).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from gemjax.config import Config, schema_of
from gemjax.data.batch import Batch
from gemjax.layers.axes import ConstantTokens, linear
from gemjax.layers.inputs import (num_feature_tokens, num_sparse_tokens, project_dense,
                                  sequence_tokens, sparse_token_list)
from gemjax.layers.mlp import MLP
from gemjax.layers.sequence import mean_pool
from gemjax.layers.wukong import Wukong

REPR_TOKENS = 1      # tokens projected from the teacher features (2 and 4 fitted worse in 50 steps)


def recent_mean(x: jax.Array, jagged, recent: int) -> jax.Array:
    """Mean over each sample's `recent` newest tokens: x [T, d] -> [B, d] float32 (0 if
    empty). Tokens are oldest first, so the newest `recent` have positions >= length - recent."""
    b = jagged.num_samples
    seg = jnp.asarray(jagged.segment_ids)
    length = jnp.concatenate([jagged.lengths, jnp.zeros((1,), jagged.lengths.dtype)])[seg]
    keep = jagged.mask & (jagged.positions >= length - recent)
    s = jax.ops.segment_sum(jnp.where(keep[:, None], x.astype(jnp.float32), 0.0), seg,
                            num_segments=b + 1)[:b]
    return s / jnp.maximum(jnp.minimum(jagged.lengths, recent), 1).astype(jnp.float32)[:, None]


def width(cfg: Config) -> int:
    """The student's token width w."""
    return cfg.model.student.width or cfg.model.dim


def num_tokens(cfg: Config) -> int:
    """n: sparse + dense + 2 per sequence + REPR_TOKENS with teacher features."""
    f, m = schema_of(cfg), cfg.model
    return (num_feature_tokens(f, m.dense_tokens) + 2 * len(f.sequence_names)
            + (REPR_TOKENS if m.student.teacher_repr_dim else 0))


class Student(nnx.Module):
    """acts {feature: [B, dim] or [T, dim]}, Batch (a DistillBatch with teacher
    features when model.student.teacher_repr_dim > 0) -> logits [B, K] float32."""

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        f, m = schema_of(cfg), cfg.model
        self.cfg = cfg
        dtype = jnp.dtype(m.dtype)
        w, n = width(cfg), num_tokens(cfg)
        self.proj = (linear(m.dim, w, use_bias=False, names=("embed", None), dtype=dtype, rngs=rngs)
                     if w != m.dim else None)
        self.dense_proj = (linear(f.num_dense, m.dense_tokens * w, dtype=dtype, rngs=rngs)
                           if f.num_dense else ConstantTokens(m.dense_tokens * w, dtype=dtype))
        self.repr_proj = (linear(m.student.teacher_repr_dim, REPR_TOKENS * w, dtype=dtype, rngs=rngs)
                          if m.student.teacher_repr_dim else None)
        out = f.num_surfaces * f.num_tasks
        if m.student.arch == "wukong":
            self.wukong = Wukong(n, w, num_layers=m.wukong_layers, fmb_tokens=m.fmb_tokens,
                                 lcb_tokens=m.lcb_tokens, rank=m.fm_rank, mlp_hidden=m.wukong_mlp,
                                 dtype=dtype, rngs=rngs)
            head_in = self.wukong.out_tokens * w
        else:
            self.wukong = None
            head_in = n * (n - 1) // 2 + n * w
        self.head = MLP(head_in, m.head_mlp, out, dtype=dtype, rngs=rngs)

    def sequence_summary(self, acts: dict[str, jax.Array], batch: Batch) -> list[jax.Array]:
        """Per sequence, its two summary tokens [B, dim] (whole-history mean, recent mean)."""
        out = []
        for x, jag in sequence_tokens(acts, batch.sequences, schema_of(self.cfg)).values():
            out += [mean_pool(x, jag), recent_mean(x, jag, self.cfg.model.student.recent)]
        return out

    def __call__(self, acts: dict[str, jax.Array], batch: Batch) -> jax.Array:
        f, m = schema_of(self.cfg), self.cfg.model
        dtype = jnp.dtype(m.dtype)
        b, w = batch.dense.shape[0], width(self.cfg)
        rows = sparse_token_list(acts, f) + [r[:, None] for r in self.sequence_summary(acts, batch)]
        x = jnp.concatenate([r.astype(dtype) for r in rows], axis=1)    # [B, n_rows, dim]
        if self.proj is not None:
            x = self.proj(x)
        tokens = [x, project_dense(self.dense_proj, batch.dense, m.dense_tokens, w).astype(dtype)]
        if self.repr_proj is not None:
            tokens.append(self.repr_proj(batch.teacher_repr.astype(dtype))
                          .reshape(b, REPR_TOKENS, w))
        x = jnp.concatenate(tokens, axis=1)                              # [B, n, w]
        if self.wukong is not None:
            h = self.wukong(x).reshape(b, -1)
        else:
            n = x.shape[1]
            dots = jnp.einsum("bnd,bmd->bnm", x, x)
            iu, ju = jnp.triu_indices(n, k=1)
            h = jnp.concatenate([dots[:, iu, ju], x.reshape(b, -1)], axis=1)
        logits = self.head(h).astype(jnp.float32).reshape(b, f.num_surfaces, f.num_tasks)
        return jnp.take_along_axis(logits, batch.surface[:, None, None], axis=1)[:, 0]


def _mlp_flops(dims) -> int:
    return sum(2 * a * c for a, c in zip(dims[:-1], dims[1:]))


def forward_flops(cfg: Config) -> int:
    """Matmul FLOPs of one sample's forward (module docstring)."""
    f, m = schema_of(cfg), cfg.model
    w, n = width(cfg), num_tokens(cfg)
    rows = num_sparse_tokens(f) + 2 * len(f.sequence_names)
    flops = 2 * rows * m.dim * w if w != m.dim else 0
    flops += 2 * f.num_dense * m.dense_tokens * w
    flops += 2 * m.student.teacher_repr_dim * REPR_TOKENS * w
    out = f.num_surfaces * f.num_tasks
    if m.student.arch == "wukong":
        t = n
        o = m.fmb_tokens + m.lcb_tokens
        for _ in range(m.wukong_layers):
            if m.fmb_tokens:
                flops += 2 * (2 * t * w * m.fm_rank)                        # X^T Y, X (X^T Y)
                flops += _mlp_flops((t * m.fm_rank,) + tuple(m.wukong_mlp) + (m.fmb_tokens * w,))
            flops += 2 * m.lcb_tokens * t * w
            if o != t:
                flops += 2 * o * t * w                                      # residual projection
            t = o
        head_in = o * w
    else:
        flops += 2 * n * n * w                                              # X X^T
        head_in = n * (n - 1) // 2 + n * w
    return flops + _mlp_flops((head_in,) + tuple(m.head_mlp) + (out,))
