"""Online training on a time-ordered Parquet source (gemjax.train.online with
data.source=parquet, gemjax.data.time_windows): windows of a timestamp column,
progressive validation, new-id admission, exact resume after SIGTERM and kill -9 on
real `experiments/online.py` subprocesses, and clear errors for bad time columns.
The data: a tiny stream written here (two files, three row groups, item ids that
appear only in later windows), whose labels follow a planted item and user bias; the
model is the logistic regression (model.kind=lr: the loop is the same for every model,
and it compiles in a second)."""

import json
import os
import signal

import jax
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from jax.sharding import Mesh

from gemjax.config import apply_overrides, get_config
from gemjax.data.parquet import ParquetSource, columns_from_schema
from gemjax.data.time_windows import TimeWindows
from gemjax.features import EventField, FeatureSchema, SequenceFeature, SparseFeature, Table
from gemjax.train.guards import ResumeMismatch
from gemjax.train.online import OnlineSpec, run_online
from test_faults import Run

SCHEMA = FeatureSchema(
    tables=(Table("user", 16), Table("item", 256)),
    sparse=(SparseFeature("user", "user"), SparseFeature("item", "item")),
    sequences=(SequenceFeature("history", (EventField("item", "item"),), max_len=4),),
    tasks=("label",))
WIDTH = 100.0            # seconds per window
ROWS = 150


def write_stream(directory, rows=ROWS, seed=0):
    """Two files of time-ordered rows (times 0..~500 s with a gap, so one time bucket is
    empty); item ids grow with time (later windows bring unseen ids, beyond the item
    table of 48 rows the runs use). Returns the times."""
    rng = np.random.default_rng(seed)
    t = np.sort(rng.integers(0, 500, rows))
    t = np.where((t >= 200) & (t < 300), t + 100, t)        # no row in [200, 300)
    t = np.sort(t)
    t[0] = 0
    user = rng.integers(0, 16, rows)
    item = (t // 4 + rng.integers(0, 8, rows)).astype(np.int64)    # 0 .. ~140
    logit = np.sin(item * 0.7) * 2 + (user % 3 - 1)
    label = (rng.random(rows) < 1 / (1 + np.exp(-logit))).astype(np.float32)
    hist = [list(item[max(0, i - 3):i]) for i in range(rows)]
    table = pa.table({"ts": pa.array(t, pa.int64()), "user": pa.array(user, pa.int32()),
                      "item": pa.array(item, pa.int64()),
                      "history_item": pa.array(hist, pa.list_(pa.int64())),
                      "label": pa.array(label)})
    os.makedirs(directory, exist_ok=True)
    cut = rows // 2
    pq.write_table(table.slice(0, cut), os.path.join(directory, "part-0.parquet"), row_group_size=40)
    pq.write_table(table.slice(cut), os.path.join(directory, "part-1.parquet"), row_group_size=40)
    return t


def config(data_dir, **over):
    o = {"data.source": "parquet", "data.train_path": str(data_dir), "data.eval_path": str(data_dir),
         "data.order": "time", "data.time_column": "ts", "data.window_seconds": str(WIDTH),
         "data.batch_size": "16", "train.warmup_steps": "2", "train.dense_lr": "5e-3",
         "model.kind": "lr"}
    o.update(over)
    import dataclasses
    return apply_overrides(dataclasses.replace(get_config("tiny"), features=SCHEMA), o)


SPEC = OnlineSpec(windows=0, warmup_windows=1, min_count=2, buckets=4, admit_tables=("item",),
                  table_rows=(("item", 48),))


def _rows(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_time_windows_cut_on_the_column(tmp_path):
    t = write_stream(tmp_path / "d")
    src = ParquetSource(str(tmp_path / "d"), columns_from_schema(SCHEMA), 16, order="time")
    tw = TimeWindows(src, "ts", WIDTH)
    # reference: buckets of the sorted times, empty buckets dropped
    k = (t - t[0]) // WIDTH
    want = [int(c) for c in np.unique(k)]
    assert want == [0, 1, 3, 4] and tw.num_windows == 4        # bucket 2 is empty: no window
    for w, kk in enumerate(want):
        d = tw.describe(w)
        assert d["rows"] == int((k == kk).sum())
        assert d["t_start"] == t[0] + kk * WIDTH and d["t_end"] == d["t_start"] + WIDTH
        batches = tw.batches(w, num_shards=2)
        assert len(batches) == -(-d["rows"] // 16)
        got = np.concatenate([i.rows for shards, infos, real in batches for i in infos])
        mask = np.concatenate([s.weights for shards, _, _ in batches for s in shards]) > 0
        first = int(np.flatnonzero(k == kk)[0])
        assert list(got[mask]) == list(range(first, first + d["rows"]))   # every row once, in order
        assert sum(int(r.sum()) for _, _, r in batches) == d["rows"]
        lab = np.concatenate([s.label_mask[:, 0] for shards, _, _ in batches for s in shards])
        assert (lab[~mask] == 0).all()
    assert tw.start_step(tw.num_windows) == sum(-(-tw.describe(w)["rows"] // 16)
                                               for w in range(tw.num_windows))


def test_bad_time_columns_are_refused_naming_file_and_column(tmp_path):
    write_stream(tmp_path / "d")
    cols = columns_from_schema(SCHEMA)
    src = ParquetSource(str(tmp_path / "d"), cols, 16, order="time")
    with pytest.raises(ValueError, match=r"part-0.parquet: the time column 'when' .* is missing"):
        TimeWindows(src, "when", WIDTH)
    # a row earlier than the one before it
    path = str(tmp_path / "d" / "part-1.parquet")
    table = pq.read_table(path)
    ts = table.column("ts").to_numpy().copy()
    ts[5] = ts[4] - 1
    pq.write_table(table.set_column(0, "ts", pa.array(ts)), path)
    with pytest.raises(ValueError, match=r"part-1.parquet: row 5: the time column 'ts' .* goes back"):
        TimeWindows(ParquetSource(str(tmp_path / "d"), cols, 16, order="time"), "ts", WIDTH)
    # file 1 starting before file 0 ends
    ts = table.column("ts").to_numpy().copy()
    ts[:] = 0
    pq.write_table(table.set_column(0, "ts", pa.array(ts)), path)
    with pytest.raises(ValueError, match=r"part-1.parquet: row 0: .* goes back: 0 after .*part-0"):
        TimeWindows(ParquetSource(str(tmp_path / "d"), cols, 16, order="time"), "ts", WIDTH)
    # a null time
    ts = pa.array([None] + list(table.column("ts").to_numpy()[1:]), pa.int64())
    pq.write_table(table.set_column(0, "ts", ts), path)
    with pytest.raises(ValueError, match=r"part-1.parquet: row 0: the time column 'ts' .* null"):
        TimeWindows(ParquetSource(str(tmp_path / "d"), cols, 16, order="time"), "ts", WIDTH)
    # through the online run: the field named, and data.order checked
    with pytest.raises(ValueError, match=r"data.train_path=.*null"):
        run_online(config(tmp_path / "d"), str(tmp_path / "w"), SPEC, log=lambda s: None)
    with pytest.raises(ValueError, match="data.order=time"):
        run_online(config(tmp_path / "d", **{"data.order": "shuffle"}), str(tmp_path / "w"), SPEC,
                   log=lambda s: None)


def _parquet_args(data_dir):
    o = config(data_dir)
    over = ",".join(f"{k}={v}" for k, v in {
        "data.source": "parquet", "data.train_path": o.data.train_path, "data.eval_path": o.data.eval_path,
        "data.order": "time", "data.time_column": "ts", "data.window_seconds": WIDTH,
        "data.batch_size": 16, "train.warmup_steps": 2, "train.dense_lr": 5e-3,
        "model.kind": "lr"}.items())
    return ["--config=tiny", f"--features={data_dir}/../schema.json", f"--override={over}",
            "--models=teacher", "--admit_tables=item", "--admit_rows=48", "--min_count=2",
            "--buckets=4"]


def test_sigterm_and_kill9_resume_equal_an_uninterrupted_run(tmp_path):
    data = tmp_path / "d"
    t = write_stream(data)
    with open(tmp_path / "schema.json", "w") as f:
        json.dump(SCHEMA.to_dict(), f)
    mesh = Mesh(np.array(jax.devices()[:1]), ("batch",))
    ref = run_online(config(data), str(tmp_path / "ref"), SPEC, mesh=mesh, log=lambda s: None)
    # progressive validation scores each window before training on it: the frozen
    # model's NE on window 3, recomputed outside the online loop
    assert ref["rows"][3]["ne_frozen"] == pytest.approx(
        _frozen_ne_by_hand(data, t, str(tmp_path / "ref"), mesh, 3), rel=1e-5)

    args, dir_ = _parquet_args(data), tmp_path / "run"
    run_dir = str(dir_ / "teacher")
    run = Run(str(dir_), args=args, module="experiments.online")       # SIGTERM: stops after a window
    run.wait_for("[online] window 0:")
    run.proc.send_signal(signal.SIGTERM)
    assert run.finish() == 128 + signal.SIGTERM, run.out[-3000:]
    assert "stopped by SIGTERM after window" in run.out
    stopped_at = max(r["window"] for r in _rows(run_dir))
    assert stopped_at < 3

    run = Run(str(dir_), args=args, module="experiments.online")       # kill -9 in the next window
    run.wait_for(f"resumed at window {stopped_at + 1}")
    run.proc.kill()
    assert run.finish() == -signal.SIGKILL

    run = Run(str(dir_), args=args, module="experiments.online")       # resume to the end
    assert run.finish() == 0, run.out[-3000:]

    assert _rows(run_dir) == _rows(str(tmp_path / "ref"))
    with open(os.path.join(run_dir, "summary.json")) as f:
        got = json.load(f)
    assert got["digests"] == ref["digests"] and got["admission"] == ref["admission"]

    rows = ref["rows"]
    assert [r["window"] for r in rows] == [0, 1, 2, 3]
    assert [round((r["t_start"] - rows[0]["t_start"]) / WIDTH) for r in rows] == [0, 1, 3, 4]
    assert sum(r["rows"] for r in rows) == ROWS
    # progressive validation: window 1 scores the frozen copy and the fresh model on the
    # same state (taken at the end of window 0), before either trains on it
    assert rows[0]["ne_frozen"] is None and rows[1]["ne_frozen"] == rows[1]["ne_fresh"]
    assert rows[1]["auc_frozen"] == rows[1]["auc_fresh"]
    assert rows[2]["ne_frozen"] != rows[2]["ne_fresh"]
    assert all(0 <= r["auc_fresh"] <= 1 for r in rows)
    # new item ids every window, admitted after 2 sightings, the rest on 4 shared rows
    assert all(r["item_new_ids"] > 0 for r in rows)
    adm = ref["admission"]["item"]
    assert adm["admitted"] > 0 and adm["hashed"] > 0
    # the table of the experiment (fresh vs frozen per window)
    with open(dir_ / "online_table.json") as f:
        table = json.load(f)
    assert [r["window"] for r in table["rows"]] == [0, 1, 2, 3]
    assert table["rows"][2]["teacher"]["ne_fresh"] == rows[2]["ne_fresh"]
    assert "| window |" in (dir_ / "online_table.md").read_text()

    # a resume on rows that make other windows is refused, naming them
    write_stream(data, rows=ROWS - 20)
    with pytest.raises(ResumeMismatch, match="stream: checkpoint"):
        run_online(config(data), str(tmp_path / "ref"), SPEC, mesh=mesh, log=lambda s: None)


def _frozen_ne_by_hand(data, t, workdir, mesh, w):
    """NE of the frozen model on window w, from the newest checkpoint of `workdir`: its
    frozen state and id map are those of the end of window 0, so this is window w's rows
    read straight from the files (pyarrow), ids mapped by that id map, scored in batches
    of 16 and the log loss normalised by hand."""
    from gemjax.data.batch import Batch
    from gemjax.data.jagged import layout_from_lengths, Jagged
    from gemjax.train.online import OnlineRun

    run = OnlineRun(config(data), workdir, SPEC, lambda s: None, mesh)
    try:
        run.restore()
        m = run.members["frozen"]
        adm = m.admission["item"]
        table = pq.read_table(str(data))
        k = (t - t[0]) // WIDTH
        sel = np.flatnonzero(k == sorted(set(k.tolist()))[w])
        col = {c: table.column(c).to_numpy() for c in ("user", "item", "label")}
        hist = table.column("history_item").to_pylist()
        cap = run.stream.source.sequence_capacity(1)["history"]
        probs, labels = [], []
        for j in range(0, len(sel), 16):
            rows = sel[j:j + 16]
            n = len(rows)
            pad = np.r_[rows, np.full(16 - n, rows[-1])]
            lens = np.array([len(hist[r]) for r in pad])
            offsets, seg, pos = layout_from_lengths(lens, cap)
            vals = np.zeros(cap, np.int32)
            flat = np.array([i for r in pad for i in hist[r]], np.int64)
            vals[:len(flat)] = adm.lookup(flat, count=False)[0]
            batch = Batch(sparse={"user": col["user"][pad].astype(np.int32),
                                  "item": adm.lookup(col["item"][pad], count=False)[0]},
                          dense=np.zeros((16, 0), np.float32),
                          sequences={"history": Jagged({"item": vals}, offsets, seg, pos)},
                          labels=col["label"][pad, None].astype(np.float32),
                          label_mask=np.ones((16, 1), np.float32), surface=np.zeros(16, np.int32),
                          weights=np.ones(16, np.float32))
            p = np.asarray(m.eval_step(m.state, run.feeder.to_device(batch)))[:n, 0]
            probs.append(p)
            labels.append(col["label"][rows])
    finally:
        run.close()
    p, y = np.concatenate(probs).astype(np.float64), np.concatenate(labels).astype(np.float64)
    ll = -np.mean(y * np.log(p) + (1 - y) * np.log(1 - p))
    base = y.mean()
    return ll / -(base * np.log(base) + (1 - base) * np.log(1 - base))
