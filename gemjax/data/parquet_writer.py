"""Writing a converted dataset: Parquet splits + schema.json that ParquetSource reads.

    out = check_out_dir(flags.out)                    # refuses a git work tree (licences)
    write_split(os.path.join(out, "train.parquet"), chunks)   # each pa.Table chunk: one row group
    write_json(os.path.join(out, "schema.json"), schema.to_dict())
    cols = columns_from_schema(FeatureSchema.from_dict(json.load(open(".../schema.json"))))
    src = ParquetSource(os.path.join(out, "train.parquet"), cols, batch_size=512)

Column convention (one row = one sample), the one `parquet.columns_from_schema` reads back:
  sparse feature f          column f, integer ids in [0, table vocab)
  sequence s, field f       column parquet.sequence_column(s, f) = "s_f", list<int32>, oldest
                            event first
  task t                    column t, 0/1 label
  weight / surface          schema.weight_column / schema.surface_column

The datasets' licences (MovieLens, Frappe) forbid redistribution, so converted copies
must never land in a repository: `check_out_dir` refuses any directory inside a git
work tree.
"""

from __future__ import annotations

import json
import os
from typing import Iterable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq



def _git_work_tree(path: str) -> str | None:
    """The top of the git work tree holding `path` (which may not exist yet), or None."""
    p = path
    while True:
        if os.path.exists(os.path.join(p, ".git")):
            return p
        parent = os.path.dirname(p)
        if parent == p:
            return None
        p = parent


def check_out_dir(out: str) -> str:
    """The absolute output directory, created; ValueError when it lies inside a git work
    tree (this repository or any other: the datasets may not be committed)."""
    if not out:
        raise ValueError("--out: an output directory outside the repository is required")
    path = os.path.realpath(os.path.abspath(out))
    repo = _git_work_tree(path)
    if repo is not None:
        raise ValueError(f"--out={out}: {path} lies inside the git work tree {repo}; the "
                         f"datasets' licences forbid redistribution, so converted copies go "
                         f"outside any repository (e.g. /tmp/gemjax-data)")
    os.makedirs(path, exist_ok=True)
    return path


def list_array(offsets: np.ndarray, values: np.ndarray) -> pa.ListArray:
    """list<int32> column of R rows: row r = values[offsets[r]:offsets[r + 1]] (a
    large_list when the values outgrow int32 offsets).

    offsets [R + 1] int (offsets[0] = 0, nondecreasing), values [offsets[-1]] int."""
    values = pa.array(np.asarray(values, np.int32))
    if int(offsets[-1]) < 2**31:
        return pa.ListArray.from_arrays(pa.array(np.asarray(offsets, np.int32)), values)
    return pa.LargeListArray.from_arrays(pa.array(np.asarray(offsets, np.int64)), values)


def write_split(path: str, chunks: Iterable[pa.Table], compression: str = "zstd") -> dict:
    """Write the chunks (same schema) as one Parquet file, one row group per chunk;
    written to a temporary name and renamed, so a killed run leaves no partial split.
    Returns {"rows", "row_groups", "bytes"}."""
    tmp = path + ".partial"
    writer, rows, groups = None, 0, 0
    try:
        for table in chunks:
            if writer is None:
                writer = pq.ParquetWriter(tmp, table.schema, compression=compression)
            if table.num_rows:
                writer.write_table(table, row_group_size=table.num_rows)
                rows += table.num_rows
                groups += 1
        if writer is None:
            raise ValueError(f"{path}: nothing to write")
        writer.close()
        writer = None
        os.replace(tmp, path)
    finally:
        if writer is not None:
            writer.close()
        if os.path.exists(tmp):
            os.remove(tmp)
    return {"rows": rows, "row_groups": groups, "bytes": os.path.getsize(path)}


def write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
