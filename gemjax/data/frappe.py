"""Frappe CTR data (BARS libsvm layout), read in place from ../shared/datasets/frappe.

Each line is `label id:1 id:1 ...` with one global feature id per field, 10 fields
(user, item, cnt, daytime, weekday, isweekend, homework, cost, weather, country,
city as shipped by BARS; the field count is checked, not assumed beyond the first
line). We have valid.libsvm (57,722 rows) and test.libsvm (28,860 rows): we train
on valid.libsvm minus a held-out part used for early stopping, and report on
test.libsvm. The licence forbids copying the data, so nothing is ever written.

The embedding table covers every id of both files (gemjax.data.vocab.table_rows):
the raw ids themselves while they are nearly dense (the shipped files: ids 0..5381,
5,328 of them present, 5,382 rows), else the ids present remapped in increasing order,
so hashed or 64-bit ids give a table of at most one row per distinct id. Test ids
absent from valid.libsvm have rows that training never updates; no id is out of
vocabulary. Every error names the file and line (and field, 1-based, for an id).

    load_libsvm(path)                  -> (ids [N, F] int64 raw, labels [N] float32)
    load_frappe(data_dir, holdout_fraction, seed)
        -> FrappeData(train, holdout, test: (rows [., F] int32, labels), num_features,
                      num_fields, raw_ids [num_features] int64)
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from gemjax.data.vocab import table_rows

DEFAULT_DIR = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                            "..", "..", "..", "shared", "datasets", "frappe"))
_ID_LIMIT = 2**63       # ids are held as int64


def _feature_id(token: str, where: str, field: int) -> int:
    """`id:1` -> id, or ValueError naming where (file:line) and the 1-based field."""
    fid, sep, val = token.partition(":")
    if not sep or not (fid.isascii() and fid.isdigit()):
        raise ValueError(f"frappe: {where}: field {field}: cannot parse {token!r} (expected "
                         f"id:1 with a non-negative integer id)")
    if len(fid) > 18 and int(fid) >= _ID_LIMIT:
        raise ValueError(f"frappe: {where}: field {field}: id {fid} does not fit in int64")
    try:
        one = float(val) == 1.0
    except ValueError:
        one = False
    if not one:
        raise ValueError(f"frappe: {where}: field {field}: expected id:1, got {token!r}")
    return int(fid)


def load_libsvm(path: str) -> tuple[np.ndarray, np.ndarray]:
    """One libsvm file of one-hot fields -> (ids [N, F] int64 as in the file, labels [N]
    float32 in {0, 1}).

    Raises ValueError naming the file and line (and field) on a malformed row: a label
    other than 0/1, a token other than `id:1` with an integer 0 <= id < 2**63, a field
    count differing from the first row's; and naming the file when it holds no rows.
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"frappe: {path} not found (pass --data_dir)")
    labels, rows = [], []
    width = None
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            try:
                parts = raw.decode("utf-8").split()
            except UnicodeDecodeError as e:
                raise ValueError(f"frappe: {where}: not UTF-8 text ({e.reason})") from e
            if not parts:
                continue
            try:
                label = float(parts[0])
            except ValueError:
                label = None
            if label not in (0.0, 1.0):
                raise ValueError(f"frappe: {where}: expected label 0/1 and id:1 pairs, "
                                 f"got label {parts[0]!r}")
            ids = [_feature_id(t, where, j) for j, t in enumerate(parts[1:], 1)]
            if width is None:
                if not ids:
                    raise ValueError(f"frappe: {where}: a label without id:1 fields")
                width = len(ids)
            if len(ids) != width:
                raise ValueError(f"frappe: {where}: {len(ids)} fields, the first row had "
                                 f"{width}")
            labels.append(label)
            rows.append(ids)
    if not rows:
        raise ValueError(f"frappe: {path} holds no rows")
    return np.asarray(rows, np.int64).reshape(len(rows), width), np.asarray(labels, np.float32)


@dataclasses.dataclass(frozen=True)
class FrappeData:
    train: tuple[np.ndarray, np.ndarray]
    holdout: tuple[np.ndarray, np.ndarray]
    test: tuple[np.ndarray, np.ndarray]
    num_features: int        # table rows (gemjax.data.vocab.table_rows over both files)
    num_fields: int
    raw_ids: np.ndarray      # [num_features] int64: the file's id each table row stands for


def load_frappe(data_dir: str = DEFAULT_DIR, holdout_fraction: float = 0.2,
                seed: int = 0) -> FrappeData:
    """valid.libsvm split at random into train / holdout (early stopping); test.libsvm.
    Ids are table rows (int32), see the module docstring."""
    if not 0.0 < holdout_fraction < 1.0:
        raise ValueError(f"frappe: holdout_fraction must be in (0, 1), got {holdout_fraction}")
    valid_path, test_path = os.path.join(data_dir, "valid.libsvm"), os.path.join(data_dir,
                                                                                 "test.libsvm")
    ids, y = load_libsvm(valid_path)
    test_ids, test_y = load_libsvm(test_path)
    if test_ids.shape[1] != ids.shape[1]:
        raise ValueError(f"frappe: {test_path} has {test_ids.shape[1]} fields per row, "
                         f"{valid_path} {ids.shape[1]}")
    rows, raw_ids = table_rows(np.concatenate([ids, test_ids]))
    rows = rows.astype(np.int32)
    ids, test_ids = rows[:len(ids)], rows[len(ids):]
    perm = np.random.default_rng(seed).permutation(len(y))
    n_hold = int(round(holdout_fraction * len(y)))
    hold, train = perm[:n_hold], perm[n_hold:]
    return FrappeData((ids[train], y[train]), (ids[hold], y[hold]), (test_ids, test_y),
                      len(raw_ids), ids.shape[1], raw_ids)
