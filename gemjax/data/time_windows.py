"""Windows of a timestamp column over a time-ordered Parquet source (online training).

    src = ParquetSource(path, columns, batch_size=B, order="time")
    tw = TimeWindows(src, time_column="ts", window_seconds=86_400)
    tw.num_windows                                   # the non-empty windows
    tw.describe(w)  -> {"t_start", "t_end", "rows"}
    for shards, infos, real in tw.batches(w, num_shards): ...

The files' rows, in the source's global file order, must be sorted by `time_column`
(non-decreasing; integer or floating seconds, or a Parquet timestamp, read as seconds);
a missing or non-numeric column, a null / NaN time or a row earlier than the one before
it is a ValueError naming the file, the row and the column. With t0 the first row's
time, row r falls in time bucket k = floor((t_r - t0) / window_seconds), the interval
[t0 + k W, t0 + (k + 1) W); the windows are the non-empty buckets in time order,
numbered 0, 1, ... (an empty bucket is no window). Window w holds rows [a_w, e_w).

Batches: window w is read in ceil(n_w / B) global batches of B rows (n_w = e_w - a_w),
batch j rows a_w + j B + [0, B); the last batch's rows past e_w repeat row e_w - 1 with
label_mask 0 and weight 0 (no metric or loss reads them). Shard i of num_shards takes
the contiguous b = B / num_shards rows [i b, (i + 1) b) of its batch, so its real rows
are a prefix: `real` [num_shards] int gives their count per shard. Global step numbers
run on over the windows: window w's batches are steps start_step(w) ..
start_step(w + 1) - 1. Every batch is a pure function of (files, column, width, B,
step, shard, num_shards).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from gemjax.config import Config
from gemjax.data.batch import Batch
from gemjax.data.parquet import ParquetSource, columns_from_schema, sequence_column

_PER_SECOND = {"s": 1, "ms": 1_000, "us": 1_000_000, "ns": 1_000_000_000}


def read_times(files, column: str, where: str = "data.time_column") -> np.ndarray:
    """[N] float64 seconds of `column` over `files` (in order), checked: present,
    numeric or timestamp, no null / non-finite value, non-decreasing across the files.
    ValueError naming the file, the row of the file and the column."""
    out, prev = [], None            # prev: (time, path, row of its file)
    for path in files:
        pf = pq.ParquetFile(path)
        try:
            names = pf.schema_arrow.names
            if column not in names:
                raise ValueError(f"parquet: {path}: the time column {column!r} ({where}) is "
                                 f"missing (the file has {names})")
            typ = pf.schema_arrow.field(column).type
            arr = pf.read(columns=[column]).column(column).combine_chunks()
        finally:
            pf.close()
        if pa.types.is_timestamp(typ):
            t = pc.cast(arr, pa.int64()).to_numpy(zero_copy_only=False).astype(np.float64)
            t /= _PER_SECOND[typ.unit]
        elif pa.types.is_integer(typ) or pa.types.is_floating(typ):
            t = arr.to_numpy(zero_copy_only=False).astype(np.float64)
        else:
            raise ValueError(f"parquet: {path}: the time column {column!r} ({where}) has type "
                             f"{typ}, expected integer or floating seconds or a timestamp")
        bad = ~np.isfinite(t)
        if arr.null_count:
            bad |= arr.is_null().to_numpy(zero_copy_only=False)
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"parquet: {path}: row {i}: the time column {column!r} ({where}) is "
                             f"{'null' if arr[i].as_py() is None else t[i]}; every row needs a "
                             f"finite time")
        if len(t):
            back = np.flatnonzero(t[1:] < t[:-1])
            if back.size:
                i = int(back[0]) + 1
                raise ValueError(f"parquet: {path}: row {i}: the time column {column!r} ({where}) "
                                 f"goes back: {t[i]:g} after {t[i - 1]:g} (row {i - 1}); the rows "
                                 f"must be sorted by time")
            if prev is not None and t[0] < prev[0]:
                raise ValueError(f"parquet: {path}: row 0: the time column {column!r} ({where}) "
                                 f"goes back: {t[0]:g} after {prev[0]:g} (row {prev[2]} of "
                                 f"{prev[1]}); the files, in sorted path order, must be sorted "
                                 f"by time")
            prev = (float(t[-1]), path, len(t) - 1)
        out.append(t)
    return np.concatenate(out) if out else np.zeros(0, np.float64)


class TimeWindows:
    """The windows of a time-ordered `ParquetSource` (module docstring).

    source: a gemjax.data.parquet.ParquetSource (its batch_size is B); time_column,
    window_seconds: the column and the width of a window in its seconds.
    """

    def __init__(self, source, time_column: str, window_seconds: float):
        if not time_column:
            raise ValueError("time windows need data.time_column (the column of event times)")
        if not window_seconds > 0:
            raise ValueError(f"time windows need data.window_seconds > 0, got {window_seconds}")
        self.source, self.time_column = source, time_column
        self.window_seconds = float(window_seconds)
        times = read_times(source.index.files, time_column)
        if len(times) != source.num_rows:
            raise ValueError(f"parquet: the time column {time_column!r} has {len(times)} rows, "
                             f"the source {source.num_rows}")
        self.t0 = float(times[0])
        bucket = np.floor((times - self.t0) / self.window_seconds).astype(np.int64)
        first = np.flatnonzero(np.r_[True, bucket[1:] != bucket[:-1]])
        self.bucket = bucket[first]                                    # [W] time bucket of each window
        self.bounds = np.r_[first, len(times)].astype(np.int64)        # [W + 1] first row of each window
        self.first_time, self.last_time = times[first], times[self.bounds[1:] - 1]
        steps = -(-np.diff(self.bounds) // source.batch_size)
        self.step_start = np.r_[0, np.cumsum(steps)].astype(np.int64)  # [W + 1]

    @property
    def num_windows(self) -> int:
        return len(self.bucket)

    def _check(self, w: int) -> None:
        if not 0 <= w < self.num_windows:
            raise ValueError(f"window {w} is outside the {self.num_windows} windows of "
                             f"{self.time_column!r} (width {self.window_seconds:g} s)")

    def start_step(self, w: int) -> int:
        """The global step of window w's first batch (w = num_windows: the total steps)."""
        return int(self.step_start[w])

    def describe(self, w: int) -> dict:
        """{"t_start", "t_end": window w's interval [t_start, t_end) in seconds, "rows"}."""
        self._check(w)
        k = int(self.bucket[w])
        return {"t_start": self.t0 + k * self.window_seconds,
                "t_end": self.t0 + (k + 1) * self.window_seconds,
                "rows": int(self.bounds[w + 1] - self.bounds[w])}

    def batches(self, w: int, num_shards: int = 1) -> list[tuple[list[Batch], list, np.ndarray]]:
        """Window w's batches in order: (num_shards Batches, their SourceInfos, real
        rows per shard [num_shards] int64)."""
        self._check(w)
        a, e = int(self.bounds[w]), int(self.bounds[w + 1])
        big, b = self.source.batch_size, self.source.local_batch_size(num_shards)
        out = []
        for j in range(math.ceil((e - a) / big)):
            rows = a + j * big + np.arange(big, dtype=np.int64)
            real = rows < e
            rows = np.minimum(rows, e - 1)
            shards, infos = [], []
            for i in range(num_shards):
                batch, info = self.source.rows_batch(rows[i * b:(i + 1) * b], num_shards)
                pad = ~real[i * b:(i + 1) * b]
                if pad.any():
                    batch = batch.replace(
                        label_mask=np.where(pad[:, None], 0, batch.label_mask).astype(np.float32),
                        weights=np.where(pad, 0, batch.weights).astype(np.float32))
                shards.append(batch)
                infos.append(info)
            out.append((shards, infos, real.reshape(num_shards, b).sum(1)))
        return out


def parquet_windows(cfg: Config, admit_tables: tuple[str, ...]) -> TimeWindows:
    """The time windows of cfg's Parquet train rows (data.train_path, read in file order,
    data.time_column, data.window_seconds; columns from cfg.features). Ids of the
    admitted tables are raw (any int32 >= 0: the admission maps them to rows); the other
    id columns keep their table's vocab and bounds. ValueError naming the field, file or
    column that does not fit."""
    d = cfg.data
    if cfg.features is None or not d.train_path:
        raise ValueError("online training on data.source=parquet needs config.features and "
                         "data.train_path")
    if d.order != "time":
        raise ValueError(f"online training reads the Parquet rows in time order: set "
                         f"data.order=time (got {d.order!r})")
    if d.negatives:
        raise ValueError("online training reads the rows as stored: data.negatives must be 0")
    cols = columns_from_schema(cfg.features)
    tables = {f.name: f.table for f in cfg.features.sparse}
    tables.update({sequence_column(s.name, e.name): e.table for s in cfg.features.sequences
                   for e in s.fields})
    raw = {c for c, t in tables.items() if t in admit_tables}
    cols = dataclasses.replace(cols, vocab=tuple(p for p in cols.vocab if p[0] not in raw),
                               bounds=tuple(p for p in cols.bounds if p[0] not in raw))
    try:
        source = ParquetSource(d.train_path, cols, d.batch_size, cfg.train.seed, order="time",
                               nan=d.nan, capacity_slack=d.capacity_slack,
                               dense_max_abs=d.dense_max_abs)
        return TimeWindows(source, d.time_column, d.window_seconds)
    except (ValueError, FileNotFoundError) as e:
        raise type(e)(f"data.train_path={d.train_path}: {e}") from None
