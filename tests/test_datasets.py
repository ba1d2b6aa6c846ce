"""The real-data on-ramp (gemjax/data/download.py, movielens_raw.py, amazon.py,
experiments/datasets.py) on tiny archives built here and served from a loopback HTTP
server (127.0.0.1, an ephemeral port, shut down by the fixture) or file:// URLs.

References are independent: each user's sequence is sorted in plain Python from the
lines the test wrote; the 5-core filter is counted with dicts; downloads are compared
byte for byte with the served bytes.
"""

import hashlib
import http.server
import io
import json
import os
import subprocess
import sys
import threading
import zipfile
from collections import Counter, defaultdict

import numpy as np
import pyarrow.parquet as pq
import pytest

from experiments import datasets as ds
from gemjax.data import download as dl
from gemjax.data.amazon import core_filter, load_books
from gemjax.data.movielens import load_movielens
from gemjax.data.movielens_raw import load_ml1m, load_ml20m, write_movielens_files

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GENRES = ("Action", "Comedy", "Drama", "Romance")


# ------------------------------------------------------------------------------ fixtures

def ml1m_events(seed=0, users=7, items=15):
    """(ratings [(user, item, time)] in file order, users {uid: (gender, age, occ)},
    movies {item: genres list}); timestamps collide often (ties keep file order)."""
    rng = np.random.default_rng(seed)
    movies = {int(i): [GENRES[j] for j in rng.permutation(4)[:1 + int(rng.integers(3))]]
              for i in rng.choice(np.arange(1, 60), items, replace=False)}
    ids = sorted(movies)
    uids = sorted(int(u) for u in rng.choice(np.arange(1, 40), users, replace=False))
    feats = {u: ("FM"[int(rng.integers(2))], int(rng.choice([1, 18, 25])), int(rng.integers(21)))
             for u in uids}
    ratings = []
    for u in uids:
        for i in rng.choice(ids, int(rng.integers(3, 9)), replace=False):
            ratings.append((u, int(i), int(rng.integers(5))))
    order = rng.permutation(len(ratings))
    return [ratings[k] for k in order], feats, movies


def ml1m_zip(ratings, feats, movies) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("ml-1m/ratings.dat", "".join(f"{u}::{i}::{1 + (u + i) % 5}::{t}\n"
                                                for u, i, t in ratings))
        z.writestr("ml-1m/users.dat", "".join(f"{u}::{g}::{a}::{o}::55{u:03d}\n"
                                              for u, (g, a, o) in feats.items()))
        z.writestr("ml-1m/movies.dat", "".join(f"{i}::Movie {i}: the sequel (19{i % 90})::"
                                               f"{'|'.join(g)}\n" for i, g in movies.items()))
        z.writestr("__MACOSX/ml-1m/._ratings.dat", b"\0junk")
    return buf.getvalue()


def reference_sequences(ratings):
    """{user: [items in time order, ties in file order]} by a plain Python sort."""
    per = defaultdict(list)
    for line, (u, i, t) in enumerate(ratings):
        per[u].append((t, line, i))
    return {u: [i for _, _, i in sorted(ev)] for u, ev in per.items()}


class Files(http.server.BaseHTTPRequestHandler):
    """Serves server.files {path: bytes}; honours `Range: bytes=N-` unless
    server.ignore_range; server.cut {path: n} sends the full Content-Length but only n
    bytes, then closes (an interrupted transfer). Every request is logged to server.seen."""

    def do_GET(self):
        srv = self.server
        srv.seen.append((self.path, self.headers.get("Range")))
        body = srv.files.get(self.path)
        if body is None:
            self.send_error(404)
            return
        rng = self.headers.get("Range")
        start = 0
        if rng and not srv.ignore_range:
            start = int(rng.split("=")[1].split("-")[0])
            if start >= len(body):
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{len(body)}")
                self.end_headers()
                return
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
        else:
            self.send_response(200)
        part = body[start:]
        self.send_header("Content-Length", str(len(part)))
        self.end_headers()
        cut = srv.cut.pop(self.path, None)
        self.wfile.write(part if cut is None else part[:cut])
        if cut is not None:
            self.wfile.flush()
            self.close_connection = True

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Files)
    srv.files, srv.seen, srv.cut, srv.ignore_range = {}, [], {}, False
    srv.daemon_threads = True
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    srv.url = f"http://127.0.0.1:{srv.server_address[1]}"
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()
        thread.join(timeout=5)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def quiet(*_):
    pass


# ------------------------------------------------------------------------------- download

def test_ml1m_download_and_convert_end_to_end(server, tmp_path):
    ratings, feats, movies = ml1m_events()
    blob = ml1m_zip(ratings, feats, movies)
    server.files["/ml-1m.zip"] = blob
    res = ds.prepare("ml-1m", str(tmp_path / "out"), url=server.url + "/ml-1m.zip",
                     sha256=sha(blob), log=quiet)
    root = tmp_path / "out" / "ml-1m"
    assert (root / "download" / "ml-1m.zip").read_bytes() == blob
    ref = reference_sequences(ratings)
    users = sorted(ref)
    # retrieval/test.parquet: one row per user (uid order): the last item after the rest
    t = pq.read_table(root / "retrieval" / "test.parquet").to_pydict()
    assert t["user"] == list(range(len(users)))
    assert t["item"] == [ref[u][-1] for u in users]          # ML-1M keeps raw ids as rows
    assert t["history_item"] == [ref[u][:-1] for u in users]
    n_train = sum(len(s) - 2 for s in ref.values())            # targets t = 1..L-1
    assert res["parquet"][str(root / "retrieval" / "train.parquet")] == n_train
    assert res["parquet"][str(root / "ranking" / "test.parquet")] == 5 * len(users)
    counts = json.loads((root / "ranking" / "counts.json").read_text())
    assert counts["dataset"] == "ml-1m" and counts["source"]["layout"] == "ml-1m-raw"
    assert counts["source"]["downloaded"][0]["sha256"] == sha(blob)
    # genre = the first listed genre; gender F/M, age, occupation as users.dat
    schema = json.loads((root / "ranking" / "schema.json").read_text())
    vocab = {tb["name"]: tb["vocab"] for tb in schema["tables"]}
    assert vocab["genre"] == len({movies[i][0] for u in ref for i in ref[u]})
    assert vocab["age"] == len({feats[u][1] for u in users})
    assert sorted(res["schemas"]) == sorted(str(root / k / "schema.json")
                                            for k in ("ranking", "retrieval"))
    # a rerun fetches nothing and rewrites nothing
    before = {p: os.stat(p).st_mtime_ns for p in res["parquet"]}
    server.seen.clear()
    again = ds.prepare("ml-1m", str(tmp_path / "out"), url=server.url + "/ml-1m.zip",
                       sha256=sha(blob), log=quiet)
    assert server.seen == [] and again["parquet"] == res["parquet"]
    assert {p: os.stat(p).st_mtime_ns for p in res["parquet"]} == before


def test_cli_prints_parquet_and_schema_paths(server, tmp_path):
    ratings, feats, movies = ml1m_events(seed=1, users=4)
    blob = ml1m_zip(ratings, feats, movies)
    server.files["/m.zip"] = blob
    cmd = [sys.executable, "-m", "experiments.datasets", "--name=ml-1m",
           f"--out={tmp_path / 'o'}", f"--url={server.url}/m.zip", f"--sha256={sha(blob)}"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    for task in ("ranking", "retrieval"):
        d = tmp_path / "o" / "ml-1m" / task
        assert f"schema  {d / 'schema.json'}" in lines
        for split in ("train", "test"):
            rows = pq.ParquetFile(d / f"{split}.parquet").metadata.num_rows
            assert f"parquet {d / f'{split}.parquet'}  {rows} rows" in lines
    bad = subprocess.run(cmd[:-1] + ["--sha256=" + "0" * 64], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode != 0 and "sha256 mismatch" in bad.stderr


def test_checksum_mismatch_is_refused_before_unpacking(server, tmp_path):
    blob = ml1m_zip(*ml1m_events())
    server.files["/ml-1m.zip"] = blob
    url = server.url + "/ml-1m.zip"
    want = "ab" * 32
    with pytest.raises(dl.ChecksumError) as e:
        ds.prepare("ml-1m", str(tmp_path / "out"), url=url, sha256=want, log=quiet)
    msg = str(e.value)
    assert url in msg and want in msg and sha(blob) in msg
    root = tmp_path / "out" / "ml-1m"
    assert not (root / "raw").exists() and not (root / "download" / "ml-1m.zip").exists()
    assert (root / "download" / "ml-1m.zip.rejected").read_bytes() == blob
    # the manifest's published digest refuses these bytes too (a mirror serving another file)
    with pytest.raises(dl.ChecksumError, match="expected 5917549 bytes"):
        dl.fetch_artifact(dl.MANIFEST["ml-1m"].artifacts[0], str(tmp_path / "d2"), url=url,
                          log=quiet)


def test_truncated_archive_is_refused_and_not_pinned(server, tmp_path):
    blob = ml1m_zip(*ml1m_events())
    server.files["/x.zip"] = blob[:len(blob) // 2]               # a cut upload on the server
    art = dl.Artifact("x.zip", (server.url + "/x.zip",), members=("ml-1m/ratings.dat",))
    d = tmp_path / "dl"
    with pytest.raises(dl.ArchiveError, match="x.zip.*truncated or damaged"):
        dl.fetch_artifact(art, str(d), log=quiet)
    assert not (d / dl.PINS).exists() and not (d / "x.zip").exists()
    # a zip whose member bytes are damaged (CRC) names the member; nothing is left behind
    buf = bytearray(blob)
    data_at = blob.index(b"ml-1m/ratings.dat") + len("ml-1m/ratings.dat")
    buf[data_at + 5] ^= 0xFF
    bad = tmp_path / "bad.zip"
    bad.write_bytes(bytes(buf))
    raw = tmp_path / "raw"
    with pytest.raises(dl.ArchiveError, match="bad.zip: member ml-1m/ratings.dat"):
        dl.unpack(str(bad), ("ml-1m/ratings.dat",), str(raw))
    assert os.listdir(raw) == []


def test_pin_on_first_download_then_enforced(server, tmp_path):
    blob = ml1m_zip(*ml1m_events())
    server.files["/p.zip"] = blob
    art = dl.Artifact("p.zip", (server.url + "/p.zip",), members=("ml-1m/users.dat",))
    d = tmp_path / "dl"
    dl.fetch_artifact(art, str(d), log=quiet)
    pins = json.loads((d / dl.PINS).read_text())
    assert pins["p.zip"]["sha256"] == sha(blob) and pins["p.zip"]["size"] == len(blob)
    (d / "p.zip").unlink()
    server.files["/p.zip"] = blob[:-1] + bytes([blob[-1] ^ 1])  # the file changed upstream
    with pytest.raises(dl.ChecksumError, match=sha(blob)):
        dl.fetch_artifact(art, str(d), log=quiet)


def test_partial_download_resumes_with_a_range_request(server, tmp_path):
    blob = bytes(np.random.default_rng(0).integers(0, 256, 300_000, dtype=np.uint8))
    server.files["/big.bin"] = blob
    url, dest = server.url + "/big.bin", tmp_path / "big.bin"
    # 1. a transfer cut after 70,000 bytes keeps the .part and says so
    server.cut["/big.bin"] = 70_000
    with pytest.raises(dl.DownloadError, match="part is kept"):
        dl.fetch(url, str(dest), sha256=sha(blob), size=len(blob), log=quiet)
    assert (tmp_path / "big.bin.part").read_bytes() == blob[:70_000]
    assert not dest.exists()
    # 2. the rerun asks for the rest and the result is byte-identical
    server.seen.clear()
    dl.fetch(url, str(dest), sha256=sha(blob), size=len(blob), log=quiet)
    assert server.seen == [("/big.bin", "bytes=70000-")]
    assert dest.read_bytes() == blob and not (tmp_path / "big.bin.part").exists()
    # 3. a .part already whole (size unknown): the server answers 416, nothing is re-sent
    (tmp_path / "whole.bin.part").write_bytes(blob)
    server.seen.clear()
    dl.fetch(url, str(tmp_path / "whole.bin"), sha256=sha(blob), log=quiet)
    assert server.seen == [("/big.bin", f"bytes={len(blob)}-")]
    assert (tmp_path / "whole.bin").read_bytes() == blob
    # 4. a server that ignores Range (200): the download starts over, still identical
    dest2 = tmp_path / "again.bin"
    (tmp_path / "again.bin.part").write_bytes(b"stale bytes of another attempt")
    server.ignore_range = True
    dl.fetch(url, str(dest2), sha256=sha(blob), log=quiet)
    assert dest2.read_bytes() == blob


def test_file_url_download(tmp_path):
    src = tmp_path / "served.csv"
    src.write_bytes(b"A1,B1,5.0,100\n" * 50)
    (tmp_path / "got.csv.part").write_bytes(b"A1,B1,5.0,")  # file:// ignores Range: restart
    got = dl.fetch(src.as_uri(), str(tmp_path / "got.csv"), sha256=sha(src.read_bytes()),
                   log=quiet)
    assert open(got, "rb").read() == src.read_bytes()
    with pytest.raises(dl.DownloadError, match="nope.csv"):
        dl.fetch((tmp_path / "nope.csv").as_uri(), str(tmp_path / "n.csv"), log=quiet)


# -------------------------------------------------------------------------------- loaders

def check_sequences(ml, ref, raw_item):
    """ml's users (ml.user_ids order) hold ref's sequences; raw_item(row) -> raw id."""
    assert sorted(ref) == list(ml.user_ids)
    for k, u in enumerate(ml.user_ids):
        got = [raw_item(r) for r in ml.histories[k]] + [raw_item(ml.test_items[k])]
        assert got == ref[u], u


def test_ml1m_raw_loader_and_round_trip(tmp_path):
    ratings, feats, movies = ml1m_events(seed=3)
    with zipfile.ZipFile(io.BytesIO(ml1m_zip(ratings, feats, movies))) as z:
        for m in ("ratings.dat", "users.dat", "movies.dat"):
            (tmp_path / m).write_bytes(z.read(f"ml-1m/{m}"))
    ml = load_ml1m(str(tmp_path))
    check_sequences(ml, reference_sequences(ratings), lambda r: int(ml.item_ids[r]))
    for k, u in enumerate(ml.user_ids):
        g, a, o = feats[u]
        assert list(ml.user_features[k]) == [int(g == "M"), a, o]
    for r in np.flatnonzero(ml.item_present):
        assert ml.genre_ids[ml.item_genre[r]] == movies[int(ml.item_ids[r])][0]
    # load_movielens reads back what write_movielens_files wrote, rows unchanged
    write_movielens_files(ml, str(tmp_path / "layout"))
    back = load_movielens(str(tmp_path / "layout"))
    assert all(np.array_equal(a, b) for a, b in zip(back.histories, ml.histories))
    for f in ("test_items", "user_features", "item_genre", "item_present"):
        assert np.array_equal(getattr(back, f), getattr(ml, f)), f
    assert back.num_items == ml.num_items
    # a malformed line is named
    (tmp_path / "ratings.dat").write_text("1::2::3::4\n1::x::3::5\n")
    with pytest.raises(ValueError, match=r"ratings.dat:2: field item: 'x'"):
        load_ml1m(str(tmp_path))


def test_ml20m_csv_loader(tmp_path):
    rng = np.random.default_rng(5)
    items = [3, 10, 100_000, 131_262]                   # sparse ids: table_rows remaps
    ratings = [(int(u), int(rng.choice(items)), int(rng.integers(3)))
               for u in rng.integers(1, 6, 40)]
    (tmp_path / "ratings.csv").write_text(
        "userId,movieId,rating,timestamp\n"
        + "".join(f"{u},{i},{0.5 + i % 9 / 2},{t}\n" for u, i, t in ratings))
    (tmp_path / "movies.csv").write_text(
        'movieId,title,genres\n3,"Grumpier, Old Men (1995)",Comedy|Romance\n'
        '10,GoldenEye (1995),Action|Adventure\n100000,"A, B, and C (2013)",(no genres listed)\n'
        '131262,Innocence (2014),Adventure|Fantasy\n')
    ml = load_ml20m(str(tmp_path))
    check_sequences(ml, reference_sequences(ratings), lambda r: int(ml.item_ids[r]))
    assert ml.num_items == len({i for _, i, _ in ratings})
    first = {3: "Comedy", 10: "Action", 100_000: "(no genres listed)", 131_262: "Adventure"}
    for r in np.flatnonzero(ml.item_present):
        assert ml.genre_ids[ml.item_genre[r]] == first[int(ml.item_ids[r])]
    assert not ml.user_features.any()


def books_rows(seed, n=400):
    rng = np.random.default_rng(seed)
    users = [f"A{k:03d}X" for k in range(40)]
    items = [f"{k:010d}" for k in range(60)]
    pu, pi = rng.dirichlet(np.ones(40) * 0.4), rng.dirichlet(np.ones(60) * 0.4)
    return [(users[rng.choice(40, p=pu)], items[rng.choice(60, p=pi)], int(rng.integers(20)))
            for _ in range(n)]


def brute_keep(rows, k, iterate):
    keep = [True] * len(rows)
    while True:
        uc = Counter(r[0] for r, ok in zip(rows, keep) if ok)
        ic = Counter(r[1] for r, ok in zip(rows, keep) if ok)
        new = [ok and uc[r[0]] >= k and ic[r[1]] >= k for r, ok in zip(rows, keep)]
        if not iterate or new == keep:
            return new
        keep = new


@pytest.mark.parametrize("iterate", [False, True])
def test_books_loader_core_filter(tmp_path, iterate):
    rows = books_rows(seed=2)
    path = tmp_path / "ratings_Books.csv"
    path.write_text("".join(f"{u},{i},{1 + t % 5}.0,{1_300_000_000 + t}\n" for u, i, t in rows))
    keep = brute_keep(rows, 5, iterate)
    kept = [r for r, ok in zip(rows, keep) if ok]
    assert 0 < len(kept) < len(rows)
    if iterate:                              # the k-core: everything left has >= 5
        assert min(Counter(r[0] for r in kept).values()) >= 5
    ml, stats = load_books(str(path), 5, iterate)
    assert stats["kept_ratings"] == len(kept) and stats["ratings"] == len(rows)
    assert stats["kept_items"] == len({r[1] for r in kept})
    check_sequences(ml, reference_sequences(kept), lambda r: ml.item_ids[r])
    assert list(ml.item_ids[1:]) == sorted({r[1] for r in kept})
    assert not ml.user_features.any() and not ml.item_genre.any()
    # core_filter on integer codes agrees with the same brute force
    u = np.asarray([int(r[0][1:4]) for r in rows])
    i = np.asarray([int(r[1]) for r in rows])
    assert core_filter(u, i, 3, iterate).tolist() == brute_keep(rows, 3, iterate)


def test_books_convert_and_frappe_csv_from_data_dir(tmp_path):
    rows = books_rows(seed=4, n=300)
    src = tmp_path / "books"
    src.mkdir()
    (src / "ratings_Books.csv").write_text("".join(f"{u},{i},5.0,{t}\n" for u, i, t in rows))
    res = ds.prepare("books", str(tmp_path / "out"), data_dir=str(src), log=quiet)
    root = tmp_path / "out" / "books"
    kept = [r for r, ok in zip(rows, brute_keep(rows, 5, False)) if ok]
    ref = reference_sequences(kept)
    t = pq.read_table(root / "retrieval" / "test.parquet").to_pydict()
    asin = sorted({r[1] for r in kept})
    assert [asin[r - 1] for r in t["item"]] == [ref[u][-1] for u in sorted(ref)]
    counts = json.loads((root / "retrieval" / "counts.json").read_text())
    assert counts["dataset"] == "books" and counts["source"]["loader"]["kept_ratings"] == len(kept)
    assert res["parquet"][str(root / "retrieval" / "test.parquet")] == len(ref)
    # Frappe_x1's csv layout becomes libsvm for convert_frappe
    fr = tmp_path / "frappe"
    fr.mkdir()
    head = "label,user,item,daytime,weekday,isweekend,homework,cost,weather,country,city\n"
    rng = np.random.default_rng(0)
    for split, n in (("train", 30), ("valid", 40), ("test", 20)):
        (fr / f"{split}.csv").write_text(head + "".join(
            ",".join([str(int(rng.integers(2)))] + [str(100 * j + int(rng.integers(5)))
                                                    for j in range(10)]) + "\n"
            for _ in range(n)))
    res = ds.prepare("frappe", str(tmp_path / "out"), data_dir=str(fr), log=quiet)
    froot = tmp_path / "out" / "frappe"
    assert res["parquet"][str(froot / "test.parquet")] == 20
    assert res["parquet"][str(froot / "train.parquet")] + \
        res["parquet"][str(froot / "holdout.parquet")] == 40
    test = pq.read_table(froot / "test.parquet").to_pydict()
    csv_rows = [line.split(",") for line in (fr / "test.csv").read_text().splitlines()[1:]]
    assert test["label"] == [float(r[0]) for r in csv_rows]
    raw = json.loads((froot / "counts.json").read_text())["raw_id_of_row"]
    assert [raw[v] for v in test["city"]] == [int(r[10]) for r in csv_rows]
    with pytest.raises(ValueError, match="no frappe files"):
        ds.prepare("frappe", str(tmp_path / "out"), data_dir=str(src), log=quiet)
