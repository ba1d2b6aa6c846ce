"""The Parquet files a run reads: a path, directory or glob resolved to files, and the
facts (bytes, rows, mtime) that tell a resume whether its input changed.

    list_files("data/train")          -> sorted *.parquet paths (recursive)
    file_facts("data/*.parquet")      -> [{"path", "bytes", "rows", "mtime_ns"}]
    file_changes(before, now)         -> ["added ...", "removed ...", "changed ..."]

Only the footers are read (pyarrow), never the rows: the trainer's file checks and refit
use these without building a data source.
"""

from __future__ import annotations

import glob as globlib
import os
from typing import Sequence

import pyarrow.parquet as pq


def list_files(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    """Parquet files of a directory (recursive, sorted), a glob (sorted), a file, or a list."""
    if isinstance(paths, (str, os.PathLike)):
        p = os.fspath(paths)
        if os.path.isdir(p):
            found = [os.path.join(d, f) for d, _, fs in os.walk(p) for f in fs if f.endswith(".parquet")]
            if not found:
                raise FileNotFoundError(f"parquet: no *.parquet files under {p}")
            return sorted(found)
        if any(ch in p for ch in "*?["):
            found = sorted(globlib.glob(p, recursive=True))
            if not found:
                raise FileNotFoundError(f"parquet: no files match {p}")
            return found
        if not os.path.exists(p):
            raise FileNotFoundError(f"parquet: {p} not found")
        return [p]
    out = []
    for p in paths:
        out.extend(list_files(p))
    if not out:
        raise FileNotFoundError("parquet: empty list of paths")
    return out


def file_facts(paths) -> list[dict]:
    """[{"path", "bytes", "rows", "mtime_ns"}] of each file `paths` names (list_files
    order; paths as list_files gives them, relative where `paths` is): what the index and
    every epoch's shuffle are built from. Sizes and mtimes from stat, rows from the
    footers (a file whose footer does not read: rows None)."""
    out = []
    for path in list_files(paths):
        st = os.stat(path)
        try:
            rows = pq.ParquetFile(path).metadata.num_rows
        except Exception:  # noqa: BLE001 - the source itself names an unreadable file
            rows = None
        out.append({"path": path, "bytes": st.st_size, "rows": rows,
                    "mtime_ns": st.st_mtime_ns})
    return out


def file_changes(before: Sequence[dict], now: Sequence[dict]) -> list[str]:
    """One line per file added, removed or changed (bytes or rows) between two
    `file_facts` lists; [] when the same files hold the same rows. mtimes alone (a
    copy, a touch) are no change."""
    old, new = {f["path"]: f for f in before}, {f["path"]: f for f in now}
    out = [f"added {p} ({new[p]['rows']} rows)" for p in sorted(set(new) - set(old))]
    out += [f"removed {p} ({old[p]['rows']} rows)" for p in sorted(set(old) - set(new))]
    for p in sorted(set(old) & set(new)):
        a, b = old[p], new[p]
        if (a["bytes"], a["rows"]) != (b["bytes"], b["rows"]):
            out.append(f"changed {p} ({a['rows']} rows, {a['bytes']} bytes -> {b['rows']} rows, "
                       f"{b['bytes']} bytes)")
    return out
