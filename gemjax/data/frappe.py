"""Frappe CTR data (BARS libsvm layout), read in place from ../shared/datasets/frappe.

Each line is `label id:1 id:1 ...` with one global feature id per field, 10 fields
(user, item, cnt, daytime, weekday, isweekend, homework, cost, weather, country,
city as shipped by BARS; the field count is checked, not assumed beyond the first
line). We have valid.libsvm (57,722 rows) and test.libsvm (28,860 rows): we train
on valid.libsvm minus a held-out part used for early stopping, and report on
test.libsvm. The licence forbids copying the data, so nothing is ever written.

    load_libsvm(path)                  -> (ids [N, F] int32, labels [N] float32)
    load_frappe(data_dir, holdout_fraction, seed)
        -> FrappeData(train, holdout, test: (ids, labels), num_features, num_fields)
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

DEFAULT_DIR = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                            "..", "..", "..", "shared", "datasets", "frappe"))


def load_libsvm(path: str) -> tuple[np.ndarray, np.ndarray]:
    """One libsvm file of one-hot fields -> (ids [N, F] int32, labels [N] float32 in {0, 1}).

    Raises ValueError naming the file and line on a malformed row (a label other
    than 0/1, a value other than 1, a field count differing from the first row).
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"frappe: {path} not found (pass --data_dir)")
    labels, rows = [], []
    width = None
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            parts = line.split()
            if not parts:
                continue
            try:
                label = float(parts[0])
                feats = [p.split(":") for p in parts[1:]]
                ids = [int(i) for i, _ in feats]
                vals = [float(v) for _, v in feats]
            except ValueError as e:
                raise ValueError(f"frappe: {path}:{lineno}: cannot parse {line.strip()!r}") from e
            if label not in (0.0, 1.0) or any(v != 1.0 for v in vals) or min(ids, default=0) < 0:
                raise ValueError(f"frappe: {path}:{lineno}: expected label 0/1 and id:1 pairs "
                                 f"with ids >= 0, got {line.strip()!r}")
            if width is None:
                width = len(ids)
            if len(ids) != width:
                raise ValueError(f"frappe: {path}:{lineno}: {len(ids)} fields, the first row "
                                 f"had {width}")
            labels.append(label)
            rows.append(ids)
    if not rows:
        raise ValueError(f"frappe: {path} holds no rows")
    return np.asarray(rows, np.int32), np.asarray(labels, np.float32)


@dataclasses.dataclass(frozen=True)
class FrappeData:
    train: tuple[np.ndarray, np.ndarray]
    holdout: tuple[np.ndarray, np.ndarray]
    test: tuple[np.ndarray, np.ndarray]
    num_features: int        # vocabulary: max id over all files + 1
    num_fields: int


def load_frappe(data_dir: str = DEFAULT_DIR, holdout_fraction: float = 0.2,
                seed: int = 0) -> FrappeData:
    """valid.libsvm split at random into train / holdout (early stopping); test.libsvm."""
    if not 0.0 < holdout_fraction < 1.0:
        raise ValueError(f"frappe: holdout_fraction must be in (0, 1), got {holdout_fraction}")
    ids, y = load_libsvm(os.path.join(data_dir, "valid.libsvm"))
    test_ids, test_y = load_libsvm(os.path.join(data_dir, "test.libsvm"))
    if test_ids.shape[1] != ids.shape[1]:
        raise ValueError(f"frappe: test has {test_ids.shape[1]} fields, valid {ids.shape[1]}")
    perm = np.random.default_rng(seed).permutation(len(y))
    n_hold = int(round(holdout_fraction * len(y)))
    hold, train = perm[:n_hold], perm[n_hold:]
    num_features = int(max(ids.max(), test_ids.max())) + 1
    return FrappeData((ids[train], y[train]), (ids[hold], y[hold]), (test_ids, test_y),
                      num_features, ids.shape[1])
