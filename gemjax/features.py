"""The feature schema: what a data source's batches hold and which tables they read.

    schema = FeatureSchema(
        tables=(Table("user", 1_000_000), Table("item", 50_000), Table("action", 8)),
        sparse=(SparseFeature("user", "user"), SparseFeature("item", "item")),
        dense=("age", "price"),
        sequences=(SequenceFeature("history", (EventField("item", "item"),
                                               EventField("action", "action")), max_len=512),),
        tasks=("click",))

One frozen dataclass tree (hashable, so a Config can carry it as `Config.features`):

  Table           an embedding table: vocab rows, dim (None: model.dim), pooling
                  (None: one row per id; "sum" / "mean": a multi-hot bag pooled to
                  [B, dim]), bounds ("strict" ids outside [0, vocab) are an error,
                  "clamp" clamped, "hash" taken modulo vocab; see gemjax.sparse.TableSpec).
  SparseFeature   one id per sample (or one bag, under a pooled table): Batch.sparse[name] [B].
  dense           dense feature names, in column order: Batch.dense [B, len(dense)].
  SequenceFeature an event sequence Batch.sequences[name] (Jagged): each event's id
                  fields (item, category, action type, bucketed time gap, ...) each read
                  a table; longer histories keep their newest max_len events.
  surfaces, tasks the logits grid: Batch.labels [B, len(tasks)], one label column per
                  task (named by the task); Batch.surface [B] indexes `surfaces`.
  surface_column / weight_column: the columns holding each sample's surface index and
                  weight (None: every sample on surface 0, weight 1).

Several features (and sequence fields) reading one table share its rows: the synthetic
stream's candidate "item" and every sequence's "item" field read table "item".
The sparse lookup sees plain features by name and sequence fields as "<sequence>.<field>"
(gemjax.data.batch.id_features); `table_features` gives each table's features in that
order (plain ones first, then sequence fields, sequences outer).

JSON: `to_dict` / `FeatureSchema.from_dict` round-trip exactly; `check_compatible(saved,
current)` refuses a schema whose trained state would mean something else (tables'
vocab / dim / pooling, features and their tables and order, dense columns, sequences and
their fields, surfaces, tasks) and names every difference. Length caps, bounds modes
and the surface / weight columns may change between runs.

This module imports nothing of gemjax: the config, the data sources, the models and the
cost models all read it. `gemjax.config.schema_of(cfg)` is the schema a config trains on.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Mapping

POOLINGS = (None, "sum", "mean")          # as gemjax.sparse.specs.POOLINGS
BOUNDS = ("strict", "clamp", "hash")      # as gemjax.sparse.specs.BOUNDS


def _check_name(kind: str, name: str) -> None:
    if not isinstance(name, str) or not name or "." in name:
        raise ValueError(f"{kind} name must be a non-empty string without '.', got {name!r}")


@dataclasses.dataclass(frozen=True)
class Table:
    """One embedding table: `vocab` rows of `dim` (None: the model's dim) floats."""

    name: str
    vocab: int
    dim: int | None = None
    pooling: str | None = None
    bounds: str = "strict"

    def __post_init__(self):
        _check_name("table", self.name)
        if self.vocab < 1:
            raise ValueError(f"table {self.name!r}: vocab must be >= 1, got {self.vocab}")
        if self.dim is not None and self.dim < 1:
            raise ValueError(f"table {self.name!r}: dim must be >= 1 or None (model dim), got {self.dim}")
        if self.pooling not in POOLINGS:
            raise ValueError(f"table {self.name!r}: pooling must be one of {POOLINGS}, got {self.pooling!r}")
        if self.bounds not in BOUNDS:
            raise ValueError(f"table {self.name!r}: bounds must be one of {BOUNDS}, got {self.bounds!r}")


@dataclasses.dataclass(frozen=True)
class SparseFeature:
    """A per-sample id (Batch.sparse[name] [B] int32) looked up in `table`."""

    name: str
    table: str

    def __post_init__(self):
        _check_name("sparse feature", self.name)


@dataclasses.dataclass(frozen=True)
class EventField:
    """One id field of every event of a sequence (Jagged values[name] [T] int32), read from `table`."""

    name: str
    table: str

    def __post_init__(self):
        _check_name("event field", self.name)


@dataclasses.dataclass(frozen=True)
class SequenceFeature:
    """An event sequence (Batch.sequences[name], Jagged): its id fields; at most max_len
    events per sample (longer histories keep the newest)."""

    name: str
    fields: tuple[EventField, ...]
    max_len: int

    def __post_init__(self):
        _check_name("sequence", self.name)
        if not self.fields:
            raise ValueError(f"sequence {self.name!r}: needs at least one field")
        _unique(f"sequence {self.name!r} fields", [f.name for f in self.fields])
        if self.max_len < 1:
            raise ValueError(f"sequence {self.name!r}: max_len must be >= 1, got {self.max_len}")


def _unique(what: str, names) -> None:
    seen, dup = set(), []
    for n in names:
        if n in seen:
            dup.append(n)
        seen.add(n)
    if dup:
        raise ValueError(f"{what}: duplicate names {sorted(set(dup))}")


@dataclasses.dataclass(frozen=True)
class FeatureSchema:
    """Every feature of a source's batches and the tables they read (module docstring)."""

    tables: tuple[Table, ...]
    sparse: tuple[SparseFeature, ...]
    dense: tuple[str, ...] = ()
    sequences: tuple[SequenceFeature, ...] = ()
    surfaces: tuple[str, ...] = ("all",)
    tasks: tuple[str, ...] = ("label",)
    surface_column: str | None = None
    weight_column: str | None = None

    def __post_init__(self):
        for name in ("tables", "sparse", "dense", "sequences", "surfaces", "tasks"):
            if not isinstance(getattr(self, name), tuple):      # lists would make it unhashable
                raise ValueError(f"feature schema: {name} must be a tuple, got "
                                 f"{type(getattr(self, name)).__name__}")
        _unique("tables", [t.name for t in self.tables])
        _unique("sparse features", self.sparse_names)
        _unique("sequences", self.sequence_names)
        _unique("dense features", self.dense)
        _unique("surfaces", self.surfaces)
        _unique("tasks", self.tasks)
        if not self.surfaces or not self.tasks:
            raise ValueError("feature schema: needs at least one surface and one task")
        tables = {t.name: t for t in self.tables}
        readers = [(f"sparse feature {f.name!r}", f.table) for f in self.sparse]
        readers += [(f"sequence field {s.name}.{f.name}", f.table) for s in self.sequences for f in s.fields]
        for who, table in readers:
            if table not in tables:
                raise ValueError(f"{who} reads table {table!r}, which is not in the schema's "
                                 f"tables {sorted(tables)}")
        for s in self.sequences:
            for f in s.fields:
                if tables[f.table].pooling is not None:
                    raise ValueError(f"sequence field {s.name}.{f.name} reads table {f.table!r}, "
                                     f"pooled {tables[f.table].pooling!r}: sequence tables look up "
                                     f"one row per event (pooling None)")
        unread = sorted(set(tables) - {t for _, t in readers})
        if unread:
            raise ValueError(f"feature schema: tables {unread} are read by no feature")

    # ---- views the consumers use
    @property
    def sparse_names(self) -> tuple[str, ...]:
        """Plain sparse features, in token order."""
        return tuple(f.name for f in self.sparse)

    @property
    def sequence_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.sequences)

    @property
    def id_fields(self) -> dict[str, tuple[str, ...]]:
        """{sequence: its field names}, the lookup's sequence keys (gemjax.data.batch.id_features)."""
        return {s.name: tuple(f.name for f in s.fields) for s in self.sequences}

    @property
    def num_dense(self) -> int:
        return len(self.dense)

    @property
    def num_surfaces(self) -> int:
        return len(self.surfaces)

    @property
    def num_tasks(self) -> int:
        return len(self.tasks)

    def table(self, name: str) -> Table:
        for t in self.tables:
            if t.name == name:
                return t
        raise KeyError(f"feature schema has no table {name!r}; tables: {[t.name for t in self.tables]}")

    def table_features(self, sequences: bool = True) -> dict[str, tuple[str, ...]]:
        """{table: lookup keys reading it}, tables in schema order: its plain sparse features,
        then (sequences=True) "<sequence>.<field>" for every sequence field reading it.
        Tables left without a feature (only sequences read them, sequences=False) are omitted."""
        out = {}
        for t in self.tables:
            feats = [f.name for f in self.sparse if f.table == t.name]
            if sequences:
                feats += [f"{s.name}.{f.name}" for s in self.sequences for f in s.fields
                          if f.table == t.name]
            if feats:
                out[t.name] = tuple(feats)
        return out

    # ---- JSON
    def to_dict(self) -> dict:
        """Plain JSON-able dict (lists for tuples); FeatureSchema.from_dict inverts it."""
        return _plain(dataclasses.asdict(self))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "FeatureSchema":
        """The schema of `to_dict`'s (or JSON's) form; ValueError naming the bad key path."""
        return _build(cls, d, "features")


def _plain(x):
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def _convert(value, typ, path: str):
    """`value` (parsed JSON) as the field type `typ`: str, int, X | None, tuple[X, ...], a dataclass."""
    origin = typing.get_origin(typ)
    args = typing.get_args(typ)
    if type(None) in args:                                # X | None
        if value is None:
            return None
        (typ,) = [a for a in args if a is not type(None)]
        return _convert(value, typ, path)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{path}: expected a list, got {type(value).__name__} {value!r}")
        return tuple(_convert(v, args[0], f"{path}[{i}]") for i, v in enumerate(value))
    if dataclasses.is_dataclass(typ):
        return _build(typ, value, path)
    if typ is int and (not isinstance(value, int) or isinstance(value, bool)):
        raise ValueError(f"{path}: expected an integer, got {type(value).__name__} {value!r}")
    if typ is str and not isinstance(value, str):
        raise ValueError(f"{path}: expected a string, got {type(value).__name__} {value!r}")
    return value


def _build(cls, d, path: str):
    if not isinstance(d, Mapping):
        raise ValueError(f"{path}: expected an object, got {type(d).__name__} {d!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - set(fields))
    if unknown:
        raise ValueError(f"{path}: unknown keys {unknown}; known: {sorted(fields)}")
    missing = [n for n, f in fields.items() if n not in d
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ValueError(f"{path}: missing keys {missing}")
    hints = typing.get_type_hints(cls)
    kw = {k: _convert(v, hints[k], f"{path}.{k}") for k, v in d.items()}
    try:
        return cls(**kw)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


# ---------------------------------------------------------------------------- compatibility

def _dim(d: int | None) -> str:
    return "model dim" if d is None else str(d)


def _names(xs) -> str:
    return "(" + ", ".join(xs) + ")"


def differences(saved: FeatureSchema, current: FeatureSchema, *, old: str = "in the checkpoint",
                new: str = "now") -> list[str]:
    """What differs between two schemas in ways that change what a trained state means,
    one line each: "table item: vocab 4000 in the checkpoint, 5000 now" (old / new: the
    words naming the two sides). Empty: compatible."""
    out = []
    st, ct = {t.name: t for t in saved.tables}, {t.name: t for t in current.tables}
    out += [f"table {n}: {old}, absent {new}" for n in st if n not in ct]
    out += [f"table {n}: absent {old}, present {new}" for n in ct if n not in st]
    for n in (n for n in ct if n in st):
        a, b = st[n], ct[n]
        if a.vocab != b.vocab:
            out.append(f"table {n}: vocab {a.vocab} {old}, {b.vocab} {new}")
        if a.dim != b.dim:
            out.append(f"table {n}: dim {_dim(a.dim)} {old}, {_dim(b.dim)} {new}")
        if a.pooling != b.pooling:
            out.append(f"table {n}: pooling {a.pooling} {old}, {b.pooling} {new}")
    if saved.sparse_names != current.sparse_names:
        out.append(f"sparse features: {_names(saved.sparse_names)} {old}, "
                   f"{_names(current.sparse_names)} {new}")
    sf = {f.name: f.table for f in saved.sparse}
    for f in current.sparse:
        if f.name in sf and sf[f.name] != f.table:
            out.append(f"sparse feature {f.name}: table {sf[f.name]} {old}, {f.table} {new}")
    if saved.dense != current.dense:
        out.append(f"dense features: {_names(saved.dense)} {old}, {_names(current.dense)} {new}")
    if saved.sequence_names != current.sequence_names:
        out.append(f"sequences: {_names(saved.sequence_names)} {old}, "
                   f"{_names(current.sequence_names)} {new}")
    ss = {s.name: s for s in saved.sequences}
    for s in current.sequences:
        if s.name in ss and ss[s.name].fields != s.fields:
            fmt = lambda q: _names(f"{f.name}:{f.table}" for f in q.fields)  # noqa: E731
            out.append(f"sequence {s.name}: fields (name:table) {fmt(ss[s.name])} {old}, "
                       f"{fmt(s)} {new}")
    for what in ("surfaces", "tasks"):
        a, b = getattr(saved, what), getattr(current, what)
        if a != b:
            out.append(f"{what}: {_names(a)} {old}, {_names(b)} {new}")
    return out


def check_compatible(saved: FeatureSchema | Mapping | None, current: FeatureSchema) -> None:
    """Raise ValueError listing every `differences` line unless `current` can restore a
    state trained on `saved`. saved: a schema or its to_dict form (a checkpoint's meta);
    None (a checkpoint that stored no schema) is accepted."""
    if saved is None:
        return
    if not isinstance(saved, FeatureSchema):
        saved = FeatureSchema.from_dict(saved)
    diffs = differences(saved, current)
    if diffs:
        raise ValueError("the checkpoint was trained on another feature schema: " + "; ".join(diffs)
                         + " (restore with the checkpoint's schema, or start a fresh workdir)")

