"""The full GEM teacher: pyramid-parallel sequences -> InterFormer (Wukong / Wukong
experts interaction, GDPA summaries) -> multi-domain heads.

Same contract as models.gem.GEMv0, so the trainer can swap it in:
    GEMTeacher(cfg, rngs=...)(acts, batch) -> logits [B, K] float32

Features: the config's FeatureSchema (gemjax.data.features.schema_of).
Tokens per sample, each [D]:
  x    one per sparse feature (acts[f] [B, D]) + `dense_tokens` from a projection
       of the dense features                                      [B, n, D]
  seq  each event sequence's tokens (sum of its field embeddings, acts
       "<seq>.<field>" [T, D]) -> a PyramidEncoder per sequence (block attention,
       per-block pooling) -> concatenated per sample with type embeddings
  InterFormer(x, seq) -> [x_sum | s_sum] tokens -> flatten -> MultiDomainHead:
  per-surface gate + tower, per-task logits of each sample's own surface.

Experts' router losses: the trainer's loss only sees logits, so the weighted
load-balancing loss is attached to the logits by `attach_aux_loss` (identity in
the forward pass; in the backward pass it adds d(coef * aux)/d(params)), i.e. the
parameters get the gradient of loss + coef * aux. Under the trainer's shard_map
the model runs per batch shard inside `experts.sharded_batch(axes)`, so aux is the
global-batch figure (psum of per-shard sums, the same on every shard) and every
shard attaches it with weight coef * experts.aux_loss_scale(logits) = coef / N:
shard_map's backward (check_vma=False) transposes the psum into a psum over the N
shards, so the total gradient is d(coef * aux_global) exactly once, the one-device
gradient (tests/test_sharded_aux_loss.py).

Teacher hyper-parameters are config.ModelConfig fields (TEACHER_FIELDS); the Sequence
Arch self-attention kind is model.attention ("block" | "softmax" | "gdpa").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from gemjax.config import ModelConfig
from gemjax.data.batch import Batch
from gemjax.data.features import schema_of
from gemjax.layers.axes import dense_projection
from gemjax.layers.experts import aux_loss_scale
from gemjax.layers.heads import MultiDomainHead
from gemjax.layers.interformer import InterFormer
from gemjax.layers.pyramid import ParallelPyramid

# Teacher hyper-parameters: config.ModelConfig fields (defaults documented there).
TEACHER_FIELDS = ("interformer_layers", "summary_tokens", "cls_tokens", "pma_tokens",
                  "recent_tokens", "pyramid_levels", "num_experts", "top_k", "capacity_factor",
                  "cross_layer_attention", "qk_norm", "rope", "lb_coef", "head_towers")


def _hp(cfg, name):
    """cfg.model.<name>; duck-typed configs without the field get ModelConfig's default."""
    return getattr(cfg.model, name, getattr(ModelConfig, name))


def pyramid_levels(cfg) -> tuple:
    """The teacher's pyramid levels ((block, pooled, layers), ...): model.pyramid_levels,
    or by default two levels of model.block tokens (pool each block to 4, then encode only)."""
    block = int(getattr(cfg.model, "block", 64))
    return tuple(_hp(cfg, "pyramid_levels") or ((block, 4, 1), (block, None, 1)))


def interaction_tokens(cfg) -> tuple[int, int, int]:
    """The teacher's Interaction Arch (Wukong, or the experts) per sample:
    (input tokens n + summary tokens [X | S_sum], output tokens n, FMB tokens), with
    n the non-sequence tokens (one per sparse feature of the schema, model.dense_tokens dense)."""
    m = cfg.model
    n = len(schema_of(cfg).sparse) + m.dense_tokens
    fmb = m.fmb_tokens if m.fmb_tokens < n else n // 2
    summary = sum(_hp(cfg, k) for k in ("cls_tokens", "pma_tokens", "recent_tokens"))
    return n + summary, n, fmb


@jax.custom_vjp
def _attach(x, aux, coef):
    return x


def _attach_fwd(x, aux, coef):
    return x, coef


def _attach_bwd(coef, g):
    return g, jnp.asarray(coef, jnp.float32), jnp.zeros_like(coef)


_attach.defvjp(_attach_fwd, _attach_bwd)


def attach_aux_loss(x: jax.Array, aux: jax.Array, coef: float) -> jax.Array:
    """Returns x; gradients flowing back through x also carry coef * d(aux).

    x any array, aux a scalar; coef >= 0.
    """
    return _attach(x, aux.astype(jnp.float32), jnp.asarray(coef, jnp.float32))


class GEMTeacher(nnx.Module):
    """acts {feature: [B, D] or [T, D]}, Batch -> logits [B, K] (float32)."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        f, m = schema_of(cfg), cfg.model
        if not m.use_sequences:
            raise ValueError("GEMTeacher needs model.use_sequences=True (use GEMv0 without)")
        self.cfg = cfg
        dtype = jnp.dtype(m.dtype)
        self.dim, self.dense_tokens, self.dtype = m.dim, m.dense_tokens, dtype
        self.lb_coef = float(_hp(cfg, "lb_coef"))
        self.dense_proj = dense_projection(f.num_dense, m.dense_tokens * m.dim, dtype=dtype, rngs=rngs)
        _, n_tokens, fmb = interaction_tokens(cfg)
        block = int(getattr(m, "block", 64))
        self.pyramid = ParallelPyramid(f.sequence_names, m.dim, levels=pyramid_levels(cfg),
                                       num_heads=m.seq_heads, dtype=dtype, rngs=rngs)
        self.interformer = InterFormer(
            n_tokens, m.dim, num_layers=_hp(cfg, "interformer_layers"), num_heads=m.seq_heads,
            summary_tokens=_hp(cfg, "summary_tokens"), cls_tokens=_hp(cfg, "cls_tokens"),
            pma_tokens=_hp(cfg, "pma_tokens"), recent_tokens=_hp(cfg, "recent_tokens"),
            mlp_hidden=m.wukong_mlp, wukong_layers=m.wukong_layers, fmb_tokens=fmb,
            rank=m.fm_rank, cross_layer_attention=_hp(cfg, "cross_layer_attention"),
            num_experts=_hp(cfg, "num_experts"), top_k=_hp(cfg, "top_k"),
            capacity_factor=_hp(cfg, "capacity_factor"), seq_attention=m.attention,
            block=block,
            rope=_hp(cfg, "rope"), qk_norm=_hp(cfg, "qk_norm"), dtype=dtype, rngs=rngs)
        self.head = MultiDomainHead(self.interformer.out_tokens * m.dim, num_surfaces=f.num_surfaces,
                                    num_tasks=f.num_tasks, hidden=m.head_mlp,
                                    towers=_hp(cfg, "head_towers"), dtype=dtype, rngs=rngs)

    def __call__(self, acts: dict[str, jax.Array], batch: Batch) -> jax.Array:
        b = batch.dense.shape[0]
        f = schema_of(self.cfg)
        tokens = [acts[n][:, None, :] for n in f.sparse_names]
        tokens.append(self.dense_proj(batch.dense).reshape(b, self.dense_tokens, self.dim))
        x = jnp.concatenate([t.astype(self.dtype) for t in tokens], axis=1)
        seqs = {s: (sum(acts[f"{s}.{n}"] for n in fields).astype(self.dtype), batch.sequences[s])
                for s, fields in f.id_fields.items()}
        seq, jag = self.pyramid(seqs)
        summary, aux = self.interformer(x, seq, jag)
        logits = self.head(summary.reshape(b, -1), batch.surface)
        if "load_balance_loss" in aux and self.lb_coef:
            logits = attach_aux_loss(logits, aux["load_balance_loss"],
                                     self.lb_coef * aux_loss_scale(logits))
        return logits
