"""GEM model v0: sparse embeddings -> feature tokens -> Wukong -> per-surface, per-task heads.

The features come from the config's FeatureSchema (gemjax.config.schema_of):
its tables become the TableSpecs, its sparse features, dense columns, sequences and
surfaces x tasks shape the model.

Tokens per sample (each [D]; the feature and sequence tokens from gemjax.layers.inputs):
  one per sparse feature (looked up outside the model, see gemjax.sparse),
  `dense_tokens` from a projection of the dense features,
  per event sequence: the event tokens (sum of its fields' embeddings, e.g. item,
  category and event type) go through a jagged SequenceEncoder, then pool into two tokens:
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

from gemjax.config import Config, schema_of
from gemjax.data.batch import Batch
from gemjax.data.jagged import Jagged
from gemjax.layers.axes import ConstantTokens
from gemjax.layers.inputs import (feature_tokens, num_feature_tokens, sequence_tokens,
                                  sparse_token_list)
from gemjax.layers.mlp import MLP
from gemjax.layers.sequence import SequenceEncoder, mean_pool
from gemjax.layers.wukong import Wukong
from gemjax.precision.policy import Policy, apply_policy
from gemjax.sparse import TableSpec

def sequence_id_fields(cfg: Config) -> dict[str, tuple[str, ...]]:
    """{sequence: fields looked up in tables} (empty when sequences are off)."""
    return schema_of(cfg).id_fields if cfg.model.use_sequences else {}


def table_specs(cfg: Config) -> list[TableSpec]:
    """One TableSpec per schema table that a used feature reads, features as
    FeatureSchema.table_features. Width: the table's dim, or model.dim; the LR baseline
    stores S*K weights per id in every table. model.kind "retrieval": the item table also
    serves the feature CANDIDATES (the rows its softmax scores, gemjax.models.retrieval).
    Each spec keeps TableSpec's default optimizer: the run's own is set where every
    optimizer is built (gemjax.train.optim.table_specs)."""
    schema, m = schema_of(cfg), cfg.model
    lr_dim = schema.num_surfaces * schema.num_tasks if m.kind == "lr" else None
    specs = []
    scored = None
    if m.kind == "retrieval":      # the retrieval head scores rows of the item table
        from gemjax.models.retrieval import CANDIDATES, item_table
        scored = item_table(cfg)
    for name, feats in schema.table_features(sequences=m.use_sequences).items():
        if name == scored:
            feats = tuple(feats) + (CANDIDATES,)
        t = schema.table(name)
        dim = lr_dim or t.dim or m.dim
        if lr_dim is None and dim != m.dim:
            raise ValueError(f"table {name!r}: dim {dim}, but model.kind={m.kind!r} makes one "
                             f"model.dim={m.dim} token of every feature; use dim None or {m.dim}")
        specs.append(TableSpec(name, t.vocab, dim, feats, pooling=t.pooling,
                               init_scale=0.0 if m.kind == "lr" else None, bounds=t.bounds))
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
        f, m = schema_of(cfg), cfg.model
        self.cfg = cfg
        dtype = jnp.dtype(m.dtype)
        self.dense_proj = (nnx.Linear(f.num_dense, m.dense_tokens * m.dim, dtype=dtype,
                                      param_dtype=jnp.float32, rngs=rngs) if f.num_dense
                           else ConstantTokens(m.dense_tokens * m.dim, dtype=dtype))
        n_tokens = num_feature_tokens(f, m.dense_tokens)
        self.encoders = nnx.Dict({
            s: SequenceEncoder(m.dim, num_layers=m.seq_layers, num_heads=m.seq_heads,
                               attention=m.attention, block=m.block, dtype=dtype,
                               norm_impl=m.norm_impl, rngs=rngs)
            for s in (f.sequence_names if m.use_sequences else ())})
        n_tokens += 2 * len(self.encoders)
        self.wukong = Wukong(n_tokens, m.dim, num_layers=m.wukong_layers, fmb_tokens=m.fmb_tokens,
                             lcb_tokens=m.lcb_tokens, rank=m.fm_rank, mlp_hidden=m.wukong_mlp,
                             dtype=dtype, rngs=rngs)
        self.head = MLP(self.wukong.out_tokens * m.dim, m.head_mlp, f.num_surfaces * f.num_tasks,
                        dtype=dtype, rngs=rngs)

    def sequence_summary(self, acts: dict[str, jax.Array], batch: Batch) -> list[jax.Array]:
        """Per sequence, its encoded tokens pooled to two [B, D] tokens (whole-history mean,
        mean of the data.recent newest); [] without sequences."""
        f, out = schema_of(self.cfg), []
        names = f.sequence_names if self.cfg.model.use_sequences else ()
        for s, (x, jag) in sequence_tokens(acts, batch.sequences, f, names=names).items():
            x = self.encoders[s](x, jag)
            out += [mean_pool(x, jag), recent_mean_pool(x, jag, self.cfg.data.recent)]
        return out

    def __call__(self, acts: dict[str, jax.Array], batch: Batch) -> jax.Array:
        f, m = schema_of(self.cfg), self.cfg.model
        b = batch.dense.shape[0]
        dtype = jnp.dtype(m.dtype)
        x = feature_tokens(acts, batch.dense, f, self.dense_proj, dense_tokens=m.dense_tokens,
                           width=m.dim, dtype=dtype)
        pooled = self.sequence_summary(acts, batch)
        if pooled:
            x = jnp.concatenate([x] + [p[:, None].astype(dtype) for p in pooled], axis=1)
        y = self.wukong(x)
        logits = self.head(y.reshape(b, -1)).astype(jnp.float32)
        return _pick_surface(logits.reshape(b, f.num_surfaces, f.num_tasks), batch.surface)


class LogisticRegression(nnx.Module):
    """The baseline: acts hold S*K weights per id; logits [B, K]."""

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        f = schema_of(cfg)
        self.cfg = cfg
        k = f.num_surfaces * f.num_tasks
        self.dense = nnx.Linear(f.num_dense, k, rngs=rngs) if f.num_dense else ConstantTokens(k)

    def __call__(self, acts: dict[str, jax.Array], batch: Batch) -> jax.Array:
        f = schema_of(self.cfg)
        b = batch.dense.shape[0]
        z = self.dense(batch.dense) + sum(t[:, i] for t in sparse_token_list(acts, f)
                                          for i in range(t.shape[1]))     # tokens [B, S*K]
        if self.cfg.model.use_sequences:
            for s, fields in f.id_fields.items():
                jag = batch.sequences[s]
                z = z + sum(mean_pool(acts[f"{s}.{n}"], jag) for n in fields)
        return _pick_surface(z.reshape(b, f.num_surfaces, f.num_tasks), batch.surface)


def build_model(cfg: Config, rngs: nnx.Rngs) -> nnx.Module:
    """model.kind: "gem" (v0), "teacher" (gemjax.models.interformer.GEMTeacher), "lr",
    "retrieval" (gemjax.models.retrieval.RetrievalTower: user vectors [T, dim]) or
    "student" (gemjax.models.student.Student)."""
    if cfg.model.kind == "lr":
        model = LogisticRegression(cfg, rngs=rngs)
    elif cfg.model.kind == "retrieval":
        from gemjax.models.retrieval import RetrievalTower
        model = RetrievalTower(cfg, rngs=rngs)
    elif cfg.model.kind == "teacher":
        from gemjax.models.interformer import GEMTeacher   # imports this module's helpers
        model = GEMTeacher(cfg, rngs=rngs)
    elif cfg.model.kind == "student":
        from gemjax.models.student import Student
        model = Student(cfg, rngs=rngs)
    else:
        model = GEMv0(cfg, rngs=rngs)
    # model.precision.format="fp8": the policy's linears get FP8 GEMMs (bf16: untouched)
    return apply_policy(model, Policy.from_model_config(cfg.model))
