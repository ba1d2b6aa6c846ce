"""MovieLens-1M next-item data, read in place from ../shared/datasets/ml-1m.

Layout (one interaction per line, each user's lines in time order):
    `uid-genderF-ageF-occF,iid-genreF`
train.csv (inside train.csv.zip) holds every interaction but each user's last;
test.csv holds each user's last item (leave-last-out). Feature ids are offset:
user side >= 6041, item side (genre) >= 3707; raw item ids are 1..3706.

    load_movielens(data_dir) -> MovieLens(histories, test_items, user_features,
                                          item_genre, num_items)
    leave_last_out(ml, max_len)   -> train / train_full / valid / test splits
    exclude_history(scores, histories) -> scores with each row's history items at -inf
    ranking_metrics(scores, targets, ks) -> {"hr@k", "ndcg@k"} (full ranking)

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
import io
import os
import zipfile

import numpy as np

DEFAULT_DIR = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                            "..", "..", "..", "shared", "datasets", "ml-1m"))


def _parse(lines, name):
    """-> (uid, user feats [3], iid, genre) int arrays, errors name file:line."""
    uid, ufeat, iid, genre = [], [], [], []
    for lineno, line in enumerate(lines, 1):
        line = line.strip()
        if not line:
            continue
        try:
            user, item = line.split(",")
            u = [int(v) for v in user.split("-")]
            it = [int(v) for v in item.split("-")]
            if len(u) != 4 or len(it) != 2:
                raise ValueError
        except ValueError as e:
            raise ValueError(f"movielens: {name}:{lineno}: expected 'uid-g-a-o,iid-genre', "
                             f"got {line!r}") from e
        uid.append(u[0])
        ufeat.append(u[1:])
        iid.append(it[0])
        genre.append(it[1])
    return (np.asarray(uid, np.int64), np.asarray(ufeat, np.int64).reshape(-1, 3),
            np.asarray(iid, np.int64), np.asarray(genre, np.int64))


@dataclasses.dataclass(frozen=True)
class MovieLens:
    histories: list[np.ndarray]     # per user (index uid - 1): train items in time order
    test_items: np.ndarray          # [U] each user's held-out last item
    user_features: np.ndarray       # [U, 3] gender, age, occupation feature ids
    item_genre: np.ndarray          # [num_items + 1] genre feature id per item (0 unused)
    item_present: np.ndarray        # [num_items + 1] bool: the item occurs (3,706 of 3,952)
    num_items: int                  # largest item id (ids are 1..num_items)


def load_movielens(data_dir: str = DEFAULT_DIR) -> MovieLens:
    train_zip, test_csv = os.path.join(data_dir, "train.csv.zip"), os.path.join(data_dir, "test.csv")
    for p in (train_zip, test_csv):
        if not os.path.exists(p):
            raise FileNotFoundError(f"movielens: {p} not found (pass --data_dir)")
    with zipfile.ZipFile(train_zip) as z:
        name = next(n for n in z.namelist() if n.endswith("train.csv") and "MACOSX" not in n)
        with z.open(name) as f:
            tr = _parse(io.TextIOWrapper(f, encoding="utf-8"), "train.csv")
    with open(test_csv, encoding="utf-8") as f:
        te = _parse(f, "test.csv")
    num_users = int(max(tr[0].max(), te[0].max()))
    if sorted(te[0].tolist()) != list(range(1, num_users + 1)):
        raise ValueError("movielens: test.csv must hold exactly one row per user 1..U")
    order = np.argsort(tr[0], kind="stable")            # keeps each user's time order
    uid_sorted, items_sorted = tr[0][order], tr[2][order]
    bounds = np.searchsorted(uid_sorted, np.arange(1, num_users + 2))
    histories = [items_sorted[bounds[u]:bounds[u + 1]] for u in range(num_users)]
    test_items = np.zeros(num_users, np.int64)
    test_items[te[0] - 1] = te[2]
    ufeat = np.zeros((num_users, 3), np.int64)
    ufeat[tr[0] - 1] = tr[1]
    ufeat[te[0] - 1] = te[1]
    num_items = int(max(tr[2].max(), te[2].max()))
    genre = np.zeros(num_items + 1, np.int64)
    genre[tr[2]] = tr[3]
    genre[te[2]] = te[3]
    present = np.zeros(num_items + 1, bool)
    present[tr[2]] = True
    present[te[2]] = True
    return MovieLens(histories, test_items, ufeat, genre, present, num_items)


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


def ranking_metrics(scores: np.ndarray, targets: np.ndarray, ks=(10, 50)) -> dict[str, float]:
    """Full-ranking HR@k and NDCG@k.

    scores [N, V] (column j = item j; columns the caller wants excluded, such as the
    padding item 0, set to -inf), targets [N] int item ids. Rank = number of items
    scoring strictly higher than the target (ties resolved in the target's favour).
    HR@k = mean(rank < k); NDCG@k = mean(1 / log2(rank + 2) if rank < k else 0).
    """
    scores = np.asarray(scores, np.float64)
    targets = np.asarray(targets, np.int64)
    if scores.ndim != 2 or targets.shape != (scores.shape[0],):
        raise ValueError(f"ranking_metrics: scores [N, V] and targets [N] expected, got "
                         f"{scores.shape} and {targets.shape}")
    if targets.size and (targets.min() < 0 or targets.max() >= scores.shape[1]):
        raise ValueError("ranking_metrics: a target is outside the score columns")
    t = scores[np.arange(len(targets)), targets]
    rank = np.sum(scores > t[:, None], axis=1)
    out = {}
    for k in ks:
        hit = rank < k
        out[f"hr@{k}"] = float(np.mean(hit)) if len(rank) else float("nan")
        out[f"ndcg@{k}"] = float(np.mean(np.where(hit, 1.0 / np.log2(rank + 2), 0.0))) \
            if len(rank) else float("nan")
    return out
