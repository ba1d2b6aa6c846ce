"""gemjax.layers.inputs: features -> tokens, and a new sparse feature kind reaching every model.

The new kind is defined here, in the test: SparseList, L ids per sample (Batch.sparse[name]
[B, L] int32, looked up in an unpooled table to acts [B, L, D]), each id its own token.
It needs a schema class (a SparseFeature subclass) and a TokenRule registered in
gemjax.layers.inputs; no model file knows about it.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gemjax.config import PRESETS
from gemjax.data.batch import Batch, id_features
from gemjax.data.jagged import pack
from gemjax.features import EventField, FeatureSchema, SequenceFeature, SparseFeature, Table
from gemjax.layers import inputs
from gemjax.models.gem import build_model, sequence_id_fields, table_specs
from gemjax.sparse import EmbeddingCollection

B, L = 4, 3


@dataclasses.dataclass(frozen=True)
class SparseList(SparseFeature):
    """`length` ids per sample from `table`, one token each."""

    length: int = L


LIST_RULE = inputs.TokenRule(count=lambda f: f.length, tokens=lambda f, act: act)


@pytest.fixture
def sparse_list_kind(monkeypatch):
    monkeypatch.setitem(inputs.TOKEN_RULES, SparseList, LIST_RULE)


def _schema(with_list: bool = True) -> FeatureSchema:
    sparse = (SparseFeature("user", "user"),)
    if with_list:
        sparse += (SparseList("tags", "tag"),)
    return FeatureSchema(
        tables=(Table("user", 16), Table("item", 12)) + ((Table("tag", 10),) if with_list else ()),
        sparse=sparse, dense=("price", "age"),
        sequences=(SequenceFeature("hist", (EventField("item", "item"),), max_len=8),),
        tasks=("click",))


def _cfg(schema: FeatureSchema, **model):
    base = PRESETS["tiny"]
    return dataclasses.replace(base, features=schema,
                               model=dataclasses.replace(base.model, **model))


def _batch(seed: int = 0, with_list: bool = True) -> Batch:
    rng = np.random.default_rng(seed)
    sparse = {"user": rng.integers(0, 16, B).astype(np.int32)}
    if with_list:
        sparse["tags"] = rng.integers(0, 10, (B, L)).astype(np.int32)
    hist = pack({"item": [rng.integers(0, 12, n).astype(np.int32) for n in (3, 1, 5, 2)]},
                capacity=128)
    return Batch(sparse=sparse, dense=rng.normal(size=(B, 2)).astype(np.float32),
                 sequences={"hist": hist}, labels=np.zeros((B, 1), np.float32),
                 label_mask=np.ones((B, 1), np.float32), surface=np.zeros(B, np.int32),
                 weights=np.ones(B, np.float32))


def _lookup(cfg, batches, seed: int = 1):
    """(collection, state, [acts of each batch]): one jitted lookup."""
    coll = EmbeddingCollection(table_specs(cfg))
    state = coll.init(jax.random.key(seed))
    look = jax.jit(lambda st, feats: coll.lookup(st, feats)[0])
    return coll, state, [look(state, id_features(b, sequence_id_fields(cfg))) for b in batches]


def test_feature_tokens_match_table_rows_and_dense_matmul(sparse_list_kind):
    """Token order: user, tags[0..L-1], dense tokens; each equals an independent numpy
    reference (the table's logical rows, the dense features times the kernel)."""
    schema = _schema()
    cfg = _cfg(schema)
    batch = _batch()
    coll, state, (acts,) = _lookup(cfg, [batch])
    rows = coll.to_logical(state)
    model = build_model(cfg, nnx.Rngs(0))
    dt, d = cfg.model.dense_tokens, cfg.model.dim
    toks = inputs.input_tokens(acts, batch, schema, model.dense_proj, dense_tokens=dt, width=d)
    x = toks.features
    assert list(toks.sequences) == ["hist"] and toks.sequences["hist"].jagged is batch.sequences["hist"]
    assert inputs.num_feature_tokens(schema, dt) == 1 + L + dt
    assert x.shape == (B, 1 + L + dt, d)
    np.testing.assert_allclose(x[:, 0], rows["user"]["weights"][batch.sparse["user"]], rtol=1e-6)
    for j in range(L):
        np.testing.assert_allclose(x[:, 1 + j], rows["tag"]["weights"][batch.sparse["tags"][:, j]],
                                   rtol=1e-6)
    kernel, bias = np.asarray(model.dense_proj.kernel[...]), np.asarray(model.dense_proj.bias[...])
    want = (batch.dense.astype(np.float64) @ kernel + bias).reshape(B, dt, d)
    np.testing.assert_allclose(x[:, 1 + L:], want, rtol=1e-5, atol=1e-6)


def test_sequence_tokens_sum_fields_in_packed_order():
    schema = FeatureSchema(
        tables=(Table("user", 4), Table("item", 12), Table("genre", 5)),
        sparse=(SparseFeature("user", "user"),),
        sequences=(SequenceFeature("hist", (EventField("item", "item"),
                                            EventField("genre", "genre")), max_len=8),))
    jag = pack({"item": [np.array([1, 2]), np.array([3])],
                "genre": [np.array([0, 4]), np.array([2])]}, capacity=8)
    rng = np.random.default_rng(0)
    acts = {"hist.item": rng.normal(size=(8, 4)).astype(np.float32),
            "hist.genre": rng.normal(size=(8, 4)).astype(np.float32)}
    toks = inputs.sequence_tokens(acts, {"hist": jag}, schema, dtype=jnp.bfloat16)
    x, j = toks["hist"]
    assert j is jag and x.dtype == jnp.bfloat16 and x.shape == (8, 4)
    want = (acts["hist.item"].astype(np.float64) + acts["hist.genre"]).astype(np.float32)
    np.testing.assert_allclose(np.asarray(x, np.float32), want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("kind", ["gem", "lr", "teacher", "student"])
def test_sparse_list_flows_through_every_model(sparse_list_kind, kind):
    """A model built on a schema with the new kind: logits [B, 1] that depend on each
    sample's own tag ids (changing sample 0's tags moves only its logit), and the loss
    sends a gradient to the tag rows (what the sparse update applies)."""
    small = (dict(teacher=dataclasses.replace(PRESETS["tiny"].model.teacher, interformer_layers=1,
                                              pyramid_levels=((32, None, 1),)))
             if kind == "teacher" else {})
    cfg = _cfg(_schema(), kind=kind, **small)
    model = build_model(cfg, nnx.Rngs(0))
    graphdef, params = nnx.split(model)

    def total(a, b):
        y = nnx.merge(graphdef, params)(a, b)
        return y.sum(), y

    # one program for both batches: the logits and the loss's gradient wrt the acts
    forward_grad = jax.jit(jax.grad(total, has_aux=True))
    batch = _batch()
    other = dict(batch.sparse, tags=batch.sparse["tags"].copy())
    other["tags"][0] = (other["tags"][0] + 1) % 10
    batch2 = batch.replace(sparse=other)
    _, _, (acts, acts2) = _lookup(cfg, [batch, batch2])
    assert acts["tags"].shape[:2] == (B, L)
    if kind == "lr":           # the LR tables start at zero: give the tag weights a value
        acts = dict(acts, tags=acts["tags"] + jnp.arange(L, dtype=jnp.float32)[None, :, None])
        acts2 = dict(acts2, tags=acts2["tags"] + jnp.arange(L, dtype=jnp.float32)[None, :, None]
                     + (jnp.arange(B) == 0)[:, None, None])
    (g, y1), (_, y2) = forward_grad(acts, batch), forward_grad(acts2, batch2)
    y1, y2 = np.asarray(y1), np.asarray(y2)
    assert y1.shape == (B, 1) and np.isfinite(y1).all()
    assert not np.allclose(y1[0], y2[0])
    np.testing.assert_array_equal(y1[1:], y2[1:])

    assert g["tags"].shape == acts["tags"].shape
    assert np.abs(np.asarray(g["tags"])).sum(axis=-1).min() > 0


def test_unregistered_kind_is_refused_by_name():
    @dataclasses.dataclass(frozen=True)
    class Weighted(SparseFeature):
        pass

    schema = FeatureSchema(tables=(Table("user", 4),), sparse=(Weighted("wuser", "user"),))
    with pytest.raises(ValueError, match="'wuser' is a Weighted, which has no token rule"):
        inputs.num_sparse_tokens(schema)
