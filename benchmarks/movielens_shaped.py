"""A MovieLens-SHAPED ranking dataset: the layout of experiments/convert_movielens.py's
ranking output, with random ids, for machines that do not hold MovieLens-1M.

    python -m benchmarks.movielens_shaped --out=/tmp/gemjax-data/ml-shaped [--users=6040]

Writes --out/train.parquet, test.parquet, schema.json and counts.json, shaped like

    python -m experiments.convert_movielens --tasks=ranking --train_positions=5 --max_history=50

(docs/results.md's `movielens_rank` recipe): the same columns and types (user, gender, age,
occupation, history_item, history_genre [list<int32>], item, genre [int32], label
[float32]), the same schema.json (convert_movielens.movielens_schema with the vocabulary
sizes below), the same row order and row groups (by user, then position, the positive
before its 4 negatives; row groups of about 65,536 rows cut between users; zstd), and
the same history lengths:

  train  per user 5 consecutive target positions t0 .. t0 + 4, each a row of the positive
         and 4 negatives sharing one history, the newest min(t, 50) events before t;
         so per row the length is min(t0 + j, 50), j = 0..4
  test   per user one position t0 + 5 (5 rows)

with t0 per user drawn from FIRST_POSITION_USERS. Ids are random: each user has a random
item sequence (items 1..3952 uniform; consecutive positions see the same sliding
window, as in the real file), a random gender / age / occupation; each item a fixed
random genre (history_genre is the genre of each history_item); negatives are uniform
items. With --users=6040 the lengths are exactly the real file's (the t0 histogram is
permuted over the users); another count draws t0 from it.
"""

from __future__ import annotations

import os
import time

import numpy as np
from absl import app, flags

# Measured on the real converted data (convert_movielens.py --tasks=ranking
# --train_positions=5 --max_history=50 on MovieLens-1M, train.parquet: 151,000 rows,
# history length mean 43.73, median 50): the vocabulary sizes of its schema.json, and
# the history length of each user's first target position (rows 25u .. 25u + 4),
# {length: users}; the user's next 4 positions are each one event longer, capped at 50.
USERS = 6_040
USER_VOCAB = {"gender": 2, "age": 7, "occupation": 21}
ITEM_ROWS = 3_953                 # items 1..3952; row 0 is padding
GENRES = 18
MAX_HISTORY = 50
POSITIONS = 5                     # --train_positions
CANDIDATES = 5                    # the positive + --negatives=4
ROW_GROUP_ROWS = 65_536
FIRST_POSITION_USERS = {
    14: 86, 15: 91, 16: 77, 17: 81, 18: 81, 19: 75, 20: 62, 21: 66, 22: 60, 23: 72, 24: 58,
    25: 51, 26: 55, 27: 62, 28: 44, 29: 58, 30: 71, 31: 55, 32: 49, 33: 49, 34: 48, 35: 48,
    36: 35, 37: 48, 38: 40, 39: 40, 40: 46, 41: 55, 42: 51, 43: 29, 44: 50, 45: 42, 46: 39,
    47: 35, 48: 30, 49: 38, 50: 4_063}


def schema():
    """convert_movielens.movielens_schema at MovieLens-1M's sizes."""
    from experiments import convert_movielens   # defines no flags at import
    return convert_movielens.movielens_schema(USERS, USER_VOCAB, ITEM_ROWS, GENRES, MAX_HISTORY)


def first_positions(users: int, rng: np.random.Generator) -> np.ndarray:
    """[users] int64 t0: the real histogram permuted (users == USERS) or drawn from."""
    lengths = np.array(list(FIRST_POSITION_USERS), np.int64)
    counts = np.array(list(FIRST_POSITION_USERS.values()), np.int64)
    if users == counts.sum():
        return rng.permutation(np.repeat(lengths, counts))
    return rng.choice(lengths, size=users, p=counts / counts.sum())


def _lists(tail: np.ndarray, lo: np.ndarray, hi: np.ndarray):
    """Per row r the list tail[u_r, lo_r:hi_r] flattened: (offsets [R + 1] int32, values);
    `tail` [U, W], lo / hi [U, R / U] (every user the same number of rows)."""
    users, per = lo.shape
    lengths = (hi - lo).reshape(-1)
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    row = np.repeat(np.arange(len(lengths)), lengths)
    col = np.arange(offsets[-1]) - offsets[row] + lo.reshape(-1)[row]
    return offsets.astype(np.int32), tail[row // per, col]


def tables(users: int, seed: int = 0):
    """(train table, test table) of the shaped dataset, pyarrow Tables."""
    import pyarrow as pa
    rng = np.random.default_rng(seed)
    t0 = first_positions(users, rng)
    # tail[u, k]: event t0 - MAX_HISTORY + k of user u (k = 0 .. MAX_HISTORY + POSITIONS),
    # the events the histories and positives read; those before event 0 are never read
    width = MAX_HISTORY + POSITIONS + 1
    tail = rng.integers(1, ITEM_ROWS, (users, width), dtype=np.int32)
    genre_of = rng.integers(0, GENRES, ITEM_ROWS, dtype=np.int32)
    feats = {"user": np.arange(users, dtype=np.int32),
             **{n: rng.integers(0, v, users, dtype=np.int32) for n, v in USER_VOCAB.items()}}
    out = []
    for js in (np.arange(POSITIONS), np.array([POSITIONS])):
        t = t0[:, None] + js[None, :]                           # [U, P] absolute positions
        lo = np.maximum(t - MAX_HISTORY, 0) - (t0[:, None] - MAX_HISTORY)
        hi = t - (t0[:, None] - MAX_HISTORY)                    # relative: MAX_HISTORY + j
        rep = lambda a: np.repeat(a, CANDIDATES, axis=1)        # noqa: E731  one per candidate
        offsets, items = _lists(tail, rep(lo), rep(hi))
        positive = np.take_along_axis(tail, hi, axis=1)         # [U, P] the target event
        cand = rng.integers(1, ITEM_ROWS, (users, len(js), CANDIDATES), dtype=np.int32)
        cand[:, :, 0] = positive
        label = np.zeros(cand.shape, np.float32)
        label[:, :, 0] = 1.0
        n = users * len(js) * CANDIDATES
        cols = {k: pa.array(np.repeat(v, len(js) * CANDIDATES)) for k, v in feats.items()}
        cols["history_item"] = pa.ListArray.from_arrays(pa.array(offsets), pa.array(items))
        cols["history_genre"] = pa.ListArray.from_arrays(pa.array(offsets), pa.array(genre_of[items]))
        cols["item"] = pa.array(cand.reshape(n))
        cols["genre"] = pa.array(genre_of[cand.reshape(n)])
        cols["label"] = pa.array(label.reshape(n))
        out.append(pa.table(cols))
    return out[0], out[1]


def _row_groups(table, rows_per_user: int):
    """Slices of about ROW_GROUP_ROWS rows cut between users (convert_movielens's cuts)."""
    total = table.num_rows
    users = total // rows_per_user
    before = np.arange(users + 1) * rows_per_user
    cuts = np.unique(np.searchsorted(before, np.arange(0, total, ROW_GROUP_ROWS)))
    bounds = np.append(cuts, users) * rows_per_user
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        if hi > lo:
            yield table.slice(lo, hi - lo)


def write(out: str, users: int = USERS, seed: int = 0) -> dict:
    """Write out/{train,test}.parquet, schema.json, counts.json; returns the counts."""
    from gemjax.data.parquet_writer import check_out_dir, write_json, write_split
    if users < 1:
        raise ValueError(f"--users must be >= 1, got {users}")
    out = check_out_dir(out)
    t = time.time()
    train, test = tables(users, seed)
    counts = {"dataset": "movielens-shaped (random ids)", "users": users, "seed": seed,
              "splits": {}}
    for name, table, per in (("train", train, POSITIONS * CANDIDATES), ("test", test, CANDIDATES)):
        written = write_split(os.path.join(out, f"{name}.parquet"), _row_groups(table, per))
        lengths = np.diff(table.column("history_item").combine_chunks().offsets.to_numpy())
        counts["splits"][name] = {**written, "history_mean": float(lengths.mean()),
                                  "history_median": float(np.median(lengths))}
    write_json(os.path.join(out, "schema.json"), schema().to_dict())
    counts["seconds"] = time.time() - t
    write_json(os.path.join(out, "counts.json"), counts)
    return counts


def define_flags():
    """The command line's flags (defined when run as a script)."""
    flags.DEFINE_string("out", None, "output directory (outside any git work tree)")
    flags.DEFINE_integer("users", USERS, "users (25 train rows and 5 test rows each)")
    flags.DEFINE_integer("seed", 0, "seed of the random ids and lengths")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    f = flags.FLAGS
    if not f.out:
        raise app.UsageError("--out is required (a directory outside the repository)")
    counts = write(f.out, f.users, f.seed)
    for split, c in counts["splits"].items():
        print(f"{split:5s} {c['rows']:8d} rows  history mean {c['history_mean']:.2f} median "
              f"{c['history_median']:.0f}  {c['bytes'] / 2**20:.2f} MiB")
    print(f"wrote {f.out} in {counts['seconds']:.1f} s")


if __name__ == "__main__":
    define_flags()
    app.run(main)
