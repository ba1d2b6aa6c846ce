"""MovieLens-1M -> one time-ordered Parquet file for online training (experiments/online.py).

    python -m experiments.convert_movielens_time --out=/tmp/gemjax-data/ml-1m-time \\
        [--data_dir=DIR] [--ratings=DIR/ratings.dat] [--negatives=1] [--max_history=20] \\
        [--max_rows=0] [--seed=0]

Writes --out/train.parquet (rows sorted by the time column `ts`), schema.json
(gemjax.features.FeatureSchema of the rows) and counts.json (rows, positives, users,
items, the label rule and the clock). One row per rating (or sampled negative):

  ts              int64   the event's time (below)
  user, item      int32   raw MovieLens ids (users 1..6040, items 1..3952)
  history_item    list<int32>  the user's --max_history previous items, oldest first
  label           float32 0/1

Two inputs:
  --ratings=PATH  GroupLens' ratings.dat (`UserID::MovieID::Rating::Timestamp`): ts is
                  the rating's Unix time in seconds, label = rating >= 4 (the usual
                  binary label of explicit 1-5 star ratings); rows sorted by (ts, user,
                  the user's rating order), history = the items the user rated before.
  default         the implicit copy read by gemjax.data.movielens.load_movielens
                  (--data_dir, default ../shared/datasets/ml-1m): every line a rating
                  without its stars or time, each user's lines in time order. Its clock
                  is the event index: users in increasing id order, each user's ratings
                  in their recorded order, ts = 0, 1, 2, ... (one unit per rating; a
                  window of data.window_seconds=W holds W ratings: arrival of users, not
                  calendar time). Every rating is a positive (label 1), followed by
                  --negatives items drawn uniformly (numpy Generator seeded by --seed)
                  from the items that occur minus every item the user rated (label 0,
                  same ts and history).

--max_rows keeps the first N rows in time order (0: all): a short stream for a CPU run.
Row groups of 16,384 rows. The file stays outside any git work tree (the licence forbids
redistribution).
"""

from __future__ import annotations

import json
import os

import numpy as np
from absl import app, flags

ROW_GROUP = 16_384
USER_ROWS, ITEM_ROWS = 8_192, 4_096          # raw id ranges of the schema's tables (headroom)


def schema(max_history: int):
    """user and item ids (raw), the history of items, one task "label"."""
    from gemjax.features import EventField, FeatureSchema, SequenceFeature, SparseFeature, Table
    return FeatureSchema(
        tables=(Table("user", USER_ROWS), Table("item", ITEM_ROWS)),
        sparse=(SparseFeature("user", "user"), SparseFeature("item", "item")),
        sequences=(SequenceFeature("history", (EventField("item", "item"),), max_len=max_history),),
        tasks=("label",))


def history_lists(seq: np.ndarray, start: np.ndarray, pos: np.ndarray, max_history: int):
    """(offsets [P + 1], values) of seq[max(start_p, pos_p - H):pos_p] per target position
    pos_p (a global index into seq) of the user whose sequence starts at start_p."""
    first = np.maximum(start, pos - max_history)
    n = pos - first
    offsets = np.zeros(len(pos) + 1, np.int64)
    np.cumsum(n, out=offsets[1:])
    ramp = np.arange(int(offsets[-1]), dtype=np.int64) - np.repeat(offsets[:-1], n)
    return offsets, seq[np.repeat(first, n) + ramp]


def from_ratings(path: str, max_history: int):
    """ratings.dat -> columns in time order (module docstring)."""
    from gemjax.data.movielens_raw import read_ratings
    user, item, time, rating = read_ratings(path, "::", header=False, with_rating=True)
    if not np.isfinite(rating).all():
        i = int(np.argmax(~np.isfinite(rating)))
        raise ValueError(f"movielens: {path}:{i + 1}: the rating is missing")
    by_user = np.lexsort((np.arange(len(user)), time, user))       # user, time, file order
    u = user[by_user]
    start_of = np.searchsorted(u, u, side="left")
    offsets, values = history_lists(item[by_user], start_of, np.arange(len(u)), max_history)
    order = np.lexsort((np.arange(len(u)), u, time[by_user]))      # time, user, rating order
    lens = np.diff(offsets)[order]
    off = np.zeros(len(order) + 1, np.int64)
    np.cumsum(lens, out=off[1:])
    ramp = np.arange(int(off[-1]), dtype=np.int64) - np.repeat(off[:-1], lens)
    vals = values[np.repeat(offsets[:-1][order], lens) + ramp]
    rows = by_user[order]
    return {"ts": time[rows], "user": user[rows], "item": item[rows],
            "label": (rating[rows] >= 4).astype(np.float32)}, off, vals, {
        "label": "rating >= 4", "clock": "ratings.dat timestamps (Unix seconds)", "source": path}


def from_implicit(data_dir: str | None, negatives: int, max_history: int, seed: int,
                  max_rows: int):
    """The implicit copy -> columns in event order, negatives after their positive."""
    from experiments.convert_movielens import Interactions
    from gemjax.data.movielens import DEFAULT_DIR, load_movielens
    data_dir = data_dir or DEFAULT_DIR
    ml = load_movielens(data_dir)
    inter = Interactions(ml)
    n = len(inter.seq)
    if max_rows:
        n = min(n, -(-max_rows // (1 + negatives)))
    pos = np.arange(n, dtype=np.int64)
    users = inter.user_of(pos)
    offsets, values = history_lists(inter.seq, inter.start[users], pos, max_history)
    k = 1 + negatives
    items = np.empty((n, k), np.int64)
    items[:, 0] = inter.seq[:n]
    items[:, 1:] = inter.sample_negatives(users, negatives, np.random.default_rng([seed, 7]))
    label = np.zeros((n, k), np.float32)
    label[:, 0] = 1
    lens = np.repeat(np.diff(offsets), k)
    off = np.zeros(n * k + 1, np.int64)
    np.cumsum(lens, out=off[1:])
    src = np.repeat(np.repeat(offsets[:-1], k), lens) + (
        np.arange(int(off[-1]), dtype=np.int64) - np.repeat(off[:-1], lens))
    raw_users = users + 1 if ml.user_ids is None else np.asarray(ml.user_ids, np.int64)[users]
    item_ids = None if ml.item_ids is None else np.asarray(ml.item_ids, np.int64)

    def to_raw(rows):
        return rows if item_ids is None else item_ids[rows]

    cols = {"ts": np.repeat(pos, k), "user": np.repeat(raw_users, k),
            "item": to_raw(items.ravel()), "label": label.ravel()}
    return cols, off, to_raw(values[src]), {
        "label": f"1 for every rating, 0 for {negatives} sampled unrated item(s) per rating",
        "clock": "event index (users in increasing id order, each user's ratings in recorded "
                 "order); no calendar time in this copy", "source": data_dir}


def write(out: str, cols: dict, offsets: np.ndarray, values: np.ndarray, facts: dict,
          max_history: int, max_rows: int) -> dict:
    """train.parquet, schema.json and counts.json under `out`; returns the counts."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    n = len(cols["ts"]) if not max_rows else min(max_rows, len(cols["ts"]))
    offsets = offsets[:n + 1]
    hist = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)),
                                    pa.array(values[:int(offsets[-1])].astype(np.int32)))
    table = pa.table({"ts": pa.array(cols["ts"][:n].astype(np.int64)),
                      "user": pa.array(cols["user"][:n].astype(np.int32)),
                      "item": pa.array(cols["item"][:n].astype(np.int32)),
                      "history_item": hist, "label": pa.array(cols["label"][:n])})
    for c in ("user", "item"):
        hi = {"user": USER_ROWS, "item": ITEM_ROWS}[c]
        if int(cols[c][:n].max()) >= hi:
            raise ValueError(f"movielens: {c} id {int(cols[c][:n].max())} beyond the schema's "
                             f"{hi} rows")
    os.makedirs(out, exist_ok=True)
    tmp = os.path.join(out, "train.parquet.tmp")
    pq.write_table(table, tmp, row_group_size=ROW_GROUP)
    os.replace(tmp, os.path.join(out, "train.parquet"))
    with open(os.path.join(out, "schema.json"), "w") as f:
        json.dump(schema(max_history).to_dict(), f, indent=1)
    counts = {"rows": n, "positives": int(cols["label"][:n].sum()),
              "users": int(len(np.unique(cols["user"][:n]))),
              "items": int(len(np.unique(cols["item"][:n]))),
              "ts_first": int(cols["ts"][0]), "ts_last": int(cols["ts"][n - 1]), **facts}
    with open(os.path.join(out, "counts.json"), "w") as f:
        json.dump(counts, f, indent=1)
    return counts


def convert(out: str, data_dir: str | None = None, ratings: str = "", negatives: int = 1,
            max_history: int = 20, max_rows: int = 0, seed: int = 0) -> dict:
    """Write --out (module docstring); returns counts.json's dict."""
    if negatives < 0 or max_history < 1 or max_rows < 0:
        raise ValueError(f"need negatives >= 0, max_history >= 1, max_rows >= 0; got "
                         f"{negatives}, {max_history}, {max_rows}")
    if ratings:
        cols, off, vals, facts = from_ratings(ratings, max_history)
    else:
        cols, off, vals, facts = from_implicit(data_dir, negatives, max_history, seed, max_rows)
    return write(out, cols, off, vals, {**facts, "max_rows": max_rows}, max_history, max_rows)


def main(argv) -> None:
    del argv
    f = flags.FLAGS
    counts = convert(f.out, f.data_dir, f.ratings, f.negatives, f.max_history, f.max_rows, f.seed)
    print(json.dumps(counts, indent=1))


if __name__ == "__main__":
    flags.DEFINE_string("out", "/tmp/gemjax-data/ml-1m-time", "output directory (outside any "
                        "git work tree)")
    flags.DEFINE_string("data_dir", None, "implicit ml-1m copy (default ../shared/datasets/ml-1m)")
    flags.DEFINE_string("ratings", "", "GroupLens ratings.dat: real timestamps, label rating >= 4")
    flags.DEFINE_integer("negatives", 1, "implicit copy: sampled unrated items per rating")
    flags.DEFINE_integer("max_history", 20, "previous items of the user in each row")
    flags.DEFINE_integer("max_rows", 0, "keep the first N rows in time order (0: all)")
    flags.DEFINE_integer("seed", 0, "seed of the sampled negatives")
    app.run(main)
