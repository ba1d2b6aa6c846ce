"""Parquet reader throughput (rows/s), with and without grain as its index / shuffle / worker layer.

    python -m benchmarks.bench_parquet --rows=1000000 --mean_len=100 --threads=1,4,8 --grain

Writes one file of --rows rows (user, item int64; 4 float dense; a 0/1 label; one
list<int32> column `hist` of log-normal lengths with mean --mean_len, cap 256) in
row groups of --row_group rows, then times:

  reader shuffle / time    gemjax.data.parquet.ParquetSource.shard_batch, one thread,
                           fresh reader (every row group decoded once in the run)
  reader threads=k         the same, k threads building consecutive steps (the Feeder's way)
  grain records            grain's ParquetIterDataset -> WindowShuffleIterDataset ->
                           batch of --batch rows packed into a Jagged (per-row Python)
  grain workers=k          grain MapDataset over steps mapped through shard_batch,
                           mp_prefetch with k worker processes

Each measurement stops after --seconds or one epoch. Prints a table (rows/s of wall time,
and rows per CPU-second of this process, which the grain workers' own CPU is not part
of), writes JSON (--out).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from absl import app, flags

flags.DEFINE_integer("rows", 1_000_000, "rows in the generated file")
flags.DEFINE_float("mean_len", 100.0, "mean list length")
flags.DEFINE_integer("row_group", 16_384, "rows per row group")
flags.DEFINE_integer("batch", 4096, "rows per batch")
flags.DEFINE_integer("window", 65_536, "shuffle window (rows)")
flags.DEFINE_list("threads", ["1", "4"], "thread / worker counts")
flags.DEFINE_bool("grain", False, "also time grain's pipelines")
flags.DEFINE_float("seconds", 20.0, "time limit per measurement")
flags.DEFINE_string("dir", "", "where to write the file (default: a temporary directory)")
flags.DEFINE_string("out", "", "JSON output path")

CAP = 256


def write_file(path: str, rows: int, mean_len: float, row_group: int) -> dict:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    rng = np.random.default_rng(0)
    sigma = 0.8
    mu = np.log(mean_len) - sigma ** 2 / 2
    tokens = 0
    t0 = time.perf_counter()
    writer = None
    for lo in range(0, rows, row_group):
        n = min(row_group, rows - lo)
        lens = np.rint(rng.lognormal(mu, sigma, n)).astype(np.int32)
        off = np.zeros(n + 1, np.int32)
        np.cumsum(lens, out=off[1:])
        hist = pa.ListArray.from_arrays(pa.array(off), pa.array(rng.integers(0, 1_000_000, int(off[-1]),
                                                                              dtype=np.int32)))
        tokens += int(off[-1])
        cols = {"user": rng.integers(0, 10_000_000, n), "item": rng.integers(0, 1_000_000, n),
                **{f"d{k}": rng.normal(size=n).astype(np.float32) for k in range(4)},
                "label": (rng.random(n) < 0.3).astype(np.float32), "hist": hist}
        table = pa.table(cols)
        if writer is None:
            writer = pq.ParquetWriter(path, table.schema)
        writer.write_table(table, row_group_size=row_group)
    writer.close()
    return {"rows": rows, "mean_len": tokens / rows, "bytes": os.path.getsize(path),
            "write_s": time.perf_counter() - t0}


def columns():
    from gemjax.data.parquet import ParquetColumns, SequenceColumns
    return ParquetColumns(sparse=("user", "item"), dense=tuple(f"d{k}" for k in range(4)),
                          sequences=(SequenceColumns("hist", (("item", "hist"),), cap=CAP),),
                          labels=("label",), vocab=(("user", 10_000_000), ("item", 1_000_000),
                                                    ("hist", 1_000_000)))


def time_reader(path, order, threads, f) -> dict:
    from gemjax.data.parquet import ParquetSource
    src = ParquetSource(path, columns(), batch_size=f.batch, seed=0, order=order, window=f.window)
    steps = src.steps_per_epoch(1)
    t0, c0, done, tokens = time.perf_counter(), time.process_time(), 0, 0
    with ThreadPoolExecutor(threads) as pool:
        for lo in range(0, steps, 4 * threads):
            chunk = range(lo, min(lo + 4 * threads, steps))
            for batch, _ in pool.map(lambda s: src.shard_batch(s, 0, 1), chunk):
                done += batch.batch_size
                tokens += int(batch.sequences["hist"].offsets[-1])
            if time.perf_counter() - t0 > f.seconds:
                break
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"what": f"reader {order} threads={threads}", "rows": done, "s": dt, "cpu_s": cpu,
            "rows_per_s": done / dt, "tokens_per_s": tokens / dt}


def pack_rows(rows):
    """grain's batch_fn: a list of row dicts -> (sparse, dense, labels, Jagged), per row."""
    import numpy as np
    from gemjax.data.jagged import pack
    hist = [np.asarray(r["hist"])[-CAP:] for r in rows]
    return ({c: np.array([r[c] for r in rows], np.int32) for c in ("user", "item")},
            np.array([[r[f"d{k}"] for k in range(4)] for r in rows], np.float32),
            np.array([r["label"] for r in rows], np.float32), pack({"item": hist}))


def time_grain_records(path, f) -> dict:
    import grain
    ds = grain.experimental.ParquetIterDataset(path)
    ds = grain.experimental.WindowShuffleIterDataset(ds, window_size=f.window, seed=0)
    ds = ds.batch(f.batch, batch_fn=pack_rows)
    t0, c0, done, tokens = time.perf_counter(), time.process_time(), 0, 0
    for _, _, _, jag in ds:
        done += jag.num_samples
        tokens += int(jag.offsets[-1])
        if time.perf_counter() - t0 > f.seconds or done >= f.rows:
            break
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"what": "grain records (window shuffle, per-row packing)", "rows": done, "s": dt,
            "cpu_s": cpu, "rows_per_s": done / dt, "tokens_per_s": tokens / dt}


class _ShardBatch:
    """Picklable map function for grain's worker processes: step -> the batch's arrays."""

    def __init__(self, path, batch, window):
        self.args = (path, batch, window)
        self.src = None

    def __call__(self, step):
        from gemjax.data.parquet import ParquetSource
        if self.src is None:
            path, batch, window = self.args
            self.src = ParquetSource(path, columns(), batch_size=batch, seed=0, window=window)
        b, _ = self.src.shard_batch(int(step), 0, 1)
        j = b.sequences["hist"]
        return {"user": b.sparse["user"], "item": b.sparse["item"], "dense": b.dense,
                "labels": b.labels, "hist": j.values["item"], "offsets": j.offsets,
                "segment_ids": j.segment_ids, "positions": j.positions}

    def __getstate__(self):
        return {"args": self.args, "src": None}


def time_grain_workers(path, workers, f) -> dict:
    import grain
    from gemjax.data.parquet import ParquetSource
    steps = ParquetSource(path, columns(), batch_size=f.batch).steps_per_epoch(1)
    ds = grain.MapDataset.range(steps).map(_ShardBatch(path, f.batch, f.window)).to_iter_dataset()
    ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
    t0, c0, done, tokens = time.perf_counter(), time.process_time(), 0, 0
    for b in ds:
        done += b["labels"].shape[0]
        tokens += int(b["offsets"][-1])
        if time.perf_counter() - t0 > f.seconds:
            break
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"what": f"grain workers={workers} over shard_batch", "rows": done, "s": dt, "cpu_s": cpu,
            "rows_per_s": done / dt, "tokens_per_s": tokens / dt}


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    f = flags.FLAGS
    threads = [int(t) for t in f.threads]
    d = f.dir or tempfile.mkdtemp(prefix="bench_parquet_")
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, "bench.parquet")
    info = write_file(path, f.rows, f.mean_len, f.row_group)
    print(f"[bench_parquet] {path}: {info['rows']:,} rows, mean list length {info['mean_len']:.1f}, "
          f"{info['bytes'] / 2**20:.0f} MiB, written in {info['write_s']:.1f} s", flush=True)
    results = [time_reader(path, "shuffle", 1, f), time_reader(path, "time", 1, f)]
    results += [time_reader(path, "shuffle", t, f) for t in threads if t > 1]
    if f.grain:
        results.append(time_grain_records(path, f))
        results += [time_grain_workers(path, t, f) for t in threads]
    if f.out:
        with open(f.out, "w") as fh:
            json.dump({"file": info, "flags": {k: getattr(f, k) for k in
                                               ("rows", "mean_len", "row_group", "batch", "window")},
                       "cpus": os.cpu_count(), "results": results}, fh, indent=1)
    print(f"{'pipeline':52s} {'rows':>9s} {'s':>6s} {'rows/s':>10s} {'tokens/s':>12s} "
          f"{'rows/cpu-s':>11s}")
    for r in results:
        print(f"{r['what']:52s} {r['rows']:9,d} {r['s']:6.1f} {r['rows_per_s']:10,.0f} "
              f"{r['tokens_per_s']:12,.0f} {r['rows'] / max(r['cpu_s'], 1e-9):11,.0f}")


if __name__ == "__main__":
    app.run(main)
