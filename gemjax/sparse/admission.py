"""New-id admission: raw ids (unbounded, ever new) -> rows of a fixed-size table.

    adm = FrequencyAdmission(rows=400, min_count=3, buckets=16)
    rows, hashed = adm.lookup(raw_ids)     # int32 rows like raw_ids; no state change
    stats = adm.observe(raw_ids)           # count the ids; admit those reaching min_count

Rows [0, buckets) are shared: an id that has no row of its own reads row
hash(id) % buckets (buckets = 1: one shared default row); rows [buckets, rows) go
to admitted ids, in admission order. `observe` walks the ids in order: an id is
admitted at the occurrence that brings its count to min_count, while rows remain;
an id that qualifies when every row is taken stays hashed for good (counted
`refused`). Lookups of a batch are decided before the batch is observed, so an id
reads its own row from the batch after the one that admitted it.

`state()` is a JSON-serialisable dict of everything (counts, rows, totals) and
`FrequencyAdmission.from_state` rebuilds it: checkpoints carry it, so a resumed
run admits exactly the ids an uninterrupted one does.

Host-side numpy; cost per call O(n log n) in the ids given plus a dict access per
distinct id.
"""

from __future__ import annotations

import numpy as np

_HASH_MULT = np.uint64(2_654_435_761)
_HASH_MASK = np.uint64(0xFFFFFFFF)


def bucket_of(raw: np.ndarray, buckets: int) -> np.ndarray:
    """The shared row of each raw id: (id * 2654435761 mod 2^32) mod buckets (int64)."""
    h = (np.asarray(raw).astype(np.uint64) * _HASH_MULT) & _HASH_MASK
    return (h % np.uint64(buckets)).astype(np.int64)


class FrequencyAdmission:
    """Frequency admission for one table (module docstring). Totals since the start:
    `lookups`, `hashed` (lookups read from a shared row), `seen` (distinct ids),
    `admitted`, `refused`."""

    def __init__(self, rows: int, min_count: int = 1, buckets: int = 1):
        if not 1 <= buckets < rows:
            raise ValueError(f"admission: buckets must be in [1, rows={rows}), got {buckets}")
        if min_count < 1:
            raise ValueError(f"admission: min_count must be >= 1, got {min_count}")
        self.rows, self.min_count, self.buckets = int(rows), int(min_count), int(buckets)
        self.counts: dict[int, int] = {}
        self.row_of: dict[int, int] = {}
        self.next_row = self.buckets
        self.totals = {"lookups": 0, "hashed": 0, "seen": 0, "admitted": 0, "refused": 0}

    def lookup(self, raw, count: bool = True) -> tuple[np.ndarray, int]:
        """(rows int32 shaped like `raw`, how many of them are shared rows); with `count`,
        added to totals["lookups"] / ["hashed"]."""
        raw = np.asarray(raw, np.int64)
        if raw.size and raw.min() < 0:
            raise ValueError(f"admission: raw ids must be >= 0, got {raw.min()}")
        uniq, inv = np.unique(raw.ravel(), return_inverse=True)
        own = np.array([self.row_of.get(int(u), -1) for u in uniq], np.int64)
        rows = np.where(own >= 0, own, bucket_of(uniq, self.buckets))[inv]
        hashed = int((own[inv] < 0).sum())
        if count:
            self.totals["lookups"] += int(raw.size)
            self.totals["hashed"] += hashed
        return rows.reshape(raw.shape).astype(np.int32), hashed

    def observe(self, raw) -> dict[str, int]:
        """Count the ids of `raw` (in order) and admit the ones reaching min_count;
        returns {"new_ids", "admitted", "refused"} of this call."""
        raw = np.asarray(raw, np.int64).ravel()
        if raw.size == 0:
            return {"new_ids": 0, "admitted": 0, "refused": 0}
        uniq, first, inv, cnt = np.unique(raw, return_index=True, return_inverse=True,
                                          return_counts=True)
        prior = np.array([self.counts.get(int(u), 0) for u in uniq], np.int64)
        has_row = np.array([int(u) in self.row_of for u in uniq], bool)
        # ids that reach min_count in this call: the occurrence where they cross it
        cand = ~has_row & (prior < self.min_count) & (prior + cnt >= self.min_count)
        by_id = np.argsort(inv, kind="stable")                 # positions grouped by id, in order
        starts = np.concatenate([[0], np.cumsum(cnt)[:-1]])
        cross = by_id[starts[cand] + (self.min_count - prior[cand]) - 1]
        admitted = refused = 0
        for u in uniq[cand][np.argsort(cross, kind="stable")]:
            if self.next_row < self.rows:
                self.row_of[int(u)] = self.next_row
                self.next_row += 1
                admitted += 1
            else:
                refused += 1
        for u, c in zip(uniq.tolist(), cnt.tolist()):
            self.counts[u] = self.counts.get(u, 0) + c
        new_ids = int((prior == 0).sum())
        self.totals["seen"] += new_ids
        self.totals["admitted"] += admitted
        self.totals["refused"] += refused
        return {"new_ids": new_ids, "admitted": admitted, "refused": refused}

    def state(self) -> dict:
        """Everything, as JSON values (ids in increasing order)."""
        ids = sorted(self.counts)
        return {"rows": self.rows, "min_count": self.min_count, "buckets": self.buckets,
                "ids": ids, "counts": [self.counts[i] for i in ids],
                "own_rows": [self.row_of.get(i, -1) for i in ids],
                "next_row": self.next_row, "totals": dict(self.totals)}

    @classmethod
    def from_state(cls, state: dict) -> "FrequencyAdmission":
        """The admission `state()` describes."""
        adm = cls(state["rows"], state["min_count"], state["buckets"])
        adm.counts = dict(zip(state["ids"], state["counts"]))
        adm.row_of = {i: r for i, r in zip(state["ids"], state["own_rows"]) if r >= 0}
        adm.next_row = int(state["next_row"])
        adm.totals = dict(state["totals"])
        return adm

    def copy(self) -> "FrequencyAdmission":
        return FrequencyAdmission.from_state(self.state())
