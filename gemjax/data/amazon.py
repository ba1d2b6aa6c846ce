"""Amazon Books (2014 ratings-only file) -> the MovieLens sequences of gemjax.data.movielens.

    load_books(path, min_count=5, iterate=False) -> (MovieLens, stats)
    core_filter(user, item, min_count, iterate)  -> keep [N] bool

ratings_Books.csv: `user,item,rating,timestamp`, no header, user and item strings (the
reviewer id and the ASIN). As HSTU's preprocessing of this file: keep the ratings whose
user and item each occur at least min_count (5) times in the whole file, both counts
taken once on the unfiltered file (iterate=False); iterate=True repeats the filter
until every kept user and item has min_count ratings (the k-core). Every kept rating
is an interaction; each user's items are ordered by timestamp, ties by file order; the
last is the test item.

The MovieLens it returns: users in increasing reviewer-id order (user_ids: the ids),
item rows 1..N in increasing ASIN order (item_ids: "" for the padding row 0, then the
ASINs). There are no user features and no genres: user_features are all 0 and
item_genre is 0, so a converted schema's gender / age / occupation and genre tables
hold one row each and carry no information.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from gemjax.data.movielens import MovieLens
from gemjax.data.movielens_raw import build_sequences


def core_filter(user: np.ndarray, item: np.ndarray, min_count: int = 5,
                iterate: bool = False) -> np.ndarray:
    """user, item [N] int64 codes >= 0 -> keep [N] bool: both the rating's user and item
    have >= min_count ratings (counted on the input; with iterate, on the kept ratings
    until nothing changes)."""
    keep = np.ones(len(user), bool)
    while True:
        uc = np.bincount(user[keep], minlength=int(user.max(initial=-1)) + 1)
        ic = np.bincount(item[keep], minlength=int(item.max(initial=-1)) + 1)
        new = keep & (uc[user] >= min_count) & (ic[item] >= min_count)
        if not iterate or (new == keep).all():
            return new
        keep = new


def _codes(col):
    """pa string column -> (codes [N] int64 in sorted order of the strings, sorted
    strings as a numpy object array)."""
    import pyarrow.compute as pc

    enc = col.combine_chunks().dictionary_encode()
    order = pc.array_sort_indices(enc.dictionary).to_numpy()
    rank = np.empty(len(order), np.int64)
    rank[order] = np.arange(len(order))
    return rank[enc.indices.to_numpy(zero_copy_only=False)], \
        np.asarray(enc.dictionary.take(order).to_pylist(), dtype=object)


def load_books(path: str, min_count: int = 5, iterate: bool = False
               ) -> tuple[MovieLens, dict]:
    """ratings_Books.csv -> (MovieLens, stats {ratings, users, items before and after the
    filter, min_count, iterate})."""
    import pyarrow as pa
    import pyarrow.csv as pacsv

    if min_count < 1:
        raise ValueError(f"books: min_count must be >= 1, got {min_count}")
    if not os.path.exists(path):
        raise FileNotFoundError(f"books: {path} not found (pass --data_dir)")
    names = ["user", "item", "rating", "time"]
    try:
        t = pacsv.read_csv(path, read_options=pacsv.ReadOptions(column_names=names),
                           convert_options=pacsv.ConvertOptions(column_types={
                               "user": pa.string(), "item": pa.string(),
                               "rating": pa.float64(), "time": pa.int64()}))
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        _locate(path, e)
        raise
    if t.num_rows == 0:
        raise ValueError(f"books: {path} holds no ratings")
    user, user_names = _codes(t["user"])
    item, item_names = _codes(t["item"])
    time = t["time"].to_numpy()
    keep = core_filter(user, item, min_count, iterate)
    if not keep.any():
        raise ValueError(f"books: {path}: no rating has a user and an item with "
                         f">= {min_count} ratings")
    stats = {"ratings": int(len(user)), "users": int(len(user_names)),
             "items": int(len(item_names)), "min_count": min_count, "iterate": iterate,
             "kept_ratings": int(keep.sum()), "kept_users": int(len(np.unique(user[keep]))),
             "kept_items": int(len(np.unique(item[keep])))}
    kept_items, rows = np.unique(item[keep], return_inverse=True)
    ml = build_sequences(user[keep], rows + 1, time[keep], np.zeros(int(keep.sum()), np.int64))
    ml = dataclasses.replace(ml, user_ids=user_names[ml.user_ids],
                             item_ids=np.concatenate([np.asarray([""], dtype=object),
                                                      item_names[kept_items]]))
    return ml, stats


def _locate(path: str, err: Exception) -> None:
    """Raise ValueError naming the first line of `path` that is not
    `user,item,rating,timestamp` (the error pyarrow raised: err)."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            line = raw.decode("utf-8", "replace").rstrip("\r\n")
            if not line.strip():
                continue
            p = line.split(",")
            if len(p) != 4:
                raise ValueError(f"books: {path}:{lineno}: {len(p)} comma-separated fields, "
                                 f"expected 4 (user,item,rating,timestamp); got {line!r}") from err
            try:
                float(p[2])
            except ValueError:
                raise ValueError(f"books: {path}:{lineno}: field rating: {p[2]!r} is not a "
                                 f"number") from err
            if not (p[3].strip().isascii() and p[3].strip().lstrip("-").isdigit()):
                raise ValueError(f"books: {path}:{lineno}: field timestamp: {p[3]!r} is not an "
                                 f"integer") from err
    raise ValueError(f"books: {path}: unreadable ({err})") from err
