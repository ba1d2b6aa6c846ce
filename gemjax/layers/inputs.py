"""Model inputs: where a Batch's features become tokens.

Every model (gemjax.models: GEM v0, the teacher, the students, the retrieval tower, the
logistic-regression baseline) reads its features through this module. The sparse
lookup runs outside the model (gemjax.sparse.EmbeddingCollection, on the flat dict of
gemjax.data.batch.id_features), so the inputs here are that lookup's activations
`acts`, the Batch and the FeatureSchema:

    toks = input_tokens(acts, batch, schema, model.dense_proj, dense_tokens=2, width=D)
    toks.features    [B, n, D]   n = num_feature_tokens(schema, dense_tokens): the sparse
                                 features' tokens (schema order), then `dense_tokens` tokens
                                 projected from the dense features Batch.dense [B, F]
    toks.sequences   {sequence: SequenceTokens(x [T, D], jagged)}: per event sequence its
                     packed jagged tokens (x row t: the sum of event t's field rows; the
                     Jagged gives segment ids, positions, offsets; padding rows past
                     offsets[B] are 0)

The pieces, for models that use them apart:
    sparse_token_list(acts, schema)                  -> [[B, k_f, D] per sparse feature]
    project_dense(proj, dense, num_tokens, width)    -> [B, num_tokens, width]
    feature_tokens(acts, dense, schema, proj, ...)   -> [B, n, D] (the two above, concatenated)
    sequence_tokens(acts, sequences, schema)         -> {sequence: SequenceTokens}

Sparse feature kinds. Each class of sparse feature in FeatureSchema.sparse has a
TokenRule in TOKEN_RULES: how many tokens a feature gives per sample and how its
activation becomes them. gemjax.features.SparseFeature (one id or one pooled bag per
sample: acts[name] [B, D]) gives one token. A new kind (a SparseFeature subclass whose
ids Batch.sparse[name] the lookup turns into acts[name] of another shape, e.g. a list
of L ids [B, L] -> [B, L, D]) registers its rule with `register_token_rule`; the
models, their token counts and the FLOP counts follow from it.

The dense projection is a module of the model that owns it (its parameters keep the
model's path, e.g. `dense_proj/kernel`); this module only calls it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp

from gemjax.data.batch import Batch
from gemjax.data.jagged import Jagged
from gemjax.features import FeatureSchema, SparseFeature

Array = Any


@dataclasses.dataclass(frozen=True)
class TokenRule:
    """How a sparse feature kind becomes tokens.

    count(feature) -> tokens per sample (int, static).
    tokens(feature, act) -> [B, count, D]: `act` is the lookup's activation of the
    feature (acts[feature.name]).
    """

    count: Callable[[Any], int]
    tokens: Callable[[Any, Array], Array]


TOKEN_RULES: dict[type, TokenRule] = {
    SparseFeature: TokenRule(count=lambda f: 1, tokens=lambda f, act: act[:, None, :]),
}


def register_token_rule(kind: type, rule: TokenRule) -> None:
    """Make sparse features of class `kind` (exactly that class) tokens by `rule`."""
    if not isinstance(kind, type):
        raise TypeError(f"register_token_rule: kind must be a class, got {kind!r}")
    TOKEN_RULES[kind] = rule


def token_rule(feature) -> TokenRule:
    """The TokenRule of `feature`'s class; ValueError naming the feature when none is registered."""
    rule = TOKEN_RULES.get(type(feature))
    if rule is None:
        raise ValueError(f"sparse feature {feature.name!r} is a {type(feature).__name__}, which has "
                         f"no token rule; register one with gemjax.layers.inputs.register_token_rule "
                         f"(known kinds: {sorted(k.__name__ for k in TOKEN_RULES)})")
    return rule


def num_sparse_tokens(schema: FeatureSchema) -> int:
    """Tokens per sample of the schema's sparse features (one each for plain SparseFeatures)."""
    return sum(token_rule(f).count(f) for f in schema.sparse)


def num_feature_tokens(schema: FeatureSchema, dense_tokens: int) -> int:
    """n of `input_tokens(...).features`: sparse tokens + dense_tokens."""
    return num_sparse_tokens(schema) + dense_tokens


def sparse_token_list(acts: Mapping[str, Array], schema: FeatureSchema) -> list[Array]:
    """Each sparse feature's tokens [B, k_f, D], schema order (k_f: its rule's count)."""
    out = []
    for f in schema.sparse:
        rule = token_rule(f)
        t = rule.tokens(f, acts[f.name])
        if t.ndim != 3 or t.shape[1] != rule.count(f):
            raise ValueError(f"sparse feature {f.name!r}: its token rule gave shape {t.shape}, "
                             f"expected [B, {rule.count(f)}, D]")
        out.append(t)
    return out


def feature_tokens(acts: Mapping[str, Array], dense: Array, schema: FeatureSchema,
                   dense_proj: Callable[[Array], Array], *, dense_tokens: int, width: int,
                   dtype=jnp.float32) -> Array:
    """The non-sequence tokens [B, n, width], n = num_feature_tokens(schema, dense_tokens):
    the sparse features' tokens (acts {feature: [B, ...]}), then `project_dense` of
    dense [B, F]; every token cast to dtype."""
    parts = sparse_token_list(acts, schema)
    parts.append(project_dense(dense_proj, dense, dense_tokens, width))
    return jnp.concatenate([t.astype(dtype) for t in parts], axis=1)


def project_dense(proj: Callable[[Array], Array], dense: Array, num_tokens: int, width: int) -> Array:
    """Batch.dense [B, F] -> proj -> [B, num_tokens, width] (proj maps F -> num_tokens * width;
    a schema without dense features projects [B, 0] through a learned constant)."""
    return proj(dense).reshape(dense.shape[0], num_tokens, width)


class SequenceTokens(NamedTuple):
    """One event sequence's packed tokens: x [T, D] and its Jagged layout (segment ids,
    positions, offsets)."""

    x: Array
    jagged: Jagged


def sequence_tokens(acts: Mapping[str, Array], sequences: Mapping[str, Jagged],
                    schema: FeatureSchema, dtype=None, names=None) -> dict[str, SequenceTokens]:
    """{sequence: SequenceTokens(x [T, D], jagged)}, x the sum of the sequence's field rows
    acts["<sequence>.<field>"] [T, D] in field order, laid out as sequences[sequence]
    (Batch.sequences). dtype None: summed in the rows' dtype;
    given: summed in float32 and rounded once to dtype. names: the sequences to read
    (default every one of the schema)."""
    fields = schema.id_fields
    out = {}
    for s in (schema.sequence_names if names is None else names):
        rows = [acts[f"{s}.{n}"] for n in fields[s]]
        if dtype is None:
            x = sum(rows)
        else:
            x = sum(r.astype(jnp.float32) for r in rows).astype(dtype)
        out[s] = SequenceTokens(x, sequences[s])
    return out


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class InputTokens:
    """features [B, n, D] (sparse then dense tokens), sequences {name: SequenceTokens}."""

    features: Array
    sequences: dict[str, SequenceTokens]


def input_tokens(acts: Mapping[str, Array], batch: Batch, schema: FeatureSchema,
                 dense_proj: Callable[[Array], Array], *, dense_tokens: int, width: int,
                 dtype=jnp.float32, sequences: bool = True, sequence_dtype=None) -> InputTokens:
    """The model inputs of one batch (module docstring).

    dense_proj: the model's projection [B, F] -> [B, dense_tokens * width]; dtype: the
    features' dtype (every token cast to it); sequences False: no sequence tokens;
    sequence_dtype: `sequence_tokens`' dtype.
    """
    x = feature_tokens(acts, batch.dense, schema, dense_proj, dense_tokens=dense_tokens,
                       width=width, dtype=dtype)
    seqs = (sequence_tokens(acts, batch.sequences, schema, sequence_dtype) if sequences
            else {})
    return InputTokens(x, seqs)
