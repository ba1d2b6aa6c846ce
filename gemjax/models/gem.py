"""GEM model v0: sparse embeddings -> feature tokens -> Wukong -> per-surface, per-task heads.

Tokens per sample (each [D]):
  one per sparse feature (looked up outside the model, see gemjax.sparse),
  `dense_tokens` from a projection of the dense features,
  per event sequence: the event tokens (sum of the item, category and event-type
  embeddings) go through a jagged SequenceEncoder, then pool into two tokens:
  the mean over the whole history and the mean over the `recent` newest events.
Wukong mixes the tokens; an MLP head gives logits for every (surface, task);
each sample keeps the row of its own surface.

`LogisticRegression` is the baseline on the same features: one weight per id
per (surface, task), a linear map of the dense features, and the mean of each
sequence field's weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from gemjax.config import Config
from gemjax.data.batch import Batch
from gemjax.data.jagged import Jagged
from gemjax.data.synthetic import SEQUENCE_FIELDS, SEQUENCES, SPARSE_FEATURES
from gemjax.layers.mlp import MLP
from gemjax.layers.sequence import SequenceEncoder, mean_pool
from gemjax.layers.wukong import Wukong
from gemjax.sparse import RowWiseAdagrad, TableSpec

_TABLE_FEATURES = {           # table -> (plain features, sequence fields)
    "user": (("user",), ()),
    "segment": (("segment",), ()),
    "context": (("context",), ()),
    "item": (("item",), ("item",)),
    "category": (("item_cat",), ("cat",)),
    "event": ((), ("event",)),
}


def sequence_id_fields(cfg: Config) -> dict[str, tuple[str, ...]]:
    """{sequence: fields looked up in tables} (empty when sequences are off)."""
    return {s: SEQUENCE_FIELDS for s in SEQUENCES} if cfg.model.use_sequences else {}


def table_specs(cfg: Config) -> list[TableSpec]:
    """One TableSpec per table. The LR baseline stores S*K weights per id."""
    d, m = cfg.data, cfg.model
    dim = d.num_surfaces * d.num_tasks if m.kind == "lr" else m.dim
    vocab = {"user": d.vocab_user, "segment": d.vocab_segment, "context": d.vocab_context,
             "item": d.vocab_item, "category": d.num_categories, "event": d.num_event_types}
    opt = RowWiseAdagrad(lr=cfg.train.sparse_lr)
    specs = []
    for name, (plain, fields) in _TABLE_FEATURES.items():
        feats = list(plain)
        if m.use_sequences:
            feats += [f"{s}.{f}" for s in SEQUENCES for f in fields]
        if feats:
            specs.append(TableSpec(name, vocab[name], dim, tuple(feats), optimizer=opt,
                                   init_scale=0.0 if m.kind == "lr" else None))
    return specs


def recent_mean_pool(x: jax.Array, jagged: Jagged, recent: int) -> jax.Array:
    """Mean over each sample's `recent` newest tokens: x [T, d] -> [B, d] (0 if empty)."""
    b = jagged.num_samples
    seg = jagged.segment_ids
    lengths = jnp.concatenate([jagged.lengths, jnp.zeros((1,), jagged.lengths.dtype)])
    keep = jagged.mask & (jagged.positions >= jnp.take(lengths, seg) - recent)
    s = jax.ops.segment_sum(jnp.where(keep[:, None], x.astype(jnp.float32), 0.0), seg,
                            num_segments=b + 1)[:b]
    n = jnp.maximum(jnp.minimum(jagged.lengths, recent), 1).astype(jnp.float32)[:, None]
    return (s / n).astype(x.dtype)


def _pick_surface(logits_all: jax.Array, surface: jax.Array) -> jax.Array:
    """[B, S, K] -> [B, K] (each sample's own surface)."""
    return jnp.take_along_axis(logits_all, surface[:, None, None], axis=1)[:, 0]


class GEMv0(nnx.Module):
    """acts {feature: [B, D] or [T, D]}, Batch -> logits [B, K] (float32)."""

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        d, m = cfg.data, cfg.model
        self.cfg = cfg
        dtype = jnp.dtype(m.dtype)
        self.dense_proj = nnx.Linear(d.num_dense, m.dense_tokens * m.dim, dtype=dtype,
                                     param_dtype=jnp.float32, rngs=rngs)
        n_tokens = len(SPARSE_FEATURES) + m.dense_tokens
        self.encoders = nnx.Dict({
            s: SequenceEncoder(m.dim, num_layers=m.seq_layers, num_heads=m.seq_heads,
                               attention=m.attention, block=m.block, dtype=dtype, rngs=rngs)
            for s in (SEQUENCES if m.use_sequences else ())})
        n_tokens += 2 * len(self.encoders)
        self.wukong = Wukong(n_tokens, m.dim, num_layers=m.wukong_layers, fmb_tokens=m.fmb_tokens,
                             lcb_tokens=m.lcb_tokens, rank=m.fm_rank, mlp_hidden=m.wukong_mlp,
                             dtype=dtype, rngs=rngs)
        self.head = MLP(self.wukong.out_tokens * m.dim, m.head_mlp, d.num_surfaces * d.num_tasks,
                        dtype=dtype, rngs=rngs)

    def __call__(self, acts: dict[str, jax.Array], batch: Batch) -> jax.Array:
        d, m = self.cfg.data, self.cfg.model
        b = batch.dense.shape[0]
        tokens = [acts[f][:, None, :] for f in SPARSE_FEATURES]
        tokens.append(self.dense_proj(batch.dense).reshape(b, m.dense_tokens, m.dim))
        if m.use_sequences:
            for s in SEQUENCES:
                jag = batch.sequences[s]
                x = sum(acts[f"{s}.{f}"] for f in SEQUENCE_FIELDS)
                x = self.encoders[s](x, jag)
                tokens += [mean_pool(x, jag)[:, None], recent_mean_pool(x, jag, d.recent)[:, None]]
        x = jnp.concatenate([t.astype(jnp.dtype(m.dtype)) for t in tokens], axis=1)
        y = self.wukong(x)
        logits = self.head(y.reshape(b, -1)).astype(jnp.float32)
        return _pick_surface(logits.reshape(b, d.num_surfaces, d.num_tasks), batch.surface)


class LogisticRegression(nnx.Module):
    """The baseline: acts hold S*K weights per id; logits [B, K]."""

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        d = cfg.data
        self.cfg = cfg
        self.dense = nnx.Linear(d.num_dense, d.num_surfaces * d.num_tasks, rngs=rngs)

    def __call__(self, acts: dict[str, jax.Array], batch: Batch) -> jax.Array:
        d = self.cfg.data
        b = batch.dense.shape[0]
        z = self.dense(batch.dense) + sum(acts[f] for f in SPARSE_FEATURES)
        if self.cfg.model.use_sequences:
            for s in SEQUENCES:
                jag = batch.sequences[s]
                z = z + sum(mean_pool(acts[f"{s}.{f}"], jag) for f in SEQUENCE_FIELDS)
        return _pick_surface(z.reshape(b, d.num_surfaces, d.num_tasks), batch.surface)


def build_model(cfg: Config, rngs: nnx.Rngs) -> nnx.Module:
    """model.kind: "gem" (v0), "teacher" (gemjax.models.interformer.GEMTeacher) or "lr"."""
    if cfg.model.kind == "lr":
        return LogisticRegression(cfg, rngs=rngs)
    if cfg.model.kind == "teacher":
        from gemjax.models.interformer import GEMTeacher   # imports this module's helpers
        return GEMTeacher(cfg, rngs=rngs)
    return GEMv0(cfg, rngs=rngs)
