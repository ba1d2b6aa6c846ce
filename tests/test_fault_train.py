"""Faults in a training workdir between two runs: Parquet train files added, removed or
rewritten before a resume, and a torn last row of metrics.jsonl.

One small Parquet run (train() in this process, one device) is stopped at step 2 and
resumed; the references are the files and rows as they stood before the fault.
"""

import dataclasses
import json
import os

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from gemjax.config import apply_overrides, get_config
from gemjax.data.files import file_changes, file_facts
from gemjax.train.guards import ResumeMismatch
from gemjax.train.loop import train
from gemjax.train.tracking import read_metrics


def _mesh():
    return Mesh(np.array(jax.devices()[:1]), ("batch",))


def _cfg(data, extra=""):
    from test_own_data import SCHEMA
    over = (f"data.source=parquet,data.train_path={data}/train,data.eval_path={data}/eval.parquet,"
            "data.batch_size=32,data.eval_batches=1,train.log_every=2,train.eval_every=4,"
            "train.checkpoint_every=2,train.tensorboard=false,train.steps=4" + extra)
    return apply_overrides(dataclasses.replace(get_config("tiny"), features=SCHEMA), over)


def _rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_changed_train_files_are_refused_or_accepted_and_a_torn_metrics_row_is_dropped(tmp_path):
    from test_own_data import _write_log
    data = tmp_path / "data"
    (data / "train").mkdir(parents=True)
    _write_log(data / "train" / "a.parquet", 100, 0)
    _write_log(data / "eval.parquet", 32, 1)
    workdir = str(tmp_path / "run")
    assert train(_cfg(data), workdir, log=lambda s: None, mesh=_mesh(), stop_after=2)["steps"] == 2
    record = json.load(open(os.path.join(workdir, "train_files.json")))
    assert [(os.path.basename(f["path"]), f["rows"]) for f in record["files"]] == [("a.parquet", 100)]

    metrics = os.path.join(workdir, "metrics.jsonl")
    before = _rows(metrics)
    assert [(r["step"], r["kind"]) for r in before] == [(2, "train"), (2, "eval")]
    with open(metrics, "a") as f:                 # a crash mid-append: a partial row
        f.write('{"step": 4, "kind": "train", "loss": 0.6')

    # a file added, one rewritten: refused, each named, nothing changed
    _write_log(data / "train" / "b.parquet", 50, 2)
    with pytest.raises(ResumeMismatch, match=r"differ from those the run started with .*"
                                             r"train_files.json\): added .*/train/b.parquet "
                                             r"\(50 rows\).*data.accept_changed_files=true"):
        train(_cfg(data), workdir, log=lambda s: None, mesh=_mesh())
    assert json.load(open(os.path.join(workdir, "train_files.json"))) == record

    # accepted explicitly: logged, recorded; the torn row dropped and counted
    logged = []
    train(_cfg(data, ",data.accept_changed_files=true"), workdir, log=logged.append, mesh=_mesh())
    text = "\n".join(logged)
    assert "added" in text and "b.parquet" in text and "accepted (data.accept_changed_files)" in text
    assert "metrics.jsonl line 3 is a torn row" in text
    now = json.load(open(os.path.join(workdir, "train_files.json")))
    assert len(now["files"]) == 2 and "b.parquet" in now["accepted"][0]["changes"][0]
    after = _rows(metrics)                        # every line whole JSON now
    assert after[:2] == before
    trains = [r for r in after if r["kind"] == "train"]
    assert [r["step"] for r in trains] == [2, 4] and trains[-1]["metrics_lines_torn"] == 1


def test_file_changes_name_each_file(tmp_path):
    from test_own_data import _write_log
    for name, n in (("a", 50), ("b", 25), ("c", 25)):
        _write_log(tmp_path / f"{name}.parquet", n, 0)
    before = file_facts(str(tmp_path))
    assert file_changes(before, file_facts(str(tmp_path))) == []
    os.utime(tmp_path / "a.parquet", ns=(1, 1))              # a touch is no change
    os.remove(tmp_path / "b.parquet")
    _write_log(tmp_path / "c.parquet", 75, 0)
    _write_log(tmp_path / "d.parquet", 25, 0)
    got = file_changes(before, file_facts(str(tmp_path)))
    assert [line.split(" ")[0] + " " + os.path.basename(line.split(" ")[1]) for line in got] == \
        ["added d.parquet", "removed b.parquet", "changed c.parquet"]
    assert "(25 rows," in got[2] and "-> 75 rows" in got[2]


def test_metrics_rows_torn_only_at_the_end(tmp_path):
    path = str(tmp_path / "metrics.jsonl")
    rows = [{"step": 2, "kind": "train"}, {"step": 4, "kind": "eval"}]
    whole = "".join(json.dumps(r) + "\n" for r in rows)
    for tail in ('{"step": 6, "ki', "\x00\x00\x00", '{"step": 6}\n{"st', '[1, 2'):
        open(path, "w").write(whole + tail)
        logged = []
        got, torn = read_metrics(path, logged.append)
        keep = [{"step": 6}] if tail.startswith('{"step": 6}\n') else []
        assert (got, torn) == (rows + keep, 1) and "torn row" in logged[0], tail
    open(path, "w").write(whole)
    assert read_metrics(path) == (rows, 0)
    open(path, "w").write(json.dumps(rows[0]) + "\n{garbage\n" + json.dumps(rows[1]) + "\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl line 2 is not a metrics row"):
        read_metrics(path)
    assert read_metrics(str(tmp_path / "none.jsonl")) == ([], 0)


def test_huge_finite_dense_values_are_named_or_clamped(tmp_path):
    """A finite 1e30 in a dense column (a float32 that overflows the model to NaN) is
    refused naming file, row and column, or clamped and counted (data.dense_max_abs)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from test_own_data import SCHEMA, _write_log
    from gemjax.data.parquet import ParquetSource, columns_from_schema
    path = tmp_path / "t.parquet"
    _write_log(path, 50, 0)
    table = pq.read_table(path)
    price = table.column("price").to_numpy().copy()
    price[30] = 1e30
    price[31] = -5e3
    pq.write_table(table.set_column(table.schema.get_field_index("price"), "price",
                                    pa.array(price)), path, row_group_size=25)
    cols = columns_from_schema(SCHEMA)
    kw = dict(batch_size=50, order="time")
    batch, _ = ParquetSource(str(path), cols, **kw).shard_batch(0)      # no bound: as read
    assert batch.dense[30, 0] == np.float32(1e30)
    with pytest.raises(ValueError, match=r"t.parquet: row group 1: row 5 \(row 30 of the file\): "
                                         r"column 'price' is 1e\+30, beyond the bound 1000 "
                                         r"\(data.dense_max_abs\)"):
        ParquetSource(str(path), cols, dense_max_abs=1e3, **kw).shard_batch(0)
    batch, info = ParquetSource(str(path), cols, dense_max_abs=1e3, nan="zero", **kw).shard_batch(0)
    want = np.clip(price, -1e3, 1e3)
    np.testing.assert_array_equal(batch.dense[:, 0], want)
    assert info.counters["dense_clamped"] == 2
