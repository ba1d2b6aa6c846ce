"""Columnar Parquet source: many files -> sharded, seeded, resumable `Batch`es.

    cols = ParquetColumns(
        sparse=("user", "item"), dense=("age",), labels=("click",),
        sequences=(SequenceColumns("clicks", (("item", "click_items"),), cap=256),),
        vocab=(("user", 10**6), ("item", 10**5), ("click_items", 10**5)), bounds=(("user", "hash"),))
    src = ParquetSource("logs/*.parquet", cols, batch_size=4096, seed=0)
    batch, info = src.shard_batch(step, shard, num_shards)      # gemjax.data.source protocol

`columns_from_schema(features)` gives the columns of a FeatureSchema (each column
named after its feature; sequence fields "<sequence>_<field>"), which is how
`gemjax.data.source.make_source` reads a config's Parquet data.

One row of the files is one sample: a scalar integer column per sparse feature,
a scalar numeric column per dense feature, label (and optional weight and
surface) columns, and, per event sequence, one list column per field (events in
time order, oldest first; every field of a row has the same length).

Index. At construction the reader lists the files (a directory: its *.parquet
files, recursively; a glob; or a list, in the order given), sorted by path, and
reads only their footers: the global index is (file, row group, rows) per row
group, the global file order numbers every row, and the column types are checked
against the configuration (a missing or mistyped column fails here, naming the
file and the column).

Order. `order="shuffle"` (training): shard `shard` of `num_shards` is a lane of
its own. Epoch e permutes the row groups (seeded by (seed, e)); the permuted
rows are cut into num_shards equal contiguous slices of M = N // num_shards rows
(the N mod num_shards rows left at the end of each epoch's permutation are
skipped in that epoch), and lane `shard` reads only its slice: its own row groups
(a row group on a slice boundary is shared by two lanes). Within a lane, windows
of `window` consecutive rows are permuted in memory (seeded by (seed, e,
num_shards, shard, window)), and step s takes lane rows [s b, (s + 1) b) of that
endless stream (b = batch_size / num_shards). A shard's batch is thus a pure
function of (seed, step, shard, num_shards): resume is exact, and another shard
count reads another, defined, stream; `feeding.regroup(src.shard_batch, K)`
makes every mesh of n | K devices see the same samples. `order="time"`
(streaming): no shuffle; global step s is rows [s B, (s + 1) B) of the file order
(wrapping at the end), shard i takes its contiguous b rows of those, so any shard
count partitions the same global batch.

Decoding. A shard reads whole row groups (only the configured columns) and
keeps them decoded in an LRU cache shared by the threads calling shard_batch
(`cache_bytes`; a row group is decoded once even when several threads ask for it
at once). List columns become offsets [rows + 1] and flat value arrays from
Arrow's own buffers (`ListArray.flatten`, zero-copy to numpy where the layout
allows); a batch gathers its rows with vectorised index arithmetic (np.repeat of
starts + arange), no per-row Python loop, into `Jagged`s of static capacity

    T = sequence_capacity(num_shards)[name] = multiple of 128 >= capacity_slack * b * t

where t is the mean tokens per sample (the footers' leaf value counts per row,
at most the cap; or `capacity_tokens` given as global tokens per step, divided
as SyntheticStream divides data.sequence_capacity), never above b * cap.

Bad data, each with a clear error naming the file, row group, column and row,
or a documented fallback counted in the shard's `SourceInfo.counters`:
  unreadable / truncated file       error at construction (footer) or read (pages)
  missing / mistyped column         error at construction
  id outside [0, vocab)             per column `bounds`: "strict" error, "clamp"
                                    (clipped, counted ids_clamped), "hash" (out-of-range
                                    ids only: splitmix64(id) mod vocab, counted ids_hashed);
                                    columns without a vocab must fit int32
  null sparse id / null list value  error
  null list (a whole sequence)      an empty sequence (empty sequences are fine)
  sequence longer than its cap      newest `cap` events kept, counted seq_truncated_to_cap
  batch over its packed capacity    longest sequences cut further (newest kept),
                                    counted seq_truncated_to_capacity
  NaN / Inf / null dense value      nan="error": error; nan="zero": 0, counted nan_filled
  finite value beyond dense_max_abs nan="error": error; nan="zero": clamped to the bound,
  (when > 0; dense and float        counted dense_clamped
  sequence fields)
  (also float sequence fields)
  label null or NaN                 unobserved: label_mask 0 (label 0)
  label other than 0/1              error
  weight null / NaN / negative      error
Counters count what a batch serves (a repaired id counts each time its row is
served), so they are a pure function of the step as well.

grain (0.2.18) was measured as the index / shuffle / worker layer and is not
used. Its Parquet dataset yields one Python dict per row (a list column becomes
one numpy array per row), so packing a batch is a per-row Python loop; its window
shuffle works per record; its resume state is an iterator position, not a
function of the step; and its worker processes would each decode the row groups
of the steps they build and copy every batch through shared memory. On a
1M-row file (one list<int32> column, mean length 100, row groups of 16,384 rows,
batches of 4,096; benchmarks/bench_parquet.py, one epoch, cold cache, a shared
2-core CPU host):
  this reader, shuffle (window 65,536) / time order        ~270k rows/s (25M tokens/s)
  grain ParquetIterDataset + WindowShuffle + packing        ~68k rows/s
  grain MapDataset over steps -> shard_batch, mp_prefetch   ~130k (1 worker), ~85k (2)
Parallelism comes from the Feeder's threads instead (pyarrow decoding and the
numpy gathers release the GIL), sharing one cache of decoded row groups.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import os
import threading
from concurrent.futures import Future
from typing import Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from gemjax.data.batch import Batch
from gemjax.data.files import file_changes, file_facts, list_files  # noqa: F401 (re-exported)
from gemjax.data.jagged import Jagged, fit_to_capacity, layout_from_lengths
from gemjax.data.source import Counters, SourceInfo

BOUNDS_MODES = ("strict", "clamp", "hash")
NAN_MODES = ("error", "zero")
ORDERS = ("shuffle", "time")
COUNTERS = ("seq_truncated_to_cap", "seq_truncated_to_capacity", "ids_clamped", "ids_hashed",
            "nan_filled", "dense_clamped")
_INT32_LIMIT = 2 ** 31


@dataclasses.dataclass(frozen=True)
class SequenceColumns:
    """One event sequence: (field, list column) pairs and its length cap.

    The fields become Jagged.values[field]; integer fields are ids (int32),
    floating ones float32. Rows longer than `cap` keep their newest `cap` events.
    """

    name: str
    fields: tuple[tuple[str, str], ...]
    cap: int

    def __post_init__(self):
        if not self.fields:
            raise ValueError(f"sequence {self.name!r}: no fields")
        if self.cap < 1:
            raise ValueError(f"sequence {self.name!r}: cap must be >= 1, got {self.cap}")


@dataclasses.dataclass(frozen=True)
class ParquetColumns:
    """Which columns of the files make a `Batch` (column names are the features' names).

    sparse    scalar integer columns -> Batch.sparse[column] [B] int32
    dense     scalar numeric columns -> Batch.dense [B, len(dense)] float32, in this order
    sequences event sequences (list columns) -> Batch.sequences[name]
    labels    one numeric 0/1 column per task -> labels / label_mask [B, K]
    weight    optional numeric column -> weights [B] (default 1)
    surface   optional integer column -> surface [B] (default 0)
    vocab     (id column, table rows): ids must lie in [0, rows)
    bounds    (id column, "strict" | "clamp" | "hash"); default "strict"
    """

    sparse: tuple[str, ...] = ()
    dense: tuple[str, ...] = ()
    sequences: tuple[SequenceColumns, ...] = ()
    labels: tuple[str, ...] = ()
    weight: str | None = None
    surface: str | None = None
    vocab: tuple[tuple[str, int], ...] = ()
    bounds: tuple[tuple[str, str], ...] = ()

    def __post_init__(self):
        if not self.labels:
            raise ValueError("ParquetColumns: at least one label column is needed")
        seq_cols = [c for s in self.sequences for _, c in s.fields]
        names = (list(self.sparse) + list(self.dense) + seq_cols + list(self.labels)
                 + [c for c in (self.weight, self.surface) if c])
        dup = sorted({c for c in names if names.count(c) > 1})
        if dup:
            raise ValueError(f"ParquetColumns: columns used twice: {dup}")
        seq_names = [s.name for s in self.sequences]
        if len(set(seq_names)) != len(seq_names):
            raise ValueError(f"ParquetColumns: sequence names repeat: {seq_names}")
        ids = set(self.sparse) | set(seq_cols) | ({self.surface} if self.surface else set())
        for col, rows in self.vocab:
            if col not in ids:
                raise ValueError(f"ParquetColumns.vocab: {col!r} is not an id column ({sorted(ids)})")
            if not 1 <= rows <= _INT32_LIMIT:
                raise ValueError(f"ParquetColumns.vocab: {col!r} has {rows} rows (ids are int32)")
        for col, mode in self.bounds:
            if col not in ids:
                raise ValueError(f"ParquetColumns.bounds: {col!r} is not an id column ({sorted(ids)})")
            if mode not in BOUNDS_MODES:
                raise ValueError(f"ParquetColumns.bounds: {col!r} mode {mode!r} is not one of "
                                 f"{BOUNDS_MODES}")

    @property
    def columns(self) -> tuple[str, ...]:
        """Every column the reader reads, in a fixed order."""
        seq_cols = tuple(c for s in self.sequences for _, c in s.fields)
        return (self.sparse + self.dense + seq_cols + self.labels
                + tuple(c for c in (self.weight, self.surface) if c))

    def expected_kinds(self) -> dict[str, str]:
        """{column: "int" | "number" | "list"} for the schema check."""
        kinds = {c: "int" for c in self.sparse}
        kinds.update({c: "number" for c in self.dense + self.labels})
        kinds.update({c: "list" for s in self.sequences for _, c in s.fields})
        if self.weight:
            kinds[self.weight] = "number"
        if self.surface:
            kinds[self.surface] = "int"
        return kinds


def sequence_column(sequence: str, field: str) -> str:
    """The list column holding field `field` of sequence `sequence`: "<sequence>_<field>"."""
    return f"{sequence}_{field}"


def columns_from_schema(schema) -> ParquetColumns:
    """The columns a `gemjax.features.FeatureSchema` reads, named after its features:

      sparse feature f            integer column f, ids in [0, its table's vocab)
      dense feature d             numeric column d
      sequence s, field f         list column "<s>_<f>" (sequence_column), capped at s.max_len
      task t                      0/1 label column t (null / NaN: unobserved)
      surface_column / weight_column   as named (surface ids in [0, len(surfaces)))

    Every id column takes its table's vocab and bounds mode. ValueError for what the
    files cannot hold: a pooled table (a bag of ids per sample)."""
    tables = {t.name: t for t in schema.tables}
    pooled = sorted({f.table for f in schema.sparse if tables[f.table].pooling is not None})
    if pooled:
        raise ValueError(f"parquet: tables {pooled} are pooled (a bag of ids per sample); the "
                         f"Parquet source reads one id per sparse feature: set their pooling to "
                         f"null, or use a sequence")
    id_tables = [(f.name, f.table) for f in schema.sparse]
    seqs = []
    for s in schema.sequences:
        fields = tuple((f.name, sequence_column(s.name, f.name)) for f in s.fields)
        seqs.append(SequenceColumns(s.name, fields, cap=s.max_len))
        id_tables += [(sequence_column(s.name, f.name), f.table) for f in s.fields]
    vocab = [(c, tables[t].vocab) for c, t in id_tables]
    if schema.surface_column:
        vocab.append((schema.surface_column, schema.num_surfaces))
    return ParquetColumns(
        sparse=schema.sparse_names, dense=schema.dense, sequences=tuple(seqs), labels=schema.tasks,
        weight=schema.weight_column, surface=schema.surface_column, vocab=tuple(vocab),
        bounds=tuple((c, tables[t].bounds) for c, t in id_tables))


def _kind_ok(typ: pa.DataType, kind: str) -> bool:
    if kind == "int":
        return pa.types.is_integer(typ)
    if kind == "number":
        return pa.types.is_integer(typ) or pa.types.is_floating(typ) or pa.types.is_boolean(typ)
    if pa.types.is_list(typ) or pa.types.is_large_list(typ):
        v = typ.value_type
        return pa.types.is_integer(v) or pa.types.is_floating(v)
    return False


_KIND_TEXT = {"int": "an integer column", "number": "a numeric column",
              "list": "a list of integers or floats"}


@dataclasses.dataclass(frozen=True)
class RowGroupIndex:
    """Every non-empty row group of the files, in global file order.

    files [F] paths; file, group [G] int; rows [G] int64; start [G + 1] int64
    (first global row of each row group; start[-1] = N). tokens: {column: leaf
    values in the footers} of the list columns.
    """

    files: tuple[str, ...]
    file: np.ndarray
    group: np.ndarray
    rows: np.ndarray
    start: np.ndarray
    file_start: np.ndarray       # [G] global row of the first row of the row group's file
    tokens: dict

    @property
    def num_rows(self) -> int:
        return int(self.start[-1])


def build_index(files: Sequence[str], columns: ParquetColumns) -> tuple[RowGroupIndex, list]:
    """(RowGroupIndex, [FileMetaData per file]) from the footers alone; checks the schemas."""
    kinds = columns.expected_kinds()
    lists = [c for c, k in kinds.items() if k == "list"]
    fid, grp, rows, fstart, metas = [], [], [], [], []
    tokens = dict.fromkeys(lists, 0)
    list_types: dict[str, tuple[str, pa.DataType]] = {}
    total = 0
    for i, path in enumerate(files):
        try:
            pf = pq.ParquetFile(path)
        except Exception as e:  # noqa: BLE001 - pyarrow raises several types for damaged files
            raise ValueError(f"parquet: {path}: cannot read the Parquet footer ({type(e).__name__}: "
                             f"{e}); the file is truncated or not Parquet") from e
        try:
            schema, md = pf.schema_arrow, pf.metadata
        finally:
            pf.close()
        for col, kind in kinds.items():
            idx = schema.get_field_index(col)
            if idx < 0:
                raise ValueError(f"parquet: {path}: column {col!r} is missing (the file has "
                                 f"{schema.names})")
            if not _kind_ok(schema.field(idx).type, kind):
                raise ValueError(f"parquet: {path}: column {col!r} has type {schema.field(idx).type}, "
                                 f"expected {_KIND_TEXT[kind]}")
            if kind == "list":                 # ids in one file, floats in another: refused
                vt = schema.field(idx).type.value_type
                first_path, first_t = list_types.setdefault(col, (path, vt))
                if pa.types.is_integer(vt) != pa.types.is_integer(first_t):
                    raise ValueError(f"parquet: {path}: column {col!r} holds {vt} values, "
                                     f"{first_path} holds {first_t}")
        metas.append(md)
        first = total
        for g in range(md.num_row_groups):
            rg = md.row_group(g)
            n = rg.num_rows
            for j in range(rg.num_columns):
                top = rg.column(j).path_in_schema.split(".")[0]
                if top in tokens:
                    tokens[top] += rg.column(j).num_values
            if n == 0:
                continue
            fid.append(i)
            grp.append(g)
            rows.append(n)
            fstart.append(first)
            total += n
    if total == 0:
        raise ValueError(f"parquet: the {len(files)} files hold no rows")
    rows_a = np.asarray(rows, np.int64)
    start = np.zeros(len(rows) + 1, np.int64)
    np.cumsum(rows_a, out=start[1:])
    return RowGroupIndex(tuple(files), np.asarray(fid), np.asarray(grp), rows_a, start,
                         np.asarray(fstart, np.int64), tokens), metas


def _mix64(v: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser of int64 values (as uint64), elementwise."""
    z = v.astype(np.int64).view(np.uint64)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@dataclasses.dataclass
class _Chunk:
    """One decoded row group (R rows).

    scalars   {column: [R] array} ids int32, numbers float32 (labels NaN where unobserved)
    dense     [R, F] float32
    offsets   {sequence: [R + 1] int64}; values {sequence: {field: [n_tokens] array}}
    row_counts {counter: [R] int64} repairs per row (scalar columns)
    token_counts {sequence: {counter: [n_tokens + 1] int64}} cumulative repairs per token
    """

    scalars: dict
    dense: np.ndarray
    offsets: dict
    values: dict
    row_counts: dict
    token_counts: dict

    @property
    def nbytes(self) -> int:
        arrays = (list(self.scalars.values()) + [self.dense] + list(self.offsets.values())
                  + [a for v in self.values.values() for a in v.values()]
                  + list(self.row_counts.values())
                  + [a for v in self.token_counts.values() for a in v.values()])
        return int(sum(a.nbytes for a in arrays))


class ParquetSource:
    """Batches from Parquet files; implements `gemjax.data.source.Source`.

    paths: a directory, a glob, a file or a list of them. batch_size: global
    samples per step. order: "shuffle" or "time" (module docstring). window:
    rows of the in-memory shuffle window. nan: "error" or "zero". capacity_slack /
    capacity_tokens ({sequence: global tokens per step}): the packed capacity.
    cache_bytes: decoded row groups kept per process. dense_max_abs: bound on the
    magnitude of finite dense (and float sequence) values, 0 for none; beyond it a
    value is an error or clamped, as `nan` says.
    """

    counter_names = COUNTERS     # the fallback counters of every shard's SourceInfo

    def __init__(self, paths, columns: ParquetColumns, batch_size: int, seed: int = 0, *,
                 order: str = "shuffle", window: int = 65_536, nan: str = "error",
                 capacity_slack: float = 1.3, capacity_tokens: Mapping[str, int] | None = None,
                 cache_bytes: int = 1 << 30, dense_max_abs: float = 0.0):
        if order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
        if nan not in NAN_MODES:
            raise ValueError(f"nan must be one of {NAN_MODES}, got {nan!r}")
        if batch_size < 1 or window < 1:
            raise ValueError(f"batch_size and window must be >= 1, got {batch_size}, {window}")
        unknown = set(capacity_tokens or {}) - {s.name for s in columns.sequences}
        if unknown:
            raise ValueError(f"capacity_tokens names unknown sequences {sorted(unknown)}")
        self.columns, self.batch_size, self.seed = columns, batch_size, seed
        self.order, self.window, self.nan = order, window, nan
        if not dense_max_abs >= 0:
            raise ValueError(f"dense_max_abs must be >= 0 (0: no bound), got {dense_max_abs}")
        self.dense_max_abs = float(dense_max_abs)
        self.capacity_slack, self.capacity_tokens = capacity_slack, dict(capacity_tokens or {})
        self.index, self._metas = build_index(list_files(paths), columns)
        self._vocab = dict(columns.vocab)
        self._bounds = dict(columns.bounds)
        self._cache: collections.OrderedDict[int, Future] = collections.OrderedDict()
        self._sizes: dict[int, int] = {}
        self._lock = threading.Lock()
        self.cache_bytes = cache_bytes
        self._epoch_order = functools.lru_cache(maxsize=8)(self._compute_epoch_order)
        self._window_order = functools.lru_cache(maxsize=64)(self._compute_window_order)

    # ---- sizes ----------------------------------------------------------------------------

    @property
    def num_rows(self) -> int:
        return self.index.num_rows

    def local_batch_size(self, num_shards: int) -> int:
        if num_shards < 1 or self.batch_size % num_shards:
            raise ValueError(f"batch_size={self.batch_size} is not divisible by the {num_shards} "
                             f"batch shards (devices)")
        return self.batch_size // num_shards

    def mean_tokens(self, name: str) -> float:
        """Mean events per row of sequence `name` before its cap (from the footers; null
        and empty lists count as one)."""
        seq = next(s for s in self.columns.sequences if s.name == name)
        return self.index.tokens[seq.fields[0][1]] / self.num_rows

    def sequence_capacity(self, num_shards: int) -> dict[str, int]:
        """{sequence: packed token capacity of one shard}, each a multiple of 128."""
        b = self.local_batch_size(num_shards)
        out = {}
        for s in self.columns.sequences:
            most = max(128, math.ceil(b * s.cap / 128) * 128)
            if s.name in self.capacity_tokens:
                per = self.capacity_tokens[s.name] / num_shards
                out[s.name] = max(128, math.ceil(per / 128) * 128)
                continue
            need = self.capacity_slack * b * min(self.mean_tokens(s.name), s.cap)
            out[s.name] = min(max(128, math.ceil(need / 128) * 128), most)
        return out

    def steps_per_epoch(self, num_shards: int) -> int:
        """Steps until every row was served once (time order) / every lane row (shuffle)."""
        b = self.local_batch_size(num_shards)
        if self.order == "time":
            return self.num_rows // self.batch_size
        return (self.num_rows // num_shards) // b

    # ---- which rows -----------------------------------------------------------------------

    def _compute_epoch_order(self, epoch: int):
        """(row groups in epoch order [G], their first row in that order [G + 1])."""
        perm = np.random.default_rng([self.seed, 0, epoch]).permutation(len(self.index.rows))
        start = np.zeros(perm.shape[0] + 1, np.int64)
        np.cumsum(self.index.rows[perm], out=start[1:])
        return perm, start

    def _compute_window_order(self, epoch: int, num_shards: int, shard: int, window: int,
                              size: int) -> np.ndarray:
        """[size] the in-memory permutation of one shuffle window of a lane."""
        key = [self.seed, 1, epoch, num_shards, shard, window]
        return np.random.default_rng(key).permutation(size)

    def rows_of(self, step: int, shard: int, num_shards: int) -> np.ndarray:
        """[b] int64 global row numbers (file order) of shard `shard` of step `step`."""
        if step < 0 or not 0 <= shard < num_shards:
            raise ValueError(f"step {step} / shard {shard} out of range for {num_shards} shards")
        b = self.local_batch_size(num_shards)
        n = self.num_rows
        if self.order == "time":
            return (step * self.batch_size + shard * b + np.arange(b, dtype=np.int64)) % n
        lane = n // num_shards
        if lane == 0:
            raise ValueError(f"parquet: {n} rows cannot feed {num_shards} shards")
        pos = step * b + np.arange(b, dtype=np.int64)          # position in the lane's stream
        epoch, q = np.divmod(pos, lane)
        width = min(self.window, lane)
        win, j = np.divmod(q, width)
        lane_row = np.empty(b, np.int64)
        keys = epoch * (lane // width + 1) + win
        for key in np.unique(keys):
            sel = keys == key
            e, w = int(epoch[sel][0]), int(win[sel][0])
            size = min(width, lane - w * width)
            lane_row[sel] = w * width + self._window_order(e, num_shards, shard, w, size)[j[sel]]
        out = np.empty(b, np.int64)
        for e in np.unique(epoch):
            sel = epoch == e
            groups, start = self._epoch_order(int(e))
            p = shard * lane + lane_row[sel]                   # position in the epoch's permuted rows
            k = np.searchsorted(start, p, side="right") - 1
            out[sel] = self.index.start[groups[k]] + (p - start[k])
        return out

    def epochs_of(self, step: int, shard: int, num_shards: int) -> np.ndarray:
        """[b] int64 the epoch (pass over the rows) each row of rows_of(step, shard,
        num_shards) is read in: lane position // lane rows (shuffle), global position //
        num_rows (time)."""
        b = self.local_batch_size(num_shards)
        if self.order == "time":
            return (step * self.batch_size + shard * b + np.arange(b, dtype=np.int64)) // self.num_rows
        return (step * b + np.arange(b, dtype=np.int64)) // (self.num_rows // num_shards)

    # ---- decoding -------------------------------------------------------------------------

    def _where(self, g: int, row: int | None = None) -> str:
        ix = self.index
        path, rg = ix.files[ix.file[g]], int(ix.group[g])
        if row is None:
            return f"{path}: row group {rg}"
        file_row = int(ix.start[g] - ix.file_start[g]) + int(row)
        return f"{path}: row group {rg}: row {int(row)} (row {file_row} of the file)"

    def _read(self, g: int) -> pa.Table:
        ix = self.index
        path, rg = ix.files[ix.file[g]], int(ix.group[g])
        cols = list(self.columns.columns)
        pf = pq.ParquetFile(path, metadata=self._metas[ix.file[g]])
        try:
            try:
                table = pf.read_row_group(rg, columns=cols)
            except Exception as e:  # noqa: BLE001 - find the column that fails
                for c in cols:
                    try:
                        pf.read_row_group(rg, columns=[c])
                    except Exception as ec:  # noqa: BLE001
                        raise ValueError(f"parquet: {self._where(g)}: column {c!r} cannot be "
                                         f"decoded ({type(ec).__name__}: {ec}); the file is "
                                         f"damaged") from ec
                raise ValueError(f"parquet: {self._where(g)} cannot be decoded "
                                 f"({type(e).__name__}: {e})") from e
        finally:
            pf.close()
        if table.num_rows != ix.rows[g]:
            raise ValueError(f"parquet: {self._where(g)} holds {table.num_rows} rows, its footer "
                             f"says {ix.rows[g]}")
        return table

    def _ids(self, g: int, col: str, v: np.ndarray, counts: dict, row_of) -> np.ndarray:
        """Raw ids (int64 [n]) -> int32 ids per the column's bounds mode; fills counts
        (bool [n] of repaired ids) or raises naming the row (row_of: value index -> row)."""
        hi = self._vocab.get(col, _INT32_LIMIT)
        mode = self._bounds.get(col, "strict")
        if v.dtype.kind == "u" and v.dtype.itemsize == 8:      # > int64 max wraps negative: out of range
            v = v.view(np.int64)
        bad = (v >= hi) if v.dtype.kind == "u" else (v < 0) | (v >= hi)
        if not bad.any():
            return v.astype(np.int32, copy=False)              # int32 files: no copy
        v = v.astype(np.int64, copy=False)
        if mode == "strict":
            i = int(np.argmax(bad))
            table = f"its table has {hi} rows" if col in self._vocab else "ids must fit int32"
            raise ValueError(f"parquet: {row_of(i)}: column {col!r}: id {int(v[i])} is outside "
                             f"[0, {hi}) ({table}); clean the data or set the column's bounds "
                             f"mode to 'clamp' or 'hash'")
        if mode == "clamp":
            out = np.clip(v, 0, hi - 1)
        else:
            out = v.copy()
            out[bad] = (_mix64(v[bad]) % np.uint64(hi)).astype(np.int64)
        counts["ids_clamped" if mode == "clamp" else "ids_hashed"] = bad
        return out.astype(np.int32)

    def _numbers(self, g: int, col: str, arr: pa.Array, counts: dict | None, row_of) -> np.ndarray:
        """Numeric column (nulls -> NaN) -> float32; non-finite values per the NaN mode
        (counts None: returned as they are)."""
        a = arr.to_numpy(zero_copy_only=False).astype(np.float32)
        if arr.null_count:
            a[arr.is_null().to_numpy(zero_copy_only=False)] = np.nan
        if counts is None:
            return a
        bad = ~np.isfinite(a)
        if bad.any():
            if self.nan == "error":
                i = int(np.argmax(bad))
                raise ValueError(f"parquet: {row_of(i)}: column {col!r} is {a[i]} (NaN, Inf or "
                                 f"null); clean the data or read with nan='zero'")
            a[bad] = 0.0
            counts["nan_filled"] = bad
        m = self.dense_max_abs
        if m > 0:
            big = np.abs(a) > m
            if big.any():
                if self.nan == "error":
                    i = int(np.argmax(big))
                    raise ValueError(f"parquet: {row_of(i)}: column {col!r} is {float(a[i]):g}, "
                                     f"beyond the bound {m:g} (data.dense_max_abs); clean the "
                                     f"data, raise the bound, or read with nan='zero' (clamped, "
                                     f"counted dense_clamped)")
                a = np.clip(a, -m, m)
                counts["dense_clamped"] = big
        return a

    def _decode(self, g: int) -> _Chunk:
        table = self._read(g)
        cols = self.columns
        n = table.num_rows
        at_row = functools.partial(self._where, g)
        scalars, row_counts = {}, {}

        def add_counts(counts: dict):
            for k, flags in counts.items():
                row_counts[k] = row_counts.get(k, 0) + flags.astype(np.int64)

        def column(c) -> pa.Array:
            ch = table.column(c)
            return ch.chunk(0) if ch.num_chunks == 1 else ch.combine_chunks()

        for c in cols.sparse + ((cols.surface,) if cols.surface else ()):
            arr = column(c)
            if arr.null_count:
                i = int(np.argmax(arr.is_null().to_numpy(zero_copy_only=False)))
                raise ValueError(f"parquet: {at_row(i)}: column {c!r} is null (ids must be set)")
            counts: dict = {}
            scalars[c] = self._ids(g, c, arr.to_numpy(zero_copy_only=False), counts, at_row)
            add_counts(counts)
        dense = np.zeros((n, len(cols.dense)), np.float32)
        for k, c in enumerate(cols.dense):
            counts = {}
            dense[:, k] = self._numbers(g, c, column(c), counts, at_row)
            add_counts(counts)
        for c in cols.labels:
            a = self._numbers(g, c, column(c), None, at_row)
            bad = ~(np.isnan(a) | (a == 0) | (a == 1))
            if bad.any():
                i = int(np.argmax(bad))
                raise ValueError(f"parquet: {at_row(i)}: label column {c!r} is {a[i]}; labels are "
                                 f"0, 1, or null / NaN (unobserved)")
            scalars[c] = a
        if cols.weight:
            a = self._numbers(g, cols.weight, column(cols.weight), None, at_row)
            bad = ~(np.isfinite(a) & (a >= 0))
            if bad.any():
                i = int(np.argmax(bad))
                raise ValueError(f"parquet: {at_row(i)}: weight column {cols.weight!r} is {a[i]}; "
                                 f"weights must be finite and >= 0")
            scalars[cols.weight] = a
        offsets, values, token_counts = {}, {}, {}
        for s in cols.sequences:
            lengths, vals, tok = None, {}, {}
            for field, c in s.fields:
                arr = column(c)
                off = arr.offsets.to_numpy(zero_copy_only=False).astype(np.int64)
                lens = np.diff(off)
                if arr.null_count:                             # a null list is an empty sequence
                    lens[arr.is_null().to_numpy(zero_copy_only=False)] = 0
                if lengths is None:
                    lengths = lens
                    offsets[s.name] = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
                elif not np.array_equal(lens, lengths):
                    i = int(np.argmax(lens != lengths))
                    raise ValueError(f"parquet: {at_row(i)}: sequence {s.name!r}: column {c!r} has "
                                     f"{lens[i]} events, column {s.fields[0][1]!r} has {lengths[i]}")
                flat = arr.flatten()                           # live values only, zero-copy if it can
                seq_off = offsets[s.name]

                def event_row(i, seq_off=seq_off):
                    row = int(np.searchsorted(seq_off, i, side="right") - 1)
                    return f"{at_row(row)}: event {i - int(seq_off[row])}"

                if flat.null_count:
                    i = int(np.argmax(flat.is_null().to_numpy(zero_copy_only=False)))
                    raise ValueError(f"parquet: {event_row(i)}: column {c!r} holds a null value "
                                     f"inside a list")
                counts = {}
                if pa.types.is_integer(flat.type):
                    vals[field] = self._ids(g, c, flat.to_numpy(zero_copy_only=False), counts,
                                            event_row)
                else:
                    vals[field] = self._numbers(g, c, flat, counts, event_row)
                for k, flags in counts.items():
                    tok[k] = tok.get(k, 0) + flags.astype(np.int64)
            values[s.name] = vals
            token_counts[s.name] = {k: np.concatenate([[0], np.cumsum(v)]) for k, v in tok.items()}
        return _Chunk(scalars, dense, offsets, values, row_counts, token_counts)

    def _chunk(self, g: int) -> _Chunk:
        """Row group g decoded, through the shared LRU cache."""
        with self._lock:
            fut = self._cache.get(g)
            owner = fut is None
            if owner:
                fut = self._cache[g] = Future()
            else:
                self._cache.move_to_end(g)
        if not owner:
            return fut.result()
        try:
            chunk = self._decode(g)
        except BaseException as e:
            with self._lock:
                self._cache.pop(g, None)
            fut.set_exception(e)
            raise
        fut.set_result(chunk)
        with self._lock:
            self._sizes[g] = chunk.nbytes
            while sum(self._sizes.values()) > self.cache_bytes and len(self._sizes) > 1:
                old = next((k for k, f in self._cache.items() if k != g and f.done()), None)
                if old is None:
                    break
                self._cache.pop(old)
                self._sizes.pop(old, None)
        return chunk

    # ---- batches --------------------------------------------------------------------------

    def shard_batch(self, step: int, shard: int = 0,
                    num_shards: int = 1) -> tuple[Batch, SourceInfo]:
        """(Batch of numpy arrays, SourceInfo) for shard `shard` of global step `step`."""
        return self.rows_batch(self.rows_of(step, shard, num_shards), num_shards)

    def rows_batch(self, rows: np.ndarray, num_shards: int = 1) -> tuple[Batch, SourceInfo]:
        """(Batch, SourceInfo) of the given global rows (file order) [b] int64, b =
        local_batch_size(num_shards), packed to the sequence capacity of one of num_shards
        shards."""
        cols = self.columns
        b = self.local_batch_size(num_shards)
        capacity = self.sequence_capacity(num_shards)
        rows = np.asarray(rows, np.int64)
        if rows.shape != (b,) or (b and (rows.min() < 0 or rows.max() >= self.num_rows)):
            raise ValueError(f"rows_batch: need [{b}] rows in [0, {self.num_rows}), got shape "
                             f"{rows.shape}")
        g_of = np.searchsorted(self.index.start, rows, side="right") - 1
        r_of = rows - self.index.start[g_of]
        groups, inv = np.unique(g_of, return_inverse=True)
        parts = [(self._chunk(int(g)), np.flatnonzero(inv == k)) for k, g in enumerate(groups)]
        counters = Counters(dict.fromkeys(COUNTERS, 0))

        def gather(get, shape=(), dtype=np.int32):
            out = np.empty((b,) + shape, dtype)
            for ch, sel in parts:
                out[sel] = get(ch)[r_of[sel]]
            return out

        for ch, sel in parts:
            for k, per_row in ch.row_counts.items():
                counters[k] += int(per_row[r_of[sel]].sum())
        sparse = {c: gather(lambda ch, c=c: ch.scalars[c]) for c in cols.sparse}
        dense = gather(lambda ch: ch.dense, (len(cols.dense),), np.float32)
        labels = np.stack([gather(lambda ch, c=c: ch.scalars[c], dtype=np.float32)
                           for c in cols.labels], axis=1)
        observed = ~np.isnan(labels)
        label_mask = observed.astype(np.float32)
        labels = np.where(observed, labels, 0.0).astype(np.float32)
        weights = (gather(lambda ch: ch.scalars[cols.weight], dtype=np.float32) if cols.weight
                   else np.ones(b, np.float32))
        surface = (gather(lambda ch: ch.scalars[cols.surface]) if cols.surface
                   else np.zeros(b, np.int32))
        seqs = {}
        for s in cols.sequences:
            seqs[s.name] = self._gather_sequence(s, parts, r_of, b, capacity[s.name], counters)
        batch = Batch(sparse=sparse, dense=dense, sequences=seqs, labels=labels,
                      label_mask=label_mask, surface=surface, weights=weights)
        return batch, SourceInfo(counters, rows)

    @staticmethod
    def _gather_sequence(s: SequenceColumns, parts, r_of, b: int, capacity: int,
                         counters: Counters) -> Jagged:
        """Sequence `s` of the shard's rows packed into `capacity` tokens (newest kept)."""
        start = np.empty(b, np.int64)
        length = np.empty(b, np.int64)
        for ch, sel in parts:
            off = ch.offsets[s.name]
            r = r_of[sel]
            start[sel] = off[r]
            length[sel] = off[r + 1] - off[r]
        counters["seq_truncated_to_cap"] += int((length > s.cap).sum())
        keep = np.minimum(length, s.cap)
        cut = fit_to_capacity(keep, capacity)          # the longest lose their oldest events
        counters["seq_truncated_to_capacity"] += int((cut < keep).sum())
        keep = cut
        first = start + length - keep                  # newest events: the end of each list
        offsets, segment_ids, positions = layout_from_lengths(keep, capacity)
        dtypes = {f: parts[0][0].values[s.name][f].dtype for f, _ in s.fields}
        bufs = {f: np.zeros(capacity, np.int32 if dtypes[f].kind in "iu" else np.float32)
                for f, _ in s.fields}
        for ch, sel in parts:
            n = keep[sel]
            total = int(n.sum())
            if total == 0:
                continue
            before = np.cumsum(n) - n                  # tokens of this part ahead of each sample
            ramp = np.arange(total, dtype=np.int64)
            dst = np.repeat(offsets[:-1][sel] - before, n) + ramp
            src = np.repeat(first[sel] - before, n) + ramp
            for f, _ in s.fields:
                bufs[f][dst] = ch.values[s.name][f][src]
            for k, csum in ch.token_counts[s.name].items():
                counters[k] += int((csum[first[sel] + n] - csum[first[sel]]).sum())
        return Jagged(bufs, offsets, segment_ids, positions)

