"""Next-item retrieval user tower: jagged history tokens -> one user vector per token.

The event sequence of the schema (its first sequence, e.g. MovieLens "history" with the
fields item and genre) is read as jagged tokens, the sum of its fields' embeddings
(looked up outside the model by the EmbeddingCollection, as for GEM v0); input dropout;
a causal encoder; optionally l2-normalised. model.retrieval.encoder picks the encoder:
"softmax" a SequenceEncoder (model.attention, RoPE, QK-norm, final LayerNorm), "hstu"
HSTU blocks (gemjax.layers.hstu: SiLU pointwise attention through kernels.gdpa, gated
by U, RoPE (model.rope) and / or a learned relative attention bias per distance
(model.retrieval.hstu_rel_bias=position), attention scale 1 / the sequence's max_len) after a
learned recency embedding is added to each token (row min(n - 1 - i, max_len - 1) for
token i of n).
Token t's vector scores the item that follows it: items are the rows of the same
"item" table the history reads (tied input / output embeddings; the loss and the
ranking are in gemjax.train.retrieval_loss). Nothing is padded per sample.

    model = RetrievalTower(cfg, rngs=nnx.Rngs(0))
    h = model(acts, batch, dropout_key)       # [T, dim] float32, T = the jagged capacity
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from gemjax.config import Config, schema_of
from gemjax.data.batch import Batch
from gemjax.layers.axes import param
from gemjax.layers.hstu import HSTUEncoder
from gemjax.layers.inputs import sequence_tokens
from gemjax.layers.sequence import SequenceEncoder

ITEM_FIELD = "item"                   # the sequence field whose table the head scores
CANDIDATES = "retrieval.candidates"   # the id feature of the scored rows of that table


def retrieval_sequence(cfg: Config) -> str:
    """The sequence a retrieval model reads: the schema's first; ValueError if the schema
    has none or its sequence has no "item" field."""
    f = schema_of(cfg)
    if not f.sequences:
        raise ValueError("model.kind=retrieval needs an event sequence in the feature schema")
    s = f.sequences[0]
    if ITEM_FIELD not in f.id_fields.get(s.name, ()):
        raise ValueError(f"model.kind=retrieval: sequence {s.name!r} needs a field "
                         f"{ITEM_FIELD!r} read from a table (its fields: "
                         f"{f.id_fields.get(s.name, ())})")
    return s.name


def item_table(cfg: Config) -> str:
    """The table of the retrieval sequence's item field (the table the head scores)."""
    s = retrieval_sequence(cfg)
    seq = next(q for q in schema_of(cfg).sequences if q.name == s)
    return next(f.table for f in seq.fields if f.name == ITEM_FIELD)


def target_feature(cfg: Config) -> str:
    """The sparse feature holding each row's next item: the one sparse feature reading
    the item table (ValueError if none or several)."""
    table = item_table(cfg)
    names = [f.name for f in schema_of(cfg).sparse if f.table == table]
    if len(names) != 1:
        raise ValueError(f"model.kind=retrieval needs exactly one sparse feature reading table "
                         f"{table!r} (the row's next item), got {names}")
    return names[0]


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x [..., d] / max(||x||, eps) along the last axis (float32)."""
    x = x.astype(jnp.float32)
    return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), eps)


class RetrievalTower(nnx.Module):
    """acts {"<seq>.<field>": [T, dim]}, Batch, dropout key or None -> user vectors [T, dim].

    model.dim, seq_layers, seq_heads, rope and dtype shape the encoder (module
    docstring; "softmax" also attention (softmax or gdpa; causal) and qk_norm, "hstu"
    hstu_dropout and hstu_rel_bias); model.retrieval.dropout is the rate of the dropout
    on the input tokens. Dropout runs only when a key is given (training).
    """

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        m = cfg.model
        self.cfg = cfg
        self.sequence = retrieval_sequence(cfg)
        if m.retrieval.encoder == "hstu":
            max_len = next(q.max_len for q in schema_of(cfg).sequences if q.name == self.sequence)
            self.max_len = max(int(max_len or 1), 1)
            if m.retrieval.hstu_rel_bias == "position+time":
                raise ValueError(f"model.retrieval.hstu_rel_bias=position+time needs per-event timestamps "
                                 f"in sequence {self.sequence!r}; the feature schema's sequences "
                                 f"hold id fields only: use model.retrieval.hstu_rel_bias=position")
            self.recency = param(jax.random.uniform(rngs.params(), (self.max_len, m.dim),
                                                    minval=-1.0, maxval=1.0) * m.dim ** -0.5,
                                 None, "embed")
            self.encoder = HSTUEncoder(m.dim, num_layers=m.seq_layers, num_heads=m.seq_heads,
                                       scale=1.0 / self.max_len, dropout=m.retrieval.hstu_dropout,
                                       rope=m.rope, rel_bias=m.retrieval.hstu_rel_bias,
                                       max_len=self.max_len, dtype=jnp.dtype(m.dtype), rngs=rngs)
            return
        if m.attention == "block":
            raise ValueError("model.kind=retrieval needs causal attention: model.attention "
                             "softmax or gdpa, not block")
        self.encoder = SequenceEncoder(m.dim, num_layers=m.seq_layers, num_heads=m.seq_heads,
                                       attention=m.attention, causal=True, rope=m.rope,
                                       qk_norm=m.qk_norm, final_norm=True,
                                       dtype=jnp.dtype(m.dtype), norm_impl=m.norm_impl, rngs=rngs)

    def __call__(self, acts: dict[str, jax.Array], batch: Batch,
                 dropout_key: jax.Array | None = None) -> jax.Array:
        m = self.cfg.model
        x, jag = sequence_tokens(acts, batch.sequences, schema_of(self.cfg),
                                 names=(self.sequence,))[self.sequence]
        hstu = m.retrieval.encoder == "hstu"
        if hstu:
            lengths = jnp.concatenate([jag.lengths, jnp.zeros((1,), jag.lengths.dtype)])
            back = jnp.take(lengths, jag.segment_ids) - 1 - jag.positions     # 0: the newest
            x = x + jnp.take(self.recency[...], jnp.clip(back, 0, self.max_len - 1), axis=0)
        rate = m.retrieval.dropout
        if dropout_key is not None and rate > 0:
            keep = jax.random.bernoulli(dropout_key, 1.0 - rate, x.shape)
            x = jnp.where(keep, x / (1.0 - rate), 0.0)
        if hstu:
            block_key = None if dropout_key is None else jax.random.fold_in(dropout_key, 1)
            h = self.encoder(x, jag, block_key).astype(jnp.float32)
        else:
            h = self.encoder(x, jag).astype(jnp.float32)
        return l2_normalize(h) if m.retrieval.l2norm else h
