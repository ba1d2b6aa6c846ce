"""Frappe CTR -> Parquet splits + schema.json for gemjax.data.parquet.ParquetSource.

    python -m experiments.convert_frappe --out=/tmp/gemjax-data/frappe [--seed=0]

Reads ../shared/datasets/frappe (or --data_dir) in place through
gemjax.data.frappe.load_frappe (experiments/frappe.py converts through `convert`):
train = valid.libsvm minus a seeded --holdout_fraction, holdout = that part (model
selection: the validation rows of the preset `frappe`, data.valid_path=holdout.parquet,
on which it picks its best step and stops early), test = test.libsvm. Writes into --out (outside any git work tree: the
licence forbids redistribution):

  train.parquet, holdout.parquet, test.parquet   one row per sample: one int32 column
      per field (user, item, daytime, weekday, isweekend, homework, cost, weather,
      country, city; field_1.. when a file has another field count) holding the
      loader's table rows, and a float32 "label" column (0/1)
  schema.json   the FeatureSchema (gemjax.features): every field reads the one
      shared table "feature" of all ids of both files, as the preset `frappe`'s models
      do; gemjax.data.parquet.columns_from_schema maps it to ParquetColumns
  counts.json   rows and positive share per split, table rows, the raw id of each row

Rows keep load_frappe's order (train and holdout in its seeded permutation, test in
file order), in row groups of --row_group_rows.
"""

from __future__ import annotations

import os
import time

from absl import app, flags

FIELDS = ("user", "item", "daytime", "weekday", "isweekend", "homework", "cost", "weather",
          "country", "city")
TABLE = "feature"


def field_names(num_fields: int) -> tuple[str, ...]:
    """Frappe's 10 field names, or field_1..field_F for another field count."""
    return FIELDS if num_fields == len(FIELDS) else tuple(f"field_{j + 1}"
                                                           for j in range(num_fields))


def frappe_schema(num_features: int, num_fields: int):
    """Every field one sparse feature of the shared table; one task, "label"."""
    from gemjax.features import FeatureSchema, SparseFeature, Table
    return FeatureSchema(tables=(Table(TABLE, num_features),),
                         sparse=tuple(SparseFeature(n, TABLE) for n in field_names(num_fields)),
                         tasks=("label",))


def _chunks(ids, labels, names, rows_per_group):
    import numpy as np
    import pyarrow as pa
    for lo in range(0, len(labels), rows_per_group):
        hi = min(lo + rows_per_group, len(labels))
        cols = {n: pa.array(np.ascontiguousarray(ids[lo:hi, j], np.int32))
                for j, n in enumerate(names)}
        cols["label"] = pa.array(labels[lo:hi].astype(np.float32))
        yield pa.table(cols)


def convert(data_dir: str, out: str, seed: int = 0, holdout_fraction: float = 0.2,
            row_group_rows: int = 8192) -> dict:
    """Write the splits, schema.json and counts.json into `out`; returns the counts."""
    import numpy as np

    from gemjax.data.frappe import load_frappe
    from gemjax.data.parquet_writer import check_out_dir, write_json, write_split

    if row_group_rows < 1:
        raise ValueError(f"--row_group_rows must be >= 1, got {row_group_rows}")
    out = check_out_dir(out)
    data = load_frappe(data_dir, holdout_fraction, seed)
    schema = frappe_schema(data.num_features, data.num_fields)
    names = schema.sparse_names
    counts = {"dataset": "frappe", "data_dir": os.path.abspath(data_dir), "seed": seed,
              "holdout_fraction": holdout_fraction, "table_rows": data.num_features,
              "fields": list(names), "splits": {}}
    for split in ("train", "holdout", "test"):
        ids, y = getattr(data, split)
        written = write_split(os.path.join(out, f"{split}.parquet"),
                              _chunks(ids, y, names, row_group_rows))
        counts["splits"][split] = {**written, "positive_share": float(np.mean(y))}
    write_json(os.path.join(out, "schema.json"), schema.to_dict())
    counts["raw_id_of_row"] = data.raw_ids.tolist()
    write_json(os.path.join(out, "counts.json"), counts)
    return counts


def define_flags():
    """The command line's flags (defined when run as a script, so that tests can import
    this module beside other scripts defining the same names)."""
    flags.DEFINE_string("data_dir", None, "frappe directory (default ../shared/datasets/frappe)")
    flags.DEFINE_string("out", None, "output directory (outside any git work tree)")
    flags.DEFINE_integer("seed", 0, "seed of the train / holdout split "
                         "(experiments/frappe.py --seed)")
    flags.DEFINE_float("holdout_fraction", 0.2, "share of valid.libsvm held out for early stopping")
    flags.DEFINE_integer("row_group_rows", 8192, "rows per Parquet row group")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    f = flags.FLAGS
    if not f.out:
        raise app.UsageError("--out is required (a directory outside the repository)")
    from gemjax.data.frappe import DEFAULT_DIR
    t0 = time.time()
    counts = convert(f.data_dir or DEFAULT_DIR, f.out, f.seed, f.holdout_fraction,
                     f.row_group_rows)
    for split, c in counts["splits"].items():
        print(f"{split:8s} {c['rows']:8d} rows  {c['positive_share']:.1%} positive  "
              f"{c['bytes'] / 2**20:7.2f} MiB")
    print(f"wrote {f.out} in {time.time() - t0:.1f} s")


if __name__ == "__main__":
    define_flags()
    app.run(main)
