"""MovieLens-1M -> Parquet ranking and retrieval datasets + schema.json for ParquetSource.

    python -m experiments.convert_movielens --out=/tmp/gemjax-data/ml-1m \\
        [--tasks=ranking,retrieval] [--negatives=4] [--max_history=200] [--seed=0] [--novalid]

Reads ../shared/datasets/ml-1m (or --data_dir) in place through
gemjax.data.movielens.load_movielens (each user's train items in time order, the
leave-last-out test item). Writes --out/ranking/ and --out/retrieval/ (outside any git
work tree: the licence forbids redistribution), each with train.parquet, test.parquet
and valid.parquet (the command line's default; --novalid leaves it out, as
convert(valid=False) does), schema.json (gemjax.features.FeatureSchema;
gemjax.data.parquet.columns_from_schema maps it to ParquetColumns) and counts.json.

A sample (one row) is a target position t of a user's sequence S = (train items in
time order, then the test item):
  user, gender, age, occupation   int32 user-side ids (user: the loader's user index,
                                  0..U-1 in uid order; the others: rank of the raw
                                  feature id among those present)
  history_item, history_genre     list<int32>: S[max(0, t - max_history):t], oldest
                                  first (the newest --max_history events before t)
  item, genre                     int32 candidate item (the loader's item row, 1..3952;
                                  0 is padding) and its genre (rank among genres present)
  label                           float32 0/1
Items of the history and the candidate read one table "item", genres one table
"genre" (shared tables).

Positions (L = the user's train items):
  train   t = 1..L-1 (the last --train_positions of them when > 0); with --valid
          t = 1..L-2 (gemjax.data.movielens.leave_last_out's "train"; else "train_full")
  valid   (--valid, the default) t = L - 1, the last train item: the validation rows the
          movielens presets select their step on (data.valid_path=valid.parquet)
  test    t = L, the leave-last-out test item after the whole train history

ranking     per position the true item (label 1), then --negatives sampled items
            (label 0), each drawn uniformly, with replacement, from the items that
            occur in the data minus every item the user ever rated (train and test):
            never the positive, never in the user's history. With
            --resample_negatives, train.parquet holds the positives only and
            ranking/negatives.npz the sampler (gemjax.data.negatives: the items that
            occur with their genre, each user's rated items) that draws the train
            negatives afresh every epoch (data.negatives=N); valid and test keep their
            fixed, seeded negatives.
retrieval   the true item only (label 1; a sampled-softmax or in-batch-negatives head
            draws its own negatives over the item table).

Rows are ordered by user, then by position (time), the positive before its negatives,
in row groups of about --row_group_rows rows that never split a user; time-ordered
reading (ParquetSource order="time") thus streams each user's positions in order.
Negatives come from a numpy Generator seeded by (--seed, task, split).
"""

from __future__ import annotations

import os
import time

import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

TASKS = ("ranking", "retrieval")
USER_FIELDS = ("gender", "age", "occupation")
SPLITS = ("train", "test", "valid")   # the index of each seeds its negatives


def movielens_schema(num_users: int, user_vocab: dict, num_item_rows: int, num_genres: int,
                     max_history: int):
    """User features, the candidate item and genre, the history sequence; task "label"."""
    from gemjax.features import EventField, FeatureSchema, SequenceFeature, SparseFeature, Table
    tables = ((Table("user", num_users),) + tuple(Table(n, user_vocab[n]) for n in USER_FIELDS)
              + (Table("item", num_item_rows), Table("genre", num_genres)))
    sparse = tuple(SparseFeature(n, n) for n in ("user",) + USER_FIELDS + ("item", "genre"))
    history = SequenceFeature("history", (EventField("item", "item"),
                                          EventField("genre", "genre")), max_len=max_history)
    return FeatureSchema(tables=tables, sparse=sparse, sequences=(history,), tasks=("label",))


class Interactions:
    """The loader's data as flat arrays (first `max_users` users, 0 = all).

    seq [N] int64: per user, the train items then the test item; start [U + 1]: user u's
    sequence is seq[start[u]:start[u + 1]] (L_u + 1 items). user_ids [U, 4] int32: user
    index and the three user features as table rows; dataset_users / dataset_interactions:
    all the files hold (before max_users); raw_user {feature: raw ids of its
    rows}. genre_of [num_items + 1] int32 genre row per item row; genres: raw genre id of
    each genre row. present: item rows that occur. seen_keys: sorted user * V + item of
    every (user, item) pair rated (V = num_items + 1).
    """

    def __init__(self, ml, max_users: int = 0):
        users = len(ml.histories) if max_users <= 0 else min(max_users, len(ml.histories))
        hist = ml.histories[:users]
        lens = np.asarray([len(h) for h in hist], np.int64)
        self.num_users, self.num_item_rows = users, ml.num_items + 1
        self.dataset_users = len(ml.histories)
        self.dataset_interactions = sum(len(h) for h in ml.histories) + len(ml.test_items)
        self.start = np.zeros(users + 1, np.int64)
        np.cumsum(lens + 1, out=self.start[1:])
        self.seq = np.empty(int(self.start[-1]), np.int64)
        is_test = np.zeros(len(self.seq), bool)
        is_test[self.start[1:] - 1] = True
        self.seq[is_test] = ml.test_items[:users]
        self.seq[~is_test] = np.concatenate(hist) if users else np.zeros(0, np.int64)
        self.user_ids = np.zeros((users, 4), np.int32)
        self.user_ids[:, 0] = np.arange(users)
        self.raw_user = {}
        for j, name in enumerate(USER_FIELDS):
            raw, rows = np.unique(ml.user_features[:users, j], return_inverse=True)
            self.user_ids[:, j + 1] = rows
            self.raw_user[name] = raw
        self.present = np.flatnonzero(ml.item_present).astype(np.int64)
        self.genres, rows = np.unique(ml.item_genre[self.present], return_inverse=True)
        self.genre_of = np.zeros(self.num_item_rows, np.int32)
        self.genre_of[self.present] = rows
        owner = np.repeat(np.arange(users, dtype=np.int64), lens + 1)
        self.seen_keys = np.unique(owner * self.num_item_rows + self.seq)

    @property
    def train_lengths(self) -> np.ndarray:
        return np.diff(self.start) - 1

    def positions(self, split: str, last: int = 0, valid: bool = False) -> np.ndarray:
        """[P] int64 indices into seq of the targets of `split`, by user then time:
        train t = max(1, E - last)..E-1 (last 0: from 1) with E = L - 1 when `valid`
        (the last train item is the valid target) else L; valid t = L - 1 (users with
        L >= 2); test t = L."""
        lens = self.train_lengths
        if split == "test":
            return self.start[1:] - 1
        if split == "valid":
            return (self.start[1:] - 2)[lens >= 2]
        end = lens - 1 if valid else lens
        first = np.ones_like(lens) if last <= 0 else np.maximum(1, end - last)
        n = np.maximum(end - first, 0)
        ramp = np.arange(int(n.sum()), dtype=np.int64) - np.repeat(np.cumsum(n) - n, n)
        return np.repeat(self.start[:-1] + first, n) + ramp

    def user_of(self, pos: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.start, pos, side="right") - 1

    def sample_negatives(self, users: np.ndarray, k: int, rng) -> np.ndarray:
        """[P, k] int64 items, uniform over the items present minus the user's rated
        items (with replacement), by rejection; ValueError for a user who rated all."""
        if k == 0:
            return np.zeros((len(users), 0), np.int64)
        rated = np.bincount(self.seen_keys // self.num_item_rows, minlength=self.num_users)
        full = rated[users] >= len(self.present)
        if full.any():
            raise ValueError(f"movielens: user index {int(users[np.argmax(full)])} rated all "
                             f"{len(self.present)} items; no negative can be sampled")
        u = np.repeat(users, k)
        cand = self.present[rng.integers(0, len(self.present), len(u))]
        redo = np.arange(len(u))
        while redo.size:
            bad = self._seen(u[redo] * self.num_item_rows + cand[redo])
            redo = redo[bad]
            cand[redo] = self.present[rng.integers(0, len(self.present), redo.size)]
        return cand.reshape(len(users), k)

    def _seen(self, keys: np.ndarray) -> np.ndarray:
        i = np.minimum(np.searchsorted(self.seen_keys, keys), len(self.seen_keys) - 1)
        return self.seen_keys[i] == keys


def _table(data: Interactions, pos, cands, max_history: int):
    """pa.Table of the rows of positions `pos` [P], each repeated for its candidates
    cands [P, C] (column 0 the true item, label 1; the others label 0)."""
    import pyarrow as pa

    from gemjax.data.parquet import sequence_column
    from gemjax.data.parquet_writer import list_array

    p, c = cands.shape
    user = data.user_of(pos)
    h_start = np.maximum(data.start[user], pos - max_history)
    h_len = np.repeat(pos - h_start, c)
    h_start = np.repeat(h_start, c)
    offsets = np.zeros(p * c + 1, np.int64)
    np.cumsum(h_len, out=offsets[1:])
    ramp = np.arange(int(offsets[-1]), dtype=np.int64) - np.repeat(offsets[:-1], h_len)
    items = data.seq[np.repeat(h_start, h_len) + ramp]
    cand = cands.reshape(-1)
    ids = data.user_ids[np.repeat(user, c)]
    cols = {"user": ids[:, 0], **{n: ids[:, j + 1] for j, n in enumerate(USER_FIELDS)}}
    cols = {k: pa.array(np.ascontiguousarray(v)) for k, v in cols.items()}
    cols[sequence_column("history", "item")] = list_array(offsets, items)
    cols[sequence_column("history", "genre")] = list_array(offsets, data.genre_of[items])
    cols["item"] = pa.array(cand.astype(np.int32))
    cols["genre"] = pa.array(data.genre_of[cand])
    label = np.zeros((p, c), np.float32)
    label[:, 0] = 1.0
    cols["label"] = pa.array(label.reshape(-1))
    return pa.table(cols)


def _chunks(data: Interactions, pos, cands, max_history: int, row_group_rows: int):
    """Tables of about row_group_rows rows, cut between users."""
    user = data.user_of(pos)
    rows_before_user = np.searchsorted(user, np.arange(data.num_users + 1)) * cands.shape[1]
    cuts = np.unique(np.searchsorted(rows_before_user,
                                     np.arange(0, rows_before_user[-1], row_group_rows)))
    bounds = np.searchsorted(user, np.append(cuts, data.num_users))
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        if hi > lo:
            yield _table(data, pos[lo:hi], cands[lo:hi], max_history)


def _split_counts(data: Interactions, pos, cands, max_history: int) -> dict:
    user = data.user_of(pos)
    h = np.minimum(pos - data.start[user], max_history)
    return {"positions": int(len(pos)), "users": int(len(np.unique(user))),
            "candidate_items": int(len(np.unique(cands))),
            "history_mean": float(h.mean()) if len(h) else 0.0,
            "history_median": float(np.median(h)) if len(h) else 0.0,
            "history_max": int(h.max()) if len(h) else 0,
            "positive_share": 1.0 / cands.shape[1]}


def convert(data_dir: str, out: str, tasks=TASKS, seed: int = 0, negatives: int = 4,
            max_history: int = 200, train_positions: int = 0, max_users: int = 0,
            row_group_rows: int = 65_536, valid: bool = False,
            resample_negatives: bool = False) -> dict:
    """Write out/<task>/{train,test[,valid]}.parquet, schema.json, counts.json (ranking
    with resample_negatives: positives-only train rows and negatives.npz); returns
    {task: counts}."""
    from gemjax.data.movielens import load_movielens
    from gemjax.data.parquet_writer import check_out_dir, write_json, write_split

    unknown = sorted(set(tasks) - set(TASKS))
    if unknown or not tasks:
        raise ValueError(f"--tasks: {list(tasks)}; choose from {TASKS}")
    for name, v, lo in (("negatives", negatives, 0), ("max_history", max_history, 1),
                        ("train_positions", train_positions, 0), ("max_users", max_users, 0),
                        ("row_group_rows", row_group_rows, 1)):
        if v < lo:
            raise ValueError(f"--{name} must be >= {lo}, got {v}")
    out = check_out_dir(out)
    t0 = time.time()
    data = Interactions(load_movielens(data_dir), max_users)
    load_s = time.time() - t0
    schema = movielens_schema(data.num_users, {n: len(r) for n, r in data.raw_user.items()},
                              data.num_item_rows, len(data.genres), max_history)
    result = {}
    for task in tasks:
        d = check_out_dir(os.path.join(out, task))
        k = negatives if task == "ranking" else 0
        resample = resample_negatives and task == "ranking"
        counts = {"dataset": "ml-1m", "task": task, "data_dir": os.path.abspath(data_dir),
                  "seed": seed, "negatives": k, "max_history": max_history,
                  "train_positions": train_positions, "valid": valid,
                  "train_negatives": "resampled per epoch" if resample else "fixed",
                  "users": data.num_users,
                  "dataset_users": data.dataset_users,
                  "dataset_interactions": data.dataset_interactions,
                  "items": int(len(data.present)), "item_rows": data.num_item_rows,
                  "negative_sampling": ("uniform over the items present minus the user's rated "
                                        "items, with replacement") if k else None,
                  "load_seconds": load_s, "splits": {}}
        for i, split in enumerate(SPLITS):
            if split == "valid" and not valid:
                continue
            t1 = time.time()
            pos = data.positions(split, train_positions, valid)
            rng = np.random.default_rng([seed, TASKS.index(task), i])
            neg = data.sample_negatives(data.user_of(pos), 0 if resample and split == "train"
                                        else k, rng)
            cands = np.concatenate([data.seq[pos][:, None], neg], axis=1)
            written = write_split(os.path.join(d, f"{split}.parquet"),
                                  _chunks(data, pos, cands, max_history, row_group_rows))
            counts["splits"][split] = {**written, **_split_counts(data, pos, cands, max_history),
                                       "seconds": time.time() - t1}
        if resample:
            negative_sampler(data).save(os.path.join(d, "negatives.npz"))
        write_json(os.path.join(d, "schema.json"), schema.to_dict())
        counts["raw_ids"] = {**{n: r.tolist() for n, r in data.raw_user.items()},
                             "genre": data.genres.tolist()}
        write_json(os.path.join(d, "counts.json"), counts)
        result[task] = counts
    return result


def negative_sampler(data: Interactions):
    """The train negatives' sampler (gemjax.data.negatives.NegativeSampler): the items
    present with their genre, minus each user's rated items (train and test)."""
    from gemjax.data.negatives import NegativeSampler
    user, item = np.divmod(data.seen_keys, data.num_item_rows)
    offsets = np.zeros(data.num_users + 1, np.int64)
    np.cumsum(np.bincount(user, minlength=data.num_users), out=offsets[1:])
    return NegativeSampler.build("user", "item", data.present,
                                 {"genre": data.genre_of[data.present]}, offsets, item)


def define_flags():
    """The command line's flags (defined when run as a script, so that tests can import
    this module beside other scripts defining the same names)."""
    flags.DEFINE_string("data_dir", None, "ml-1m directory (default ../shared/datasets/ml-1m)")
    flags.DEFINE_string("out", None, "output directory (outside any git work tree)")
    flags.DEFINE_list("tasks", ["ranking", "retrieval"], "tasks to write: ranking, retrieval")
    flags.DEFINE_integer("seed", 0, "seed of the negative sampling")
    flags.DEFINE_integer("negatives", 4, "ranking: sampled negatives per positive")
    flags.DEFINE_integer("max_history", 200, "newest events kept in each history (HSTU: 200)")
    flags.DEFINE_integer("train_positions", 0, "train targets per user: the last N train "
                         "positions (0 = every position from the 2nd on)")
    flags.DEFINE_bool("valid", True, "also write valid.parquet (each user's last train item: the "
                      "validation rows the movielens presets select on, data.valid_path) and leave "
                      "that position out of train.parquet; --novalid: train keeps it, no valid split")
    flags.DEFINE_integer("max_users", 0, "convert only the first N users (0 = all; for quick runs)")
    flags.DEFINE_integer("row_group_rows", 65_536, "target rows per Parquet row group")
    flags.DEFINE_bool("resample_negatives", False, "ranking: train.parquet holds positives only "
                      "and negatives.npz the sampler that draws the train negatives "
                      "afresh each epoch (data.negatives); valid / test keep fixed negatives")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    f = flags.FLAGS
    if not f.out:
        raise app.UsageError("--out is required (a directory outside the repository)")
    from gemjax.data.movielens import DEFAULT_DIR
    t0 = time.time()
    result = convert(f.data_dir or DEFAULT_DIR, f.out, tuple(f.tasks), f.seed, f.negatives,
                     f.max_history, f.train_positions, f.max_users, f.row_group_rows, f.valid,
                     f.resample_negatives)
    for task, counts in result.items():
        for split, c in counts["splits"].items():
            print(f"{task:9s} {split:5s} {c['rows']:9d} rows  {c['users']:5d} users  history "
                  f"mean {c['history_mean']:6.1f} median {c['history_median']:5.0f}  "
                  f"{c['positive_share']:.1%} positive  {c['bytes'] / 2**20:8.1f} MiB  "
                  f"{c['seconds']:5.1f} s")
    print(f"wrote {f.out} in {time.time() - t0:.1f} s")


if __name__ == "__main__":
    define_flags()
    app.run(main)
