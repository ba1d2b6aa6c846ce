"""experiments/convert_movielens_time.py: GroupLens ratings.dat -> one Parquet file sorted
by rating time, label rating >= 4, each row's history the user's earlier ratings; its
rows cut into time windows by gemjax.data.time_windows. Checked against a plain-Python
sort of a small ratings.dat written here."""

import json
import os

import numpy as np
import pyarrow.parquet as pq

from experiments.convert_movielens_time import convert
from gemjax.data.parquet import ParquetSource, columns_from_schema
from gemjax.data.time_windows import TimeWindows
from gemjax.features import FeatureSchema


def test_ratings_dat_becomes_time_ordered_rows(tmp_path):
    rng = np.random.default_rng(0)
    lines = []
    for _ in range(60):
        lines.append((int(rng.integers(1, 6)), int(rng.integers(1, 30)), int(rng.integers(1, 6)),
                      int(rng.integers(1000, 1100))))
    with open(tmp_path / "ratings.dat", "w") as f:
        f.writelines(f"{u}::{i}::{r}::{t}\n" for u, i, r, t in lines)
    counts = convert(str(tmp_path / "out"), ratings=str(tmp_path / "ratings.dat"), max_history=3)
    assert counts["rows"] == 60 and counts["label"] == "rating >= 4"

    # reference: sort by (time, user, position in the user's time-ordered ratings)
    idx = list(range(len(lines)))
    by_user = sorted(idx, key=lambda k: (lines[k][0], lines[k][3], k))
    prev = {}
    hist = {}
    for k in by_user:
        u = lines[k][0]
        hist[k] = prev.get(u, [])[-3:]
        prev[u] = prev.get(u, []) + [lines[k][1]]
    rank = {k: n for n, k in enumerate(by_user)}
    want = sorted(idx, key=lambda k: (lines[k][3], lines[k][0], rank[k]))
    got = pq.read_table(tmp_path / "out" / "train.parquet").to_pylist()
    assert [(r["ts"], r["user"], r["item"], r["label"], r["history_item"]) for r in got] == \
        [(lines[k][3], lines[k][0], lines[k][1], float(lines[k][2] >= 4), hist[k]) for k in want]

    with open(tmp_path / "out" / "schema.json") as f:
        schema = FeatureSchema.from_dict(json.load(f))
    src = ParquetSource(os.path.join(tmp_path, "out"), columns_from_schema(schema), 8, order="time")
    tw = TimeWindows(src, "ts", 25)
    assert sum(tw.describe(w)["rows"] for w in range(tw.num_windows)) == 60
    assert tw.describe(0)["t_start"] == min(t for *_, t in lines)
