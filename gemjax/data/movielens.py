"""MovieLens-1M next-item data, read in place from ../shared/datasets/ml-1m.

Layout (one interaction per line, each user's lines in time order):
    `uid-genderF-ageF-occF,iid-genreF`
train.csv (inside train.csv.zip) holds every interaction but each user's last;
test.csv holds each user's last item (leave-last-out), one row per user. Feature ids
are offset: user side >= 6041, item side (genre) >= 3707; item ids are 1..3952 (3,706
of them occur).

Tables are sized by the ids present (gemjax.data.vocab.table_rows): items keep their
raw ids as rows while those are nearly dense (ML-1M: 3,706 items in rows 1..3952, row 0
the padding item), genres likewise (ML-1M: 18 genre ids in 3,725 rows); ids far beyond
their distinct count are remapped in increasing order (item_ids / genre_ids give the
raw id of each row). Users are the uids of test.csv in increasing order (ML-1M: 1..6040),
whatever their magnitude. Every error names the file and line (and field).

    load_movielens(data_dir) -> MovieLens(histories, test_items, user_features,
                                          item_genre, item_present, num_items,
                                          user_ids, item_ids, genre_ids)
    leave_last_out(ml, max_len)   -> train / train_full / valid / test splits
    exclude_history(scores, histories) -> scores with each row's history items at -inf

Protocol (generative-recommenders, research/data/reco_dataset.py, dataset.py and
eval.py): the model reads at most the max_len most recent events; training sees
every train item (all but the test item) as a next-item target; test = predict
the test item from the max_len most recent train items, ranked against the
whole catalogue with the items of that history window excluded
(eval_metrics_v2_from_tensors filters `past_ids`; ML-1M has no repeat ratings,
so a target is never in its own history). We rank the 3,706 items that occur
(their candidate set is the 3,883 ids of movies.dat); score columns of absent
ids and of the padding id 0 are set to -inf by the caller. Our valid split
(last train item from the ones before it) exists only for choosing the number
of epochs; the published repository has none.
"""

from __future__ import annotations

import dataclasses
import os
import zipfile
import zlib

import numpy as np

from gemjax.data.vocab import table_rows

DEFAULT_DIR = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                            "..", "..", "..", "shared", "datasets", "ml-1m"))
_FIELDS = (("user", "gender", "age", "occupation"), ("item", "genre"))
_FORMAT = "'uid-gender-age-occupation,item-genre' of non-negative integers"


def _bad_line(line: str, where: str) -> ValueError:
    """The error for a line the fast path of _parse refused: which field is wrong."""
    what = f"expected {_FORMAT}"
    parts = line.split(",")
    if len(parts) != 2:
        what = f"{len(parts) - 1} commas, expected 1 ({_FORMAT})"
    else:
        for part, names in zip(parts, _FIELDS):
            toks = part.split("-")
            if len(toks) != len(names):
                what = (f"{len(toks)} '-'-separated fields in {part!r}, expected "
                        f"{len(names)} ({'-'.join(names)})")
                break
            bad = [(n, t) for n, t in zip(names, toks) if not (t.isascii() and t.isdigit())]
            if bad:
                what = f"field {bad[0][0]}: {bad[0][1]!r} is not a non-negative integer"
                break
            big = [(n, t) for n, t in zip(names, toks) if int(t) >= 2**63]
            if big:
                what = f"field {big[0][0]}: {big[0][1]} does not fit in int64"
                break
    return ValueError(f"movielens: {where}: {what}; got {line!r}")


def _parse(lines, name):
    """lines: the file's lines as bytes -> (uid, user feats [., 3], iid, genre, line numbers)
    int64 arrays; errors name file:line and the field. Items and users must be >= 1
    (item 0 is the padding id)."""
    rows, linenos = [], []
    for lineno, raw in enumerate(lines, 1):
        try:
            line = raw.decode("utf-8").strip()
        except UnicodeDecodeError as e:
            raise ValueError(f"movielens: {name}:{lineno}: not UTF-8 text ({e.reason})") from e
        if not line:
            continue
        user, _, item = line.partition(",")
        u, it = user.split("-"), item.split("-")
        if (len(u) != 4 or len(it) != 2 or "" in u or "" in it
                or not (line.isascii() and "".join(u + it).isdigit())):
            raise _bad_line(line, f"{name}:{lineno}")
        rows.append([int(u[0]), int(u[1]), int(u[2]), int(u[3]), int(it[0]), int(it[1])])
        linenos.append(lineno)
    if not rows:
        raise ValueError(f"movielens: {name} holds no rows")
    try:
        a = np.asarray(rows, np.int64)
    except OverflowError:           # a value >= 2**63: _bad_line names its field
        i = next(i for i, r in enumerate(rows) if max(r) >= 2**63)
        raise _bad_line(f"{'-'.join(map(str, rows[i][:4]))},{rows[i][4]}-{rows[i][5]}",
                        f"{name}:{linenos[i]}") from None
    linenos = np.asarray(linenos, np.int64)
    for col, field in ((0, "user"), (4, "item")):
        if a[:, col].min() < 1:
            i = int(np.argmax(a[:, col] < 1))
            raise ValueError(f"movielens: {name}:{linenos[i]}: field {field}: {field} ids start "
                             f"at 1 (item 0 is the padding id), got {a[i, col]}")
    return a[:, 0], a[:, 1:4], a[:, 4], a[:, 5], linenos


def _read_train(train_zip):
    """The train.csv member of train.csv.zip (__MACOSX/ entries ignored): (_parse's
    arrays, the member's name for errors: zip path/member)."""
    try:
        z = zipfile.ZipFile(train_zip)
    except zipfile.BadZipFile as e:
        raise ValueError(f"movielens: {train_zip}: not a readable zip archive ({e})") from e
    with z:
        names = [n for n in z.namelist() if n.endswith("train.csv") and "MACOSX" not in n]
        if len(names) != 1:
            raise ValueError(f"movielens: {train_zip}: expected one train.csv member (besides "
                             f"__MACOSX/), found {len(names)} among {z.namelist()[:10]}")
        where = f"{train_zip}/{names[0]}"
        try:
            with z.open(names[0]) as f:
                return _parse(f.read().split(b"\n"), where), where
        except (zipfile.BadZipFile, zlib.error, EOFError) as e:
            raise ValueError(f"movielens: {where}: damaged archive member "
                             f"({type(e).__name__}: {e})") from e


@dataclasses.dataclass(frozen=True)
class MovieLens:
    histories: list[np.ndarray]     # per user (users in uid order): train item rows in time order
    test_items: np.ndarray          # [U] each user's held-out last item (its row)
    user_features: np.ndarray       # [U, 3] gender, age, occupation feature ids
    item_genre: np.ndarray          # [num_items + 1] genre row per item row (0 for unused rows)
    item_present: np.ndarray        # [num_items + 1] bool: the item occurs (3,706 of 3,952)
    num_items: int                  # largest item row (rows 1..num_items; 0 is padding)
    user_ids: np.ndarray | None = None   # [U] raw uid of each user (None: 1..U)
    item_ids: np.ndarray | None = None   # [num_items + 1] raw item id of each row (None: rows)
    genre_ids: np.ndarray | None = None  # [G] raw genre id of each genre row (None: rows)


def load_movielens(data_dir: str = DEFAULT_DIR) -> MovieLens:
    train_zip, test_csv = os.path.join(data_dir, "train.csv.zip"), os.path.join(data_dir, "test.csv")
    for p in (train_zip, test_csv):
        if not os.path.exists(p):
            raise FileNotFoundError(f"movielens: {p} not found (pass --data_dir)")
    (tr_uid, tr_feat, tr_iid, tr_genre, tr_line), train_csv = _read_train(train_zip)
    with open(test_csv, "rb") as f:
        te_uid, te_feat, te_iid, te_genre, te_line = _parse(f.read().split(b"\n"), test_csv)
    users, first, count = np.unique(te_uid, return_index=True, return_counts=True)
    if (count > 1).any():
        u = users[np.argmax(count > 1)]
        at = te_line[te_uid == u]
        raise ValueError(f"movielens: {test_csv}:{at[1]}: user {u} already has a test row "
                         f"(line {at[0]}); test.csv holds one row per user")
    num_users = len(users)
    tr_user = np.minimum(np.searchsorted(users, tr_uid), num_users - 1)
    if (users[tr_user] != tr_uid).any():
        i = int(np.argmax(users[tr_user] != tr_uid))
        raise ValueError(f"movielens: {train_csv}:{tr_line[i]}: user {tr_uid[i]} has no row "
                         f"in {test_csv} (one test row per user)")
    te_user = np.searchsorted(users, te_uid)
    item_rows, item_ids = table_rows(np.concatenate([tr_iid, te_iid]), first=1)
    genre_rows, genre_ids = table_rows(np.concatenate([tr_genre, te_genre]))
    n_tr = len(tr_iid)
    order = np.argsort(tr_user, kind="stable")           # keeps each user's time order
    user_sorted, items_sorted = tr_user[order], item_rows[:n_tr][order]
    bounds = np.searchsorted(user_sorted, np.arange(num_users + 1))
    histories = [items_sorted[bounds[u]:bounds[u + 1]] for u in range(num_users)]
    test_items = np.zeros(num_users, np.int64)
    test_items[te_user] = item_rows[n_tr:]
    ufeat = np.zeros((num_users, 3), np.int64)
    ufeat[tr_user] = tr_feat
    ufeat[te_user] = te_feat
    num_items = len(item_ids) - 1
    genre = np.zeros(num_items + 1, np.int64)
    genre[item_rows] = genre_rows
    present = np.zeros(num_items + 1, bool)
    present[item_rows] = True
    return MovieLens(histories, test_items, ufeat, genre, present, num_items,
                     users, item_ids, genre_ids)


def leave_last_out(ml: MovieLens, max_len: int = 200):
    """Splits for next-item training and evaluation.

    "train": per user, the train items minus the last (the valid target), for
             next-item training on every prefix;
    "train_full": per user, all train items (the valid target included), for
             training once the number of epochs is fixed (the published practice);
    "valid": (histories, targets): predict each user's last train item;
    "test":  (histories, targets): predict the test item from all train items.
    Evaluation histories keep the max_len most recent items.
    """
    if max_len < 1:
        raise ValueError(f"movielens: max_len must be >= 1, got {max_len}")
    cut = lambda h: h[max(0, len(h) - max_len):]
    valid = [(cut(h[:-1]), int(h[-1])) for h in ml.histories if len(h) >= 2]
    test = [(cut(h), int(t)) for h, t in zip(ml.histories, ml.test_items)]
    return {"train": [h[:-1] for h in ml.histories], "train_full": list(ml.histories),
            "valid": ([v[0] for v in valid], np.asarray([v[1] for v in valid])),
            "test": ([t[0] for t in test], np.asarray([t[1] for t in test]))}


def exclude_history(scores: np.ndarray, histories) -> np.ndarray:
    """A copy of scores [N, V] with row i's history items (ids in histories[i]) at -inf.

    histories: N int arrays of item ids in [0, V) (the window the model read).
    """
    scores = np.array(scores, copy=True)
    if scores.ndim != 2 or len(histories) != scores.shape[0]:
        raise ValueError(f"exclude_history: scores [N, V] and N histories expected, got "
                         f"{scores.shape} and {len(histories)}")
    lens = np.asarray([len(h) for h in histories], np.int64)
    cols = (np.concatenate([np.asarray(h, np.int64) for h in histories]) if lens.sum()
            else np.zeros(0, np.int64))
    if cols.size and (cols.min() < 0 or cols.max() >= scores.shape[1]):
        raise ValueError("exclude_history: a history item is outside the score columns")
    scores[np.repeat(np.arange(len(lens)), lens), cols] = -np.inf
    return scores
