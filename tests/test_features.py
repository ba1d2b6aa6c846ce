"""The feature schema (gemjax.features): JSON round trip, compatibility messages, the
synthetic stream's schema against the table layout the models were written for, the
models built from a schema other than the synthetic one, the import graph, and a
resume onto another schema refused by train()."""

import ast
import dataclasses
import json
import os
import pathlib

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

from gemjax.config import (apply_overrides, config_from_dict, get_config, schema_of, synthetic_schema,
                           with_schema)
from gemjax.data.synthetic import SyntheticStream
from gemjax.features import (EventField, FeatureSchema, SequenceFeature, SparseFeature, Table,
                             check_compatible, differences)
from gemjax.models.gem import build_model, sequence_id_fields
from gemjax.train.optim import table_specs

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _custom() -> FeatureSchema:
    """Not the synthetic layout: a pooled bag table, an explicit dim, clamp / hash
    bounds, one sequence with two fields sharing a table with a sparse feature."""
    return FeatureSchema(
        tables=(Table("item", 50, dim=8, bounds="hash"), Table("action", 3),
                Table("city", 20, bounds="clamp"), Table("tags", 30, pooling="mean")),
        sparse=(SparseFeature("city", "city"), SparseFeature("target_item", "item"),
                SparseFeature("tags", "tags")),
        dense=("age", "price", "hour"),
        sequences=(SequenceFeature("history", (EventField("item", "item"),
                                               EventField("action", "action")), max_len=64),),
        surfaces=("feed", "search", "ads"), tasks=("click",),
        surface_column="surface", weight_column="w")


def test_json_round_trip():
    for schema in (_custom(), synthetic_schema(get_config("small").data)):
        d = json.loads(json.dumps(schema.to_dict()))
        back = FeatureSchema.from_dict(d)
        assert back == schema and hash(back) == hash(schema)
        assert isinstance(back.sequences[0].fields, tuple)
    cfg = dataclasses.replace(get_config("tiny"), features=_custom())
    hash(cfg)                                         # a Config carrying a schema stays hashable
    d = _custom().to_dict()
    assert d["tables"][0] == {"name": "item", "vocab": 50, "dim": 8, "pooling": None, "bounds": "hash"}


@pytest.mark.parametrize("edit, match", [
    (lambda d: d["tables"][2].update(vocab="20"), r"features.tables\[2\].vocab: expected an integer"),
    (lambda d: d["sequences"][0]["fields"][1].update(tabel="x"),
     r"features.sequences\[0\].fields\[1\]: unknown keys \['tabel'\]"),
    (lambda d: d["tables"][0].pop("vocab"), r"features.tables\[0\]: missing keys \['vocab'\]"),
    (lambda d: d["sparse"][0].update(table="town"), r"sparse feature 'city' reads table 'town'"),
    (lambda d: d["tables"][1].update(pooling="max"), r"table 'action': pooling must be one of"),
    (lambda d: d.update(dense="age"), r"features.dense: expected a list, got str"),
])
def test_from_dict_names_the_bad_input(edit, match):
    d = _custom().to_dict()
    edit(d)
    with pytest.raises(ValueError, match=match):
        FeatureSchema.from_dict(d)


def test_invalid_schemas_are_refused():
    t, f = (Table("item", 10),), (SparseFeature("item", "item"),)
    with pytest.raises(ValueError, match=r"tables \['extra'\] are read by no feature"):
        FeatureSchema(tables=t + (Table("extra", 5),), sparse=f)
    with pytest.raises(ValueError, match="sequence field h.item reads table 'bag', pooled 'sum'"):
        FeatureSchema(tables=t + (Table("bag", 5, pooling="sum"),), sparse=f,
                      sequences=(SequenceFeature("h", (EventField("item", "bag"),), 8),))
    with pytest.raises(ValueError, match=r"sparse features: duplicate names \['item'\]"):
        FeatureSchema(tables=t, sparse=f + f)
    with pytest.raises(ValueError, match="without '.'"):
        SparseFeature("h.item", "item")
    with pytest.raises(ValueError, match="tables must be a tuple"):
        FeatureSchema(tables=list(t), sparse=f)


def test_pooling_and_bounds_modes_match_the_sparse_specs():
    from gemjax import features
    from gemjax.sparse import specs
    assert features.POOLINGS == specs.POOLINGS and features.BOUNDS == specs.BOUNDS


def test_compatibility_messages():
    old = _custom()
    rep = dataclasses.replace
    assert differences(old, old) == [] and check_compatible(None, old) is None
    # free to change: length caps, bounds modes, surface / weight columns
    free = rep(old, sequences=(rep(old.sequences[0], max_len=8),), weight_column=None,
               tables=(rep(old.tables[0], bounds="strict"),) + old.tables[1:])
    check_compatible(old.to_dict(), free)             # the dict form, as a checkpoint's meta holds
    new = rep(old,
              tables=(rep(old.tables[0], vocab=60, dim=None), old.tables[1],
                      rep(old.tables[2], pooling="sum"), old.tables[3], Table("shop", 7)),
              sparse=(old.sparse[1], old.sparse[0], old.sparse[2], SparseFeature("shop", "shop")),
              dense=old.dense[:2],
              sequences=(rep(old.sequences[0], fields=old.sequences[0].fields[::-1]),),
              tasks=("click", "buy"))
    got = differences(old, new)
    assert got == [
        "table shop: absent in the checkpoint, present now",
        "table item: vocab 50 in the checkpoint, 60 now",
        "table item: dim 8 in the checkpoint, model dim now",
        "table city: pooling None in the checkpoint, sum now",
        "sparse features: (city, target_item, tags) in the checkpoint, (target_item, city, tags, shop) now",
        "dense features: (age, price, hour) in the checkpoint, (age, price) now",
        "sequence history: fields (name:table) (item:item, action:action) in the checkpoint, "
        "(action:action, item:item) now",
        "tasks: (click) in the checkpoint, (click, buy) now"]
    with pytest.raises(ValueError, match="another feature schema: table shop: absent in the checkpoint"):
        check_compatible(old, new)
    gone = rep(old, sparse=old.sparse[:1] + old.sparse[2:], tables=old.tables[2:],
               sequences=(), surfaces=("feed",))
    assert differences(old, gone) == [
        "table item: in the checkpoint, absent now",
        "table action: in the checkpoint, absent now",
        "sparse features: (city, target_item, tags) in the checkpoint, (city, tags) now",
        "sequences: (history) in the checkpoint, () now",
        "surfaces: (feed, search, ads) in the checkpoint, (feed) now"]


# Table layout the GEM models were written for (literal, independent of the schema code):
# table -> (vocab field of DataConfig, plain features, fields of every sequence)
_LAYOUT = [("user", "vocab_user", ("user",), ()), ("segment", "vocab_segment", ("segment",), ()),
           ("context", "vocab_context", ("context",), ()), ("item", "vocab_item", ("item",), ("item",)),
           ("category", "num_categories", ("item_cat",), ("cat",)),
           ("event", "num_event_types", (), ("event",))]


@pytest.mark.parametrize("overrides", ["", "model.kind=lr", "model.use_sequences=false",
                                       "model.kind=lr,model.use_sequences=false,data.num_surfaces=3"])
def test_synthetic_schema_gives_the_models_table_layout(overrides):
    cfg = apply_overrides(get_config("tiny"), overrides)
    d, m = cfg.data.synthetic, cfg.model
    want = []
    for name, vocab, plain, fields in _LAYOUT:
        feats = plain + (tuple(f"{s}.{f}" for s in ("clicks", "views") for f in fields)
                         if m.use_sequences else ())
        if feats:
            dim = d.num_surfaces * d.num_tasks if m.kind == "lr" else m.dim
            want.append((name, getattr(d, vocab), dim, feats, None, "strict",
                         0.0 if m.kind == "lr" else None, cfg.optim.sparse.lr))
    got = [(s.name, s.vocab, s.dim, s.features, s.pooling, s.bounds, s.init_scale, s.optimizer.lr)
           for s in table_specs(cfg)]
    assert got == want
    assert sequence_id_fields(cfg) == ({"clicks": ("item", "cat", "event"), "views": ("item", "cat", "event")}
                                       if m.use_sequences else {})
    # the stream's batches hold exactly the schema's features
    schema = SyntheticStream(cfg.data, 0).schema
    batch, _ = SyntheticStream(cfg.data, 0).shard_batch(0, 0, 8)
    assert tuple(batch.sparse) == schema.sparse_names and batch.dense.shape[1] == schema.num_dense
    assert {s: tuple(j.values) for s, j in batch.sequences.items()} == schema.id_fields
    assert batch.labels.shape[1] == schema.num_tasks and schema == schema_of(cfg)


def test_models_follow_a_custom_schema():
    """A schema that is not the synthetic one shapes every model kind and the table specs."""
    schema = _custom()
    base = apply_overrides(get_config("tiny"), "data.num_surfaces=3,data.num_tasks=1")
    b, t = 4, 16
    rng = np.random.default_rng(0)
    from gemjax.data.batch import Batch
    from gemjax.data.jagged import Jagged, layout_from_lengths
    off, seg, pos = layout_from_lengths(np.array([5, 0, 3, 2]), t)
    jag = Jagged({"item": np.zeros(t, np.int32), "action": np.zeros(t, np.int32)}, off, seg, pos)
    batch = Batch(sparse={}, dense=np.zeros((b, 3), np.float32), sequences={"history": jag},
                  labels=np.zeros((b, 1), np.float32), label_mask=np.ones((b, 1), np.float32),
                  surface=np.array([0, 1, 2, 0], np.int32), weights=np.ones(b, np.float32))
    for kind in ("gem", "teacher", "lr"):
        cfg = dataclasses.replace(apply_overrides(base, f"model.kind={kind}"), features=schema)
        specs = {s.name: s for s in table_specs(cfg)}
        assert {n: s.features for n, s in specs.items()} == {
            "item": ("target_item", "history.item"), "action": ("history.action",), "city": ("city",),
            "tags": ("tags",)}
        assert (specs["item"].bounds, specs["city"].bounds, specs["tags"].pooling) == \
            ("hash", "clamp", "mean")
        model = nnx.eval_shape(lambda: build_model(cfg, nnx.Rngs(0)))
        width = 3 if kind == "lr" else cfg.model.dim
        acts = {f: np.asarray(rng.normal(size=(b, width)), np.float32) for f in schema.sparse_names}
        acts.update({f"history.{f}": np.asarray(rng.normal(size=(t, width)), np.float32)
                     for f in ("item", "action")})
        if kind == "lr":
            assert specs["item"].dim == 3 and model.dense.kernel.shape == (3, 3)
        else:
            assert model.dense_proj.kernel.shape == (3, cfg.model.dense_tokens * cfg.model.dim)
        out = jax.eval_shape(lambda a: build_model(cfg, nnx.Rngs(0))(a, batch), acts)
        assert out.shape == (b, 1)
    # an explicit dim other than model.dim cannot be a GEM token
    with pytest.raises(ValueError, match="table 'item': dim 8, but model.kind='gem'"):
        table_specs(dataclasses.replace(apply_overrides(base, "model.dim=16"), features=schema))


def test_config_carries_the_schema_through_json():
    cfg = dataclasses.replace(apply_overrides(get_config("tiny"), "data.num_surfaces=3,data.num_tasks=1"),
                              features=_custom())
    assert config_from_dict(json.loads(json.dumps(dataclasses.asdict(cfg)))) == cfg
    tiny = get_config("tiny")       # the synthetic schema, as train() records it, reads back implicit
    assert config_from_dict(json.loads(json.dumps(dataclasses.asdict(with_schema(tiny))))) == tiny
    with pytest.raises(ValueError, match="features has 3 surfaces x 1 tasks"):
        config_from_dict({"features": _custom().to_dict()})


def test_make_source_refuses_a_schema_its_stream_does_not_have():
    from gemjax.data.source import make_source
    tiny = get_config("tiny")
    clamped = synthetic_schema(tiny.data)
    clamped = dataclasses.replace(clamped, tables=tuple(dataclasses.replace(t, bounds="clamp")
                                                        for t in clamped.tables))
    src = make_source(dataclasses.replace(tiny, features=clamped), "eval", seed=3)
    assert (src.stream, src.seed) == ("eval", 3)
    wrong = dataclasses.replace(tiny, features=dataclasses.replace(clamped, dense=("a",)))
    with pytest.raises(ValueError, match=r"does not describe the synthetic stream of config.data: "
                                         r"dense features: \(dense0, dense1, dense2, dense3\) in the "
                                         r"stream, \(a\) in config.features"):
        make_source(wrong)


# ---------------------------------------------------------------------------- import graph

# The models read only the schema; the trainer, parallel and serve code get their source
# from gemjax.data.source.make_source, never from a source module itself.
SCHEMA_ONLY = ("gemjax/models", "gemjax/train", "gemjax/parallel", "gemjax/serve")
FORBIDDEN = {"gemjax.data.synthetic": SCHEMA_ONLY, "gemjax.data.parquet": SCHEMA_ONLY,
             "gemjax.data.source": ("gemjax/models",)}


def _imports(source: str) -> list[tuple[int, str]]:
    """(line, module) of every import in `source`, function-level ones included;
    `from pkg import mod` also yields pkg.mod."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.append((node.lineno, node.module))
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


def _violations(files: dict[str, str]) -> list[str]:
    bad = []
    for path, source in files.items():
        for line, mod in _imports(source):
            for forbidden, dirs in FORBIDDEN.items():
                if (mod == forbidden or mod.startswith(forbidden + ".")) and path.startswith(dirs):
                    bad.append(f"{path}:{line} imports {mod}")
    return bad


def test_import_graph_keeps_models_off_the_synthetic_stream():
    files = {str(p.relative_to(ROOT)): p.read_text() for d in SCHEMA_ONLY for p in (ROOT / d).rglob("*.py")}
    assert len(files) > 20
    assert _violations(files) == [], "modules that must read the feature schema import a data source"
    # the check sees through the usual spellings, inside functions too
    planted = {"gemjax/train/x.py": "def f():\n    from gemjax.data import synthetic\n",
               "gemjax/parallel/y.py": "import gemjax.data.synthetic as s\n",
               "gemjax/models/z.py": "from gemjax.data.source import make_source\n",
               "gemjax/data/ok.py": "from gemjax.data.synthetic import SyntheticStream\n"}
    assert _violations(planted) == ["gemjax/train/x.py:2 imports gemjax.data.synthetic",
                                    "gemjax/parallel/y.py:1 imports gemjax.data.synthetic",
                                    "gemjax/models/z.py:1 imports gemjax.data.source",
                                    "gemjax/models/z.py:1 imports gemjax.data.source.make_source"]


# ---------------------------------------------------------------------- train(): config.json, checkpoints

def test_train_records_the_schema_and_refuses_another(tmp_path):
    from gemjax.train.checkpoint import Checkpointer
    from gemjax.train.guards import ResumeMismatch, check_resume, run_fields
    from gemjax.train.loop import train
    # tests/test_train.py's TINY (its compiled programs are cached), stopped after one checkpoint
    cfg = apply_overrides(get_config("tiny"), "train.steps=8,train.log_every=2,train.eval_every=4,"
                                              "train.checkpoint_every=2")
    mesh = Mesh(np.array(jax.devices()[:1]), ("batch",))
    wd = str(tmp_path / "run")
    train(cfg, wd, log=lambda s: None, mesh=mesh, stop_after=2)
    with open(os.path.join(wd, "config.json")) as f:
        saved = json.load(f)
    assert saved["features"] == synthetic_schema(cfg.data).to_dict() and config_from_dict(saved) == cfg
    with Checkpointer(os.path.join(wd, "checkpoints")) as ck:
        assert ck.metadata()[1]["features"] == synthetic_schema(cfg.data).to_dict()
    bigger = apply_overrides(cfg, "data.vocab_item=440")
    with pytest.raises(ResumeMismatch, match="table item: vocab 400 in the checkpoint, 440 now"):
        train(bigger, wd, log=lambda s: None, mesh=mesh)
    # the schema alone (no data field differs): a checkpoint of another schema is refused
    meta = {"run": run_fields(cfg), "features": _custom().to_dict()}
    with pytest.raises(ResumeMismatch, match=r"cannot resume wd at step 2: table action: in the checkpoint, "
                                             r"absent now; .*; table item: vocab 50 in the checkpoint, "
                                             r"400 now; .*; tasks: \(click\) in the checkpoint, "
                                             r"\(task0, task1\) now"):
        check_resume(meta, cfg, 2, "wd")
    check_resume({**meta, "features": synthetic_schema(cfg.data).to_dict()}, cfg, 2, "wd")
