"""Embedding-table rows for the raw categorical ids a reader found in its files.

A table indexed by raw ids has max_id + 1 rows, which is harmless for ids that are
nearly dense (the shipped Frappe and MovieLens files: 5,382 rows for 5,328 ids, 3,953
rows for 3,706 items) and unbounded for hashed or 64-bit ids (one id of 1e12 asks for
a 7.28 TiB table). table_rows keeps the raw ids as row numbers while the table stays
within 2 * (distinct + first) + SLACK rows and below 2**31 (int32 indices), so results
on nearly dense data do not depend on this module; beyond that it maps the ids present,
in increasing order, to rows first .. first + distinct - 1.

    table_rows(ids, first=0) -> (rows: ids' shape int64, raw_of_row: [R] int64)

Rows below `first` are reserved (MovieLens's padding item 0) and keep their numbers.
"""

from __future__ import annotations

import numpy as np

SLACK = 65_536          # unused rows always allowed (at most 256 KiB per float32 column)


def table_rows(ids: np.ndarray, first: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """ids: int64 array (any shape) of raw ids >= first -> (the row of each id, same shape,
    int64; raw_of_row [R] int64: the raw id each of the table's R rows stands for).

    R = max(ids) + 1 with rows = ids while that is at most 2 * (distinct + first) + SLACK
    and below 2**31; otherwise R = first + distinct and rows are the ids' ranks among the
    distinct ids, plus first.
    """
    ids = np.asarray(ids, np.int64)
    if ids.size and int(ids.min()) < first:
        raise ValueError(f"table_rows: ids must be >= {first}, got {int(ids.min())}")
    if not ids.size:
        return ids.copy(), np.arange(first, dtype=np.int64)
    distinct, rows = np.unique(ids, return_inverse=True)
    top = int(distinct[-1])
    if top + 1 <= 2 * (len(distinct) + first) + SLACK and top < 2**31 - 1:
        return ids.copy(), np.arange(top + 1, dtype=np.int64)
    raw_of_row = np.concatenate([np.arange(first, dtype=np.int64), distinct])
    return rows.reshape(ids.shape).astype(np.int64) + first, raw_of_row
