"""Parquet source (gemjax.data.parquet) against a plain per-row reader, and the source protocol.

The reference reads each file with `pq.read_table(...).to_pylist()` (one dict per
row, in the file order), picks the rows of a batch by walking the documented
shuffle rule position by position, and builds each sample with Python lists
(newest `cap` events, then the capacity cut) before `jagged.pack`.
"""

import dataclasses
import math
import os
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gemjax.data.feeding import merge_infos, merge_shards, regroup
from gemjax.data.jagged import pack
from gemjax.data.parquet import ParquetColumns, ParquetSource, SequenceColumns
from gemjax.data.source import Counters, Source, SourceInfo, fallback_counters, sum_counters
from gemjax.data.synthetic import ShardInfo, SyntheticStream

CAP = 6
COLS = ParquetColumns(
    sparse=("user", "item"), dense=("age", "score"),
    sequences=(SequenceColumns("clicks", (("item", "click_item"), ("gap", "click_gap")), cap=CAP),
               SequenceColumns("views", (("item", "view_item"),), cap=4)),
    labels=("click", "buy"), weight="w", surface="surf",
    vocab=(("user", 40), ("item", 30), ("click_item", 30), ("view_item", 30), ("surf", 3)))


def _table(rng, n, first_row):
    """n rows; click histories up to 9 events (over the cap of 6), some null / empty."""
    lens = rng.integers(0, 10, n)
    clicks = [list(map(int, rng.integers(0, 30, k))) for k in lens]
    gaps = [list(map(float, rng.random(k).round(3))) for k in lens]
    for i in range(0, n, 7):
        clicks[i], gaps[i] = None, None                           # null lists: empty sequences
    views = [list(map(int, rng.integers(0, 30, k))) for k in rng.integers(0, 3, n)]
    buy = [None if i % 5 == 0 else float(rng.integers(0, 2)) for i in range(n)]   # unobserved
    return pa.table({
        "user": pa.array((first_row + np.arange(n)) % 40, pa.int64()),   # global row number % 40
        "item": pa.array(rng.integers(0, 30, n), pa.int32()),
        "age": rng.normal(size=n).astype(np.float32), "score": rng.integers(0, 5, n),
        "click_item": pa.array(clicks, pa.list_(pa.int64())),
        "click_gap": pa.array(gaps, pa.list_(pa.float32())),
        "view_item": pa.array(views, pa.large_list(pa.int32())),
        "click": rng.integers(0, 2, n).astype(np.float64), "buy": pa.array(buy, pa.float64()),
        "w": rng.uniform(0.5, 2, n), "surf": rng.integers(0, 3, n).astype(np.int16),
    })


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Three files, 37 + 50 + 23 rows, row groups of 8 / 16 / 5 rows."""
    d = tmp_path_factory.mktemp("pq")
    rng = np.random.default_rng(0)
    first = 0
    for name, n, rg in (("a.parquet", 37, 8), ("b.parquet", 50, 16), ("c.parquet", 23, 5)):
        pq.write_table(_table(rng, n, first), d / name, row_group_size=rg)
        first += n
    return str(d)


def _reference_rows(path):
    """Every row as a dict, in global file order (files sorted by name)."""
    rows = []
    for f in sorted(os.listdir(path)):
        rows.extend(pq.read_table(os.path.join(path, f)).to_pylist())
    return rows


def _rg_rows(path):
    return [pq.ParquetFile(os.path.join(path, f)).metadata.row_group(g).num_rows
            for f in sorted(os.listdir(path))
            for g in range(pq.ParquetFile(os.path.join(path, f)).metadata.num_row_groups)]


def _reference_pick(path, seed, step, shard, n, batch, window):
    """Global rows of a shuffled shard, one position at a time (the module docstring's rule)."""
    rg_rows = _rg_rows(path)
    total, b = sum(rg_rows), batch // n
    lane = total // n
    width = min(window, lane)
    out = []
    for i in range(b):
        epoch, q = divmod(step * b + i, lane)
        w, j = divmod(q, width)
        size = min(width, lane - w * width)
        lane_row = w * width + np.random.default_rng([seed, 1, epoch, n, shard, w]).permutation(size)[j]
        pos = shard * lane + lane_row
        for g in np.random.default_rng([seed, 0, epoch]).permutation(len(rg_rows)):
            if pos < rg_rows[g]:
                out.append(sum(rg_rows[:g]) + pos)
                break
            pos -= rg_rows[g]
    return out


def _reference_batch(rows, picked, capacity):
    """(dict of arrays, sequences {name: Jagged}, counters) built row by row."""
    out = {"sparse": {c: np.array([rows[r][c] for r in picked], np.int32) for c in COLS.sparse},
           "dense": np.array([[rows[r][c] for c in COLS.dense] for r in picked], np.float32),
           "labels": np.array([[rows[r][c] or 0.0 for c in COLS.labels] for r in picked], np.float32),
           "label_mask": np.array([[rows[r][c] is not None for c in COLS.labels] for r in picked],
                                  np.float32),
           "weights": np.array([rows[r]["w"] for r in picked], np.float32),
           "surface": np.array([rows[r]["surf"] for r in picked], np.int32)}
    seqs, counters = {}, {"seq_truncated_to_cap": 0, "seq_truncated_to_capacity": 0}
    for s in COLS.sequences:
        per_field = {f: [list(rows[r][c] or []) for r in picked] for f, c in s.fields}
        first = per_field[s.fields[0][0]]
        counters["seq_truncated_to_cap"] += sum(len(x) > s.cap for x in first)
        kept = [min(len(x), s.cap) for x in first]
        limit = max(kept)
        while sum(min(k, limit) for k in kept) > capacity[s.name]:
            limit -= 1
        counters["seq_truncated_to_capacity"] += sum(min(k, limit) < k for k in kept)
        keep = [min(k, limit) for k in kept]
        vals = {f: [np.array(x[len(x) - k:], np.float32 if f == "gap" else np.int32)
                    for x, k in zip(v, keep)] for f, v in per_field.items()}
        seqs[s.name] = pack(vals, capacity[s.name])
    return out, seqs, counters


def _assert_batch(batch, info, ref):
    want, seqs, counters = ref
    for c, v in want["sparse"].items():
        np.testing.assert_array_equal(batch.sparse[c], v, err_msg=c)
        assert batch.sparse[c].dtype == np.int32
    for k in ("dense", "labels", "label_mask", "weights", "surface"):
        got = getattr(batch, k)
        np.testing.assert_array_equal(got, want[k], err_msg=k)
        assert got.dtype == want[k].dtype, k
    for name, j in seqs.items():
        g = batch.sequences[name]
        for k in ("offsets", "segment_ids", "positions"):
            np.testing.assert_array_equal(getattr(g, k), getattr(j, k), err_msg=f"{name}.{k}")
        for f in j.values:
            np.testing.assert_array_equal(g.values[f], j.values[f], err_msg=f"{name}.{f}")
            assert g.values[f].dtype == j.values[f].dtype
    for k, v in counters.items():
        assert info.counters[k] == v, k


@pytest.mark.parametrize("order,n,batch,steps,window,tokens", [
    ("shuffle", 1, 16, (0, 1, 6, 13), 1000, None),  # 110 rows: step 6 straddles epochs 0 and 1
    ("shuffle", 1, 64, (0, 3, 4), 20, {"clicks": 100}),   # 64 rows, ~220 tokens in 128: cuts
    ("shuffle", 2, 16, (0, 5), 20, None),
    ("shuffle", 4, 16, (3, 7), 7, None),
    ("time", 2, 16, (0, 6, 13), 1, None),           # step 6 wraps around the end of the files
])
def test_batches_match_a_per_row_reference_reader(files, order, n, batch, steps, window, tokens):
    rows = _reference_rows(files)
    src = ParquetSource(files, COLS, batch_size=batch, seed=3, order=order, window=window,
                        capacity_tokens=tokens, cache_bytes=20_000)    # a small cache: evictions too
    assert src.num_rows == len(rows) == 110
    cap = src.sequence_capacity(n)
    assert all(c % 128 == 0 for c in cap.values())
    cut = 0
    for step in steps:
        for shard in range(n):
            if order == "time":
                picked = [(step * batch + shard * (batch // n) + i) % 110 for i in range(batch // n)]
            else:
                picked = _reference_pick(files, 3, step, shard, n, batch, window)
            got, info = src.shard_batch(step, shard, n)
            np.testing.assert_array_equal(info.rows, picked)
            ref = _reference_batch(rows, picked, cap)
            _assert_batch(got, info, ref)
            cut += ref[2]["seq_truncated_to_capacity"]
    assert (cut > 0) == (tokens is not None)


def test_capacity_is_static_and_bounded(files):
    src = ParquetSource(files, COLS, batch_size=16)
    rows = _reference_rows(files)
    events = sum(len(r["click_item"] or [1]) for r in rows)  # null/empty counted as one
    assert src.mean_tokens("clicks") == pytest.approx(events / len(rows))
    # 1.3 * b * min(mean, cap), as a multiple of 128; never above b * cap
    want = max(128, math.ceil(1.3 * 16 * min(events / 110, CAP) / 128) * 128)
    assert src.sequence_capacity(1)["clicks"] == want
    big = ParquetSource(files, COLS, batch_size=64, capacity_slack=100.0)
    assert big.sequence_capacity(1) == {"clicks": 384, "views": 256}       # 64 * cap
    fixed = ParquetSource(files, COLS, batch_size=16, capacity_tokens={"clicks": 1000})
    assert fixed.sequence_capacity(4)["clicks"] == 256                       # ceil(250 / 128) * 128
    shapes = {tuple(src.shard_batch(s, 0, 2)[0].sequences["clicks"].segment_ids.shape) for s in range(9)}
    assert shapes == {(src.sequence_capacity(2)["clicks"],)}


def test_same_call_same_bytes_in_any_order_and_thread(files):
    calls = [(s, i, n) for n in (1, 2, 4) for s in (0, 4, 11) for i in range(n)]
    a = ParquetSource(files, COLS, batch_size=16, seed=5, window=9)
    first = [a.shard_batch(*c) for c in calls]
    b = ParquetSource(files, COLS, batch_size=16, seed=5, window=9, cache_bytes=1)
    with ThreadPoolExecutor(4) as pool:
        again = list(pool.map(lambda c: b.shard_batch(*c), calls[::-1]))[::-1]
    for (x, xi), (y, yi) in zip(first, again):
        for u, v in zip(jax.tree.leaves(x), jax.tree.leaves(y)):
            assert u.dtype == v.dtype and u.tobytes() == v.tobytes()
        assert xi.counters == yi.counters and np.array_equal(xi.rows, yi.rows)
    other_seed = ParquetSource(files, COLS, batch_size=16, seed=6, window=9)
    assert not np.array_equal(other_seed.shard_batch(0, 0, 1)[1].rows, first[0][1].rows)


def _assert_same_samples(x, y):
    """Same samples in the same order (capacities may differ)."""
    for k in ("dense", "labels", "label_mask", "surface", "weights"):
        np.testing.assert_array_equal(getattr(x, k), getattr(y, k), err_msg=k)
    for c in x.sparse:
        np.testing.assert_array_equal(x.sparse[c], y.sparse[c], err_msg=c)
    for name, j in x.sequences.items():
        o = y.sequences[name]
        np.testing.assert_array_equal(j.offsets, o.offsets)
        for f in j.values:
            np.testing.assert_array_equal(j.values[f][:j.offsets[-1]], o.values[f][:o.offsets[-1]])


def test_shard_counts_partition_the_same_global_batch(files):
    # time order: shards of any count are slices of the same global batch
    src = ParquetSource(files, COLS, batch_size=16, order="time")
    for step in (0, 6):
        whole, info = src.shard_batch(step, 0, 1)
        for n in (2, 4, 8):
            parts = [src.shard_batch(step, i, n) for i in range(n)]
            _assert_same_samples(merge_shards([p[0] for p in parts]), whole)
            np.testing.assert_array_equal(merge_infos([p[1] for p in parts]).rows, info.rows)
    # shuffle: K = 4 lanes regrouped onto 1, 2 or 4 devices give the same samples
    src = ParquetSource(files, COLS, batch_size=16, seed=1, window=11)
    for step in (0, 3):
        ref = regroup(src.shard_batch, 4)(step, 0, 1)
        for n in (2, 4):
            parts = [regroup(src.shard_batch, 4)(step, i, n) for i in range(n)]
            np.testing.assert_array_equal(merge_infos([p[1] for p in parts]).rows, ref[1].rows)
            _assert_same_samples(merge_shards([p[0] for p in parts]), ref[0])


def test_each_shard_reads_only_its_own_row_groups_and_an_epoch_covers_every_row(files):
    n, b = 2, 5
    src = ParquetSource(files, COLS, batch_size=n * b, seed=2, window=13)
    lane = 110 // n                                           # 55 rows per lane and epoch = 11 steps
    served = {i: np.concatenate([src.rows_of(s, i, n) for s in range(lane // b)]) for i in range(n)}
    both = np.concatenate(list(served.values()))
    assert len(both) == len(set(both.tolist())) == n * lane   # every lane row exactly once
    start = np.concatenate([[0], np.cumsum(_rg_rows(files))])
    groups = {i: set(np.searchsorted(start, r, side="right") - 1) for i, r in served.items()}
    assert len(groups[0] & groups[1]) <= 1                    # at most the boundary row group
    nxt = np.concatenate([src.rows_of(s, 0, n) for s in range(lane // b, 2 * lane // b)])
    assert not np.array_equal(nxt, served[0])                 # the next epoch is reshuffled


def test_resume_from_step_k_equals_the_uninterrupted_run(files):
    full = ParquetSource(files, COLS, batch_size=16, seed=4, window=17, cache_bytes=30_000)
    run = [full.shard_batch(s, i, 2) for s in range(12) for i in range(2)]
    resumed = ParquetSource(files, COLS, batch_size=16, seed=4, window=17, cache_bytes=30_000)
    rest = [resumed.shard_batch(s, i, 2) for s in range(7, 12) for i in range(2)]
    for (x, xi), (y, yi) in zip(run[14:], rest):
        for u, v in zip(jax.tree.leaves(x), jax.tree.leaves(y)):
            assert u.tobytes() == v.tobytes()
        assert xi.counters == yi.counters


def test_time_order_returns_rows_in_file_order(files):
    src = ParquetSource(files, COLS, batch_size=10, order="time")
    rows = np.concatenate([src.shard_batch(s, i, 2)[1].rows for s in range(11) for i in range(2)])
    np.testing.assert_array_equal(rows, np.arange(110))
    ref = _reference_rows(files)
    users = np.concatenate([src.shard_batch(s, 0, 1)[0].sparse["user"] for s in range(11)])
    np.testing.assert_array_equal(users, [r["user"] for r in ref])


# ---- bad data ----------------------------------------------------------------------------------

SMALL = ParquetColumns(sparse=("u",), dense=("x",),
                       sequences=(SequenceColumns("s", (("item", "s"),), cap=3),),
                       labels=("y",), vocab=(("u", 10), ("s", 10)))


def _write(path, n=12, rg=4, drop=(), **override):
    cols = {"u": pa.array(np.arange(n) % 10, pa.int64()), "x": np.linspace(0, 1, n),
            "s": pa.array([[j % 10 for j in range(i % 5)] for i in range(n)], pa.list_(pa.int64())),
            "y": (np.arange(n) % 2).astype(np.float32)}
    cols.update(override)
    cols = {k: v for k, v in cols.items() if k not in drop}
    pq.write_table(pa.table(cols), path, row_group_size=rg)
    return str(path)


def test_truncated_or_non_parquet_file_is_named(tmp_path):
    good = _write(tmp_path / "a.parquet")
    data = open(good, "rb").read()
    with open(tmp_path / "b.parquet", "wb") as f:
        f.write(data[: len(data) // 2])                       # truncated: no footer
    with pytest.raises(ValueError, match=r"b\.parquet: cannot read the Parquet footer"):
        ParquetSource(str(tmp_path), SMALL, batch_size=4)


def test_damaged_column_chunk_names_file_row_group_and_column(tmp_path):
    path = _write(tmp_path / "a.parquet", n=400, rg=100,
                  x=np.random.default_rng(0).normal(size=400))
    md = pq.ParquetFile(path).metadata
    col = md.row_group(2).column(1)                           # column "x" of row group 2
    assert col.path_in_schema == "x"
    raw = bytearray(open(path, "rb").read())
    start = col.dictionary_page_offset or col.data_page_offset
    raw[start:start + col.total_compressed_size] = b"\xff" * col.total_compressed_size
    open(path, "wb").write(bytes(raw))
    src = ParquetSource(path, SMALL, batch_size=100, order="time")   # the footer is intact
    src.shard_batch(0)                                        # row group 0 reads
    with pytest.raises(ValueError, match=r"a\.parquet: row group 2: column 'x' cannot be decoded"):
        src.shard_batch(2)


@pytest.mark.parametrize("override,message", [
    ({"drop": ("x",)}, r"column 'x' is missing"),
    ({"u": pa.array([str(i) for i in range(12)])}, r"column 'u' has type string, expected an integer"),
    ({"s": pa.array([[1.5]] * 12)}, None),                   # float list: allowed (a float field)
    ({"s": pa.array([["a"]] * 12)}, r"column 's' has type list<\w+: string>, expected a list"),
    ({"y": pa.array(["1"] * 12)}, r"column 'y' has type string, expected a numeric"),
])
def test_missing_or_mistyped_column_is_named(tmp_path, override, message):
    path = _write(tmp_path / "a.parquet", **override)
    if message is None:
        ParquetSource(str(path), SMALL, batch_size=4)
        return
    with pytest.raises(ValueError, match=rf"a\.parquet: {message}"):
        ParquetSource(str(path), SMALL, batch_size=4)


def test_id_beyond_its_table_strict_clamp_hash(tmp_path):
    u = np.arange(12) % 10
    u[6] = 17                                                 # row 2 of row group 1
    seq = [[j % 10 for j in range(i % 5)] for i in range(12)]
    seq[9] = [1, 2, -4]                                       # row 1 of row group 2, event 2
    path = _write(tmp_path / "a.parquet", u=pa.array(u, pa.int64()),
                  s=pa.array(seq, pa.list_(pa.int64())))
    strict = ParquetSource(path, SMALL, batch_size=12, order="time")
    with pytest.raises(ValueError, match=r"a\.parquet: row group 1: row 2 \(row 6 of the file\): "
                                         r"column 'u': id 17 is outside \[0, 10\)"):
        strict.shard_batch(0)
    bad_seq = ParquetColumns(**{**dataclasses.asdict(SMALL), "sequences": SMALL.sequences,
                                "bounds": (("u", "clamp"),)})
    with pytest.raises(ValueError, match=r"row group 2: row 1 \(row 9 of the file\): event 2: "
                                         r"column 's': id -4 is outside"):
        ParquetSource(path, bad_seq, batch_size=12, order="time").shard_batch(0)
    for mode in ("clamp", "hash"):
        cols = dataclasses.replace(SMALL, bounds=(("u", mode), ("s", mode)))
        src = ParquetSource(path, cols, batch_size=12, order="time")
        batch, info = src.shard_batch(0)
        got_u = batch.sparse["u"]
        got_s = batch.sequences["s"].values["item"]
        off = batch.sequences["s"].offsets
        if mode == "clamp":
            assert got_u[6] == 9 and got_s[off[9] + 2] == 0   # last event kept (cap 3, length 3)
        else:
            assert 0 <= got_u[6] < 10 and 0 <= got_s[off[9] + 2] < 10
            again = ParquetSource(path, cols, batch_size=12, order="time").shard_batch(0)[0]
            assert again.sparse["u"][6] == got_u[6]
        np.testing.assert_array_equal(np.delete(got_u, 6), np.delete(u, 6))
        assert info.counters[f"ids_{'clamped' if mode == 'clamp' else 'hashed'}"] == 2
        assert info.counters[f"ids_{'hashed' if mode == 'clamp' else 'clamped'}"] == 0
        # served twice -> counted twice (counters follow what batches serve)
        assert sum_counters([src.shard_batch(0)[1], src.shard_batch(0)[1]])[
            f"ids_{'clamped' if mode == 'clamp' else 'hashed'}"] == 4


def test_empty_sequences_and_sequences_past_their_cap(tmp_path):
    seq = [[], [1, 2, 3, 4, 5], None, [6], [7, 8, 9, 1, 2, 3, 4], [], [], [5, 6, 7]]
    path = _write(tmp_path / "a.parquet", n=8, s=pa.array(seq, pa.list_(pa.int64())))
    batch, info = ParquetSource(path, SMALL, batch_size=8, order="time").shard_batch(0)
    j = batch.sequences["s"]
    np.testing.assert_array_equal(j.lengths, [0, 3, 0, 1, 3, 0, 0, 3])
    np.testing.assert_array_equal(j.values["item"][:10], [3, 4, 5, 6, 2, 3, 4, 5, 6, 7])
    assert info.counters["seq_truncated_to_cap"] == 2
    assert info.counters["seq_truncated_to_capacity"] == 0


def test_sequence_fields_of_unequal_length_or_with_null_events_are_named(tmp_path):
    two = ParquetColumns(sparse=("u",), labels=("y",), sequences=(
        SequenceColumns("s", (("item", "s"), ("gap", "g")), cap=3),))
    seq = [[1, 2]] * 12
    gaps = [[0.5, 0.25]] * 12
    gaps[7] = [0.5]                                           # row 3 of row group 1
    path = _write(tmp_path / "a.parquet", s=pa.array(seq), g=pa.array(gaps))
    with pytest.raises(ValueError, match=r"row group 1: row 3 \(row 7 of the file\): sequence 's': "
                                         r"column 'g' has 1 events, column 's' has 2"):
        ParquetSource(path, two, batch_size=12, order="time").shard_batch(0)
    seq[10] = [1, None]                                       # row 2 of row group 2, event 1
    path = _write(tmp_path / "b.parquet", s=pa.array(seq, pa.list_(pa.int64())))
    with pytest.raises(ValueError, match=r"row group 2: row 2 \(row 10 of the file\): event 1: "
                                         r"column 's' holds a null value"):
        ParquetSource(path, SMALL, batch_size=12, order="time").shard_batch(0)


def test_nan_dense_value_errors_or_is_filled_and_counted(tmp_path):
    x = np.linspace(0, 1, 12)
    x[5] = np.nan
    path = _write(tmp_path / "a.parquet", x=pa.array(list(x[:10]) + [None, 0.5]))
    with pytest.raises(ValueError, match=r"a\.parquet: row group 1: row 1 \(row 5 of the file\): "
                                         r"column 'x' is nan"):
        ParquetSource(path, SMALL, batch_size=12, order="time").shard_batch(0)
    batch, info = ParquetSource(path, SMALL, batch_size=12, order="time", nan="zero").shard_batch(0)
    assert batch.dense[5, 0] == 0 and batch.dense[10, 0] == 0 and batch.dense[11, 0] == 0.5
    assert info.counters["nan_filled"] == 2


def test_labels_null_is_unobserved_and_other_values_error(tmp_path):
    path = _write(tmp_path / "a.parquet", y=pa.array([1.0, None, 0.0, float("nan")] * 3))
    batch, _ = ParquetSource(path, SMALL, batch_size=12, order="time").shard_batch(0)
    np.testing.assert_array_equal(batch.label_mask[:4, 0], [1, 0, 1, 0])
    np.testing.assert_array_equal(batch.labels[:4, 0], [1, 0, 0, 0])
    path = _write(tmp_path / "b.parquet", y=pa.array([1.0, 0.0, 2.0] * 4))
    with pytest.raises(ValueError, match=r"b\.parquet: row group 0: row 2 .*label column 'y' is 2"):
        ParquetSource(path, SMALL, batch_size=12, order="time").shard_batch(0)


# ---- the protocol --------------------------------------------------------------------------------

def test_both_sources_implement_the_protocol_and_their_counters_read_alike(files):
    from gemjax.config import get_config
    synth = SyntheticStream(get_config("tiny").data, 0)
    src = ParquetSource(files, COLS, batch_size=16)
    assert isinstance(synth, Source) and isinstance(src, Source)
    s_info = ShardInfo(np.zeros((2, 1)), 3, 1)
    assert fallback_counters(s_info) == {"seq_truncated_to_cap": 3, "seq_truncated_to_capacity": 1}
    infos = [src.shard_batch(0, i, 2)[1] for i in range(2)]
    merged = merge_infos(infos)                              # the Feeder's regroup path
    assert isinstance(merged, SourceInfo) and isinstance(merged.counters, Counters)
    assert merged.counters == {k: infos[0].counters[k] + infos[1].counters[k] for k in infos[0].counters}
    assert merged.seq_truncated_to_cap == sum(i.seq_truncated_to_cap for i in infos)
    assert sum([Counters(a=1), Counters(a=2, b=1)]) == {"a": 3, "b": 1}


# ---- through the real Trainer ----------------------------------------------------------------------

def test_parquet_rows_of_a_synthetic_batch_train_like_the_synthetic_batch(tmp_path):
    """A synthetic batch written as Parquet rows (the model's feature names as columns) reads
    back as the same Batch, which the Feeder validates and the Trainer steps on."""
    from jax.sharding import Mesh

    from gemjax.config import apply_overrides, get_config
    from gemjax.data.feeding import Feeder
    from gemjax.data.synthetic import SEQUENCE_FIELDS, SEQUENCES, SPARSE_FEATURES
    from gemjax.train.step import Trainer

    cfg = apply_overrides(get_config("tiny"), "data.batch_size=32")
    ref, _ = SyntheticStream(cfg.data, 0).shard_batch(0, 0, 1)
    b = ref.batch_size
    table = {c: ref.sparse[c] for c in SPARSE_FEATURES}
    table.update({f"dense_{k}": ref.dense[:, k] for k in range(ref.dense.shape[1])})
    for s in SEQUENCES:
        off = ref.sequences[s].offsets
        for f in SEQUENCE_FIELDS:
            v = ref.sequences[s].values[f]
            table[f"{s}_{f}"] = pa.array([v[off[i]:off[i + 1]].tolist() for i in range(b)],
                                         pa.list_(pa.int32()))
    for k in range(ref.labels.shape[1]):
        table[f"label_{k}"] = pa.array([float(ref.labels[i, k]) if ref.label_mask[i, k] else None
                                        for i in range(b)], pa.float32())
    table["surface"] = ref.surface
    half = b // 2                                             # two files, two row groups each
    for i, rows in enumerate((slice(0, half), slice(half, b))):
        pq.write_table(pa.table({k: v[rows] for k, v in table.items()}), tmp_path / f"{i}.parquet",
                       row_group_size=half // 2)

    mesh = Mesh(np.array(jax.devices()[:1]), ("batch",))
    trainer = Trainer.create(cfg, mesh)
    vocab = {f: spec.vocab for spec in trainer.coll.specs.values() for f in spec.features}
    cols = ParquetColumns(
        sparse=SPARSE_FEATURES, dense=tuple(f"dense_{k}" for k in range(ref.dense.shape[1])),
        sequences=tuple(SequenceColumns(s, tuple((f, f"{s}_{f}") for f in SEQUENCE_FIELDS),
                                        cap=cfg.data.synthetic.seq_cap) for s in SEQUENCES),
        labels=tuple(f"label_{k}" for k in range(ref.labels.shape[1])), surface="surface",
        vocab=tuple((c, vocab[c]) for c in SPARSE_FEATURES)
        + tuple((f"{s}_{f}", vocab[f"{s}.{f}"]) for s in SEQUENCES for f in SEQUENCE_FIELDS)
        + (("surface", cfg.data.synthetic.num_surfaces),))
    src = ParquetSource(str(tmp_path), cols, batch_size=b, order="time",
                        capacity_tokens={s: cfg.data.sequence_capacity for s in SEQUENCES})
    got, info = src.shard_batch(0, 0, 1)
    want = ref.replace(labels=ref.labels * ref.label_mask)   # unobserved labels read as 0
    for (path, u), v in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        assert u.dtype == v.dtype and u.tobytes() == v.tobytes(), jax.tree_util.keystr(path)
    assert info.counters == dict.fromkeys(info.counters, 0)

    step = trainer.make_train_step()
    losses = []
    for make in (src.shard_batch, lambda *a: (want, None)):
        feeder = Feeder(make, mesh, check_ids=trainer.coll.check_ids, id_fields=trainer.id_fields)
        (_, batch, _, _), = feeder.batches(0, 1)
        _, m = step(trainer.init_state(0), batch)
        losses.append(float(m["loss"]))
    assert np.isfinite(losses[0]) and losses[0] == losses[1]
