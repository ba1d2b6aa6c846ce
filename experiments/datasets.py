"""One command per public dataset: download (checksummed), convert to Parquet, say where.

    python -m experiments.datasets --name=ml-1m|ml-20m|frappe|books \\
        [--out=/tmp/gemjax-data] [--data_dir=DIR] [--url=URL [--sha256=HEX]] \\
        [--books_min_count=5] [--books_kcore]

Steps, each skipped on a rerun once done (a download that was cut resumes its .part):
  1. source: --data_dir, else ../shared/datasets/<name> when it exists, else the
     manifest's archive (gemjax.data.download.MANIFEST) fetched into
     <out>/<name>/download/ (checksummed; --url fetches from a mirror, --sha256 names
     the digest of a file other than the manifest's) and unpacked into <out>/<name>/raw/.
  2. staging, into <out>/<name>/source/, for the layouts the converters read:
     MovieLens raw files (ml-1m .dat, ml-20m .csv: gemjax.data.movielens_raw) and
     ratings_Books.csv (gemjax.data.amazon: ratings of users and items with
     >= --books_min_count ratings in the file, as HSTU; --books_kcore iterates to the
     k-core) become train.csv.zip + test.csv as gemjax.data.movielens.load_movielens
     reads them; Frappe_x1's csv files become train/valid/test.libsvm.
     A copy already in those layouts (the shared ml-1m and frappe) is read in place.
  3. conversion with the project's converters and their default options:
     experiments/convert_movielens.py (ml-1m, ml-20m, books: <out>/<name>/ranking/ and
     retrieval/, each train.parquet, test.parquet, schema.json, counts.json) and
     experiments/convert_frappe.py (frappe: <out>/frappe/train, holdout, test.parquet,
     schema.json, counts.json).
It prints each Parquet file with its row count and each schema.json. counts.json's
"dataset" names the public dataset and "source" where it came from.

The datasets' licences forbid redistribution: --out must lie outside any git work tree.
"""

from __future__ import annotations

import csv
import json
import os
import tempfile
import time

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.normpath(os.path.join(ROOT, "..", "shared", "datasets"))
NAMES = ("ml-1m", "ml-20m", "frappe", "books")
FRAPPE_SPLITS = ("train", "valid", "test")
# the files that identify each layout a source folder may hold
LAYOUTS = {
    "movielens": ("train.csv.zip", "test.csv"),
    "ml-1m-raw": ("ratings.dat", "users.dat", "movies.dat"),
    "ml-20m-raw": ("ratings.csv", "movies.csv"),
    "books-raw": ("ratings_Books.csv",),
    "libsvm": ("valid.libsvm", "test.libsvm"),
    "frappe-csv": ("valid.csv", "test.csv"),
}
ACCEPTS = {"ml-1m": ("movielens", "ml-1m-raw"), "ml-20m": ("movielens", "ml-20m-raw"),
           "books": ("movielens", "books-raw"), "frappe": ("libsvm", "frappe-csv")}


def detect_layout(name: str, directory: str) -> str | None:
    """The first layout of ACCEPTS[name] whose files all exist in directory, or None."""
    for layout in ACCEPTS[name]:
        if all(os.path.exists(os.path.join(directory, f)) for f in LAYOUTS[layout]):
            return layout
    return None


def _fingerprint(directory: str, files) -> list:
    """[name, size, mtime_ns] of each file: what a finished step was made from."""
    out = []
    for f in files:
        st = os.stat(os.path.join(directory, f))
        out.append([f, st.st_size, st.st_mtime_ns])
    return out


def _read_json(path: str):
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _write_json(path: str, obj) -> None:
    from gemjax.data.parquet_writer import write_json
    write_json(path, obj)


def find_source(name: str, data_dir: str | None, root: str, url=None, sha256=None,
                log=print) -> tuple[str, str, dict]:
    """(layout, directory, description) of the data to convert: --data_dir, the shared
    copy (unless url / sha256 ask for a download), else the manifest's download unpacked
    into root/raw."""
    from gemjax.data import download as dl

    if data_dir:
        layout = detect_layout(name, data_dir)
        if layout is None:
            want = " or ".join("+".join(LAYOUTS[k]) for k in ACCEPTS[name])
            raise ValueError(f"--data_dir={data_dir}: no {name} files there (expected {want})")
        return layout, data_dir, {"local": os.path.abspath(data_dir)}
    shared = os.path.join(SHARED, name)
    if not (url or sha256) and os.path.isdir(shared) and detect_layout(name, shared):
        log(f"{name}: reading the local copy {shared}")
        return detect_layout(name, shared), shared, {"local": shared}
    raw = os.path.join(root, "raw")
    fetched = []
    for art in dl.MANIFEST[name].artifacts:
        path = dl.fetch_artifact(art, os.path.join(root, "download"), url=url, sha256=sha256,
                                 log=log)
        n, sha, _ = dl.file_digests(path)
        fetched.append({"file": art.filename, "url": url or art.urls[0], "sha256": sha,
                        "bytes": n})
        if art.members:
            dl.unpack(path, art.members, raw)
        else:
            os.makedirs(raw, exist_ok=True)
            link = os.path.join(raw, art.filename)
            if not os.path.exists(link):
                os.symlink(os.path.abspath(path), link)
    layout = detect_layout(name, raw)
    if layout is None:
        raise ValueError(f"{name}: {raw} lacks the expected files after unpacking")
    return layout, raw, {"downloaded": fetched}


def _frappe_csv_to_libsvm(src: str, dst: str) -> int:
    """One BARS Frappe_x1 csv (header `label,user,item,...`, integer feature ids) ->
    libsvm `label id:1 ...` written to dst atomically; returns the row count."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(dst), prefix=".libsvm-")
    n = 0
    try:
        with open(src, newline="") as f, os.fdopen(fd, "w") as out:
            reader = csv.reader(f)
            header = next(reader, None)
            if not header or header[0].strip() != "label":
                raise ValueError(f"frappe: {src}:1: expected a header starting with 'label', "
                                 f"got {header!r}")
            for lineno, row in enumerate(reader, 2):
                if not row:
                    continue
                if len(row) != len(header):
                    raise ValueError(f"frappe: {src}:{lineno}: {len(row)} fields, expected "
                                     f"{len(header)} ({','.join(header)})")
                bad = [(h, v) for h, v in zip(header, row)
                       if not (v.strip().isascii() and v.strip().isdigit())]
                if bad:
                    raise ValueError(f"frappe: {src}:{lineno}: field {bad[0][0]}: "
                                     f"{bad[0][1]!r} is not a non-negative integer")
                out.write(row[0].strip() + " " + " ".join(f"{v.strip()}:1" for v in row[1:])
                          + "\n")
                n += 1
        os.replace(tmp, dst)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return n


def stage(name: str, layout: str, src: str, root: str, min_count: int = 5,
          kcore: bool = False, log=print) -> tuple[str, dict]:
    """(directory in the converter's layout, loader stats): src itself when it already is
    one, else root/source written from the raw files (skipped when source/DONE.json
    records the same inputs and options)."""
    if layout in ("movielens", "libsvm"):
        return src, {}
    out = os.path.join(root, "source")
    done_path = os.path.join(out, "DONE.json")
    key = {"layout": layout, "inputs": _fingerprint(src, LAYOUTS[layout])}
    if layout == "books-raw":
        key.update(min_count=min_count, kcore=kcore)
    done = _read_json(done_path)
    if done is not None and done.get("key") == key:
        log(f"{name}: staged files up to date in {out}")
        return out, done.get("stats", {})
    os.makedirs(out, exist_ok=True)
    if os.path.exists(done_path):
        os.remove(done_path)
    t0 = time.time()
    stats = {}
    if layout == "frappe-csv":
        splits = [s for s in FRAPPE_SPLITS if os.path.exists(os.path.join(src, f"{s}.csv"))]
        for s in splits:
            stats[f"{s}_rows"] = _frappe_csv_to_libsvm(os.path.join(src, f"{s}.csv"),
                                                       os.path.join(out, f"{s}.libsvm"))
    else:
        from gemjax.data.movielens_raw import load_ml1m, load_ml20m, write_movielens_files
        if layout == "books-raw":
            from gemjax.data.amazon import load_books
            ml, stats = load_books(os.path.join(src, "ratings_Books.csv"), min_count, kcore)
        else:
            ml = (load_ml1m if layout == "ml-1m-raw" else load_ml20m)(src)
        stats.update(users=len(ml.histories), items=int(ml.item_present.sum()),
                     interactions=int(sum(len(h) for h in ml.histories) + len(ml.test_items)))
        write_movielens_files(ml, out)
    stats["seconds"] = round(time.time() - t0, 1)
    _write_json(done_path, {"key": key, "stats": stats})
    log(f"{name}: staged {src} -> {out} ({stats})")
    return out, stats


def _outputs(name: str, root: str) -> list[str]:
    """The counts.json files the converter writes for name under root."""
    if name == "frappe":
        return [os.path.join(root, "counts.json")]
    return [os.path.join(root, t, "counts.json") for t in ("ranking", "retrieval")]


def convert(name: str, source: str, root: str, about: dict, log=print) -> list[str]:
    """Run the dataset's converter on source into root unless converted.json records the
    same source; returns the counts.json paths."""
    files = LAYOUTS["libsvm" if name == "frappe" else "movielens"]
    key = {"source": os.path.abspath(source), "inputs": _fingerprint(source, files)}
    marker = os.path.join(root, "converted.json")
    outs = _outputs(name, root)
    if _read_json(marker) == key and all(os.path.exists(p) for p in outs):
        log(f"{name}: Parquet up to date in {root}")
        return outs
    if os.path.exists(marker):
        os.remove(marker)
    if name == "frappe":
        from experiments import convert_frappe
        convert_frappe.convert(source, root)
    else:
        from experiments import convert_movielens
        convert_movielens.convert(source, root)
    for p in outs:
        counts = _read_json(p)
        counts["dataset"] = name
        counts["source"] = about
        _write_json(p, counts)
    _write_json(marker, key)
    return outs


def prepare(name: str, out: str, data_dir: str | None = None, url: str | None = None,
            sha256: str | None = None, min_count: int = 5, kcore: bool = False,
            log=print) -> dict:
    """Every step for one dataset; returns {"root", "parquet": {path: rows},
    "schemas": [paths], "source": description}."""
    from gemjax.data.parquet_writer import check_out_dir

    if name not in NAMES:
        raise ValueError(f"--name={name}: choose from {NAMES}")
    if (url or sha256) and data_dir:
        raise ValueError("--url / --sha256 download; --data_dir reads a local copy: pass one")
    root = check_out_dir(os.path.join(out, name))
    layout, src, about = find_source(name, data_dir, root, url, sha256, log)
    source, stats = stage(name, layout, src, root, min_count, kcore, log)
    about = {**about, "layout": layout, **({"loader": stats} if stats else {})}
    outs = convert(name, source, root, about, log)
    parquet, schemas = {}, []
    for p in outs:
        d = os.path.dirname(p)
        for split, c in _read_json(p)["splits"].items():
            parquet[os.path.join(d, f"{split}.parquet")] = c["rows"]
        schemas.append(os.path.join(d, "schema.json"))
    return {"root": root, "parquet": parquet, "schemas": schemas, "source": about}


def define_flags():
    flags.DEFINE_enum("name", None, list(NAMES), "dataset to fetch and convert")
    flags.DEFINE_string("out", "/tmp/gemjax-data", "output folder (outside any git work "
                        "tree); the dataset goes to <out>/<name>/")
    flags.DEFINE_string("data_dir", None, "read this local copy instead (raw GroupLens "
                        "files, ratings_Books.csv, Frappe csv / libsvm, or the "
                        "train.csv.zip + test.csv layout); default: ../shared/datasets/<name> "
                        "when present, else download")
    flags.DEFINE_string("url", None, "download from this URL (a mirror) instead of the "
                        "manifest's; its checksum still applies unless --sha256 is given")
    flags.DEFINE_string("sha256", None, "expected sha256 of the --url file when it is not the "
                        "manifest's file")
    flags.DEFINE_integer("books_min_count", 5, "books: keep ratings whose user and item each "
                         "have at least this many ratings (HSTU: 5)")
    flags.DEFINE_bool("books_kcore", False, "books: repeat that filter until it holds on the "
                      "kept ratings (the k-core) instead of counting once on the whole file")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    f = flags.FLAGS
    if not f.name:
        raise app.UsageError(f"--name is required: one of {', '.join(NAMES)}")
    t0 = time.time()
    result = prepare(f.name, f.out, f.data_dir, f.url, f.sha256, f.books_min_count,
                     f.books_kcore)
    for path, rows in result["parquet"].items():
        print(f"parquet {path}  {rows} rows")
    for path in result["schemas"]:
        print(f"schema  {path}")
    print(f"{f.name}: done in {time.time() - t0:.1f} s (source: {json.dumps(result['source'])})")


if __name__ == "__main__":
    define_flags()
    app.run(main)
