"""Fetching the public datasets: checksummed, resumable downloads and checked unpacking.

    MANIFEST[name] -> Dataset(name, artifacts, homepage, licence)
    fetch(url, dest, sha256=, md5=, size=)       -> dest (verified, renamed into place)
    fetch_artifact(artifact, download_dir, url=) -> the verified file (pins unknown digests)
    unpack(archive, members, dest_dir)           -> {member: extracted path}

A download streams into `dest + ".part"`; a rerun after an interruption asks the server
for the rest (HTTP `Range: bytes=N-`) and appends when it answers 206 with a matching
Content-Range, else starts over. The whole file is then checked (size, sha256, md5 where
the manifest knows them) before it is renamed to `dest` (os.replace: a reader never sees a
partial file); a mismatch raises ChecksumError naming the URL, the expected and the got
digest, and moves the bytes aside to `dest + ".rejected"` so the next run starts afresh.
Archives are opened only after that check; a truncated or damaged zip raises ArchiveError
naming the archive (and the member).

Digests: ml-1m.zip and ml-20m.zip carry GroupLens' published md5 and the sha256 and size
listed by TensorFlow Datasets' url_checksums. Frappe_x1.zip and ratings_Books.csv have no
published digest: their first verified download records its sha256 and size in
`<download_dir>/PINNED.json` (trust on first use), and every later fetch into that
directory must match it. Only the standard library is used (urllib, hashlib, zipfile).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
import urllib.error
import urllib.request
import zipfile
import zlib

PINS = "PINNED.json"
_CHUNK = 1 << 20


class DownloadError(RuntimeError):
    """A download that could not complete (network, server answer, size)."""


class ChecksumError(DownloadError):
    """Downloaded bytes whose size or digest differ from the expected ones."""


class ArchiveError(DownloadError):
    """An archive that cannot be read (truncated, damaged, member missing)."""


@dataclasses.dataclass(frozen=True)
class Artifact:
    """One file to download. members: paths inside the zip archive to extract (matched
    by their ending, so a leading folder does not matter); empty for a plain file.
    sha256 / md5 / size: published values (None: unknown, pinned on first download)."""
    filename: str
    urls: tuple[str, ...]
    sha256: str | None = None
    md5: str | None = None
    size: int | None = None
    members: tuple[str, ...] = ()
    approx_size: str = ""


@dataclasses.dataclass(frozen=True)
class Dataset:
    name: str
    artifacts: tuple[Artifact, ...]
    homepage: str
    licence: str


_GROUPLENS = "https://files.grouplens.org/datasets/movielens/"
MANIFEST: dict[str, Dataset] = {
    "ml-1m": Dataset("ml-1m", (Artifact(
        "ml-1m.zip", (_GROUPLENS + "ml-1m.zip",),
        sha256="a6898adb50b9ca05aa231689da44c217cb524e7ebd39d264c56e2832f2c54e20",
        md5="c4d9eecfca2ab87c1945afe126590906", size=5_917_549,
        members=("ml-1m/ratings.dat", "ml-1m/users.dat", "ml-1m/movies.dat"),
        approx_size="5.9 MB"),),
        "https://grouplens.org/datasets/movielens/1m/",
        "GroupLens terms: research use, no redistribution"),
    "ml-20m": Dataset("ml-20m", (Artifact(
        "ml-20m.zip", (_GROUPLENS + "ml-20m.zip",),
        sha256="96f243c338a8665f6bcc89c53edf6ee39162a846940de6b7c8c48aeada765ff3",
        md5="cd245b17a1ae2cc31bb14903e1204af3", size=198_702_078,
        members=("ml-20m/ratings.csv", "ml-20m/movies.csv"), approx_size="199 MB"),),
        "https://grouplens.org/datasets/movielens/20m/",
        "GroupLens terms: research use, no redistribution"),
    "frappe": Dataset("frappe", (Artifact(
        "Frappe_x1.zip",
        ("https://huggingface.co/datasets/reczoo/Frappe_x1/resolve/main/Frappe_x1.zip",),
        members=("train.csv", "valid.csv", "test.csv"), approx_size="2.8 MB"),),
        "https://github.com/reczoo/BARS (Frappe_x1)",
        "research use, non-commercial, no redistribution"),
    "books": Dataset("books", (Artifact(
        "ratings_Books.csv",
        ("http://snap.stanford.edu/data/amazon/productGraph/categoryFiles/ratings_Books.csv",),
        approx_size="0.9 GB (22.5M ratings)"),),
        "http://jmcauley.ucsd.edu/data/amazon/ (2014, ratings only)",
        "research use; cite He & McAuley, WWW 2016"),
}


def file_digests(path: str) -> tuple[int, str, str]:
    """(size in bytes, sha256 hex, md5 hex) of a file, read in 1 MiB chunks."""
    sha, md5, n = hashlib.sha256(), hashlib.md5(), 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            sha.update(chunk)
            md5.update(chunk)
            n += len(chunk)
    return n, sha.hexdigest(), md5.hexdigest()


def _check(path: str, url: str, sha256, md5, size) -> None:
    n, sha, m = file_digests(path)
    if size is not None and n != size:
        raise ChecksumError(f"download: {url}: expected {size} bytes, got {n} "
                            f"(truncated or a different file) in {path}")
    if sha256 is not None and sha != sha256.lower():
        raise ChecksumError(f"download: {url}: sha256 mismatch: expected {sha256}, got {sha} "
                            f"({n} bytes in {path})")
    if md5 is not None and m != md5.lower():
        raise ChecksumError(f"download: {url}: md5 mismatch: expected {md5}, got {m} "
                            f"({n} bytes in {path})")


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _open(url: str, offset: int, timeout: float):
    """The response to GET url (from byte `offset` when > 0) and whether it resumes there.
    A 416 answer to a range request returns (None, True): the part file is complete."""
    headers = {"User-Agent": "gemjax-datasets/1"}
    if offset:
        headers["Range"] = f"bytes={offset}-"
    req = urllib.request.Request(url, headers=headers)
    try:
        resp = urllib.request.urlopen(req, timeout=timeout)
    except urllib.error.HTTPError as e:
        if e.code == 416 and offset:
            return None, True
        raise DownloadError(f"download: {url}: HTTP {e.code} {e.reason}") from e
    except (urllib.error.URLError, OSError) as e:
        raise DownloadError(f"download: {url}: {getattr(e, 'reason', e)} (offline? pass "
                            f"--data_dir with the files, or --url with a mirror)") from e
    status = getattr(resp, "status", None)
    resumes = False
    if offset and status == 206:
        got = resp.headers.get("Content-Range", "")
        resumes = got.startswith(f"bytes {offset}-")
        if not resumes:
            resp.close()
            raise DownloadError(f"download: {url}: asked for bytes {offset}- but the server "
                                f"answered Content-Range {got!r}")
    return resp, resumes


def fetch(url: str, dest: str, sha256: str | None = None, md5: str | None = None,
          size: int | None = None, timeout: float = 60.0, log=print) -> str:
    """Download `url` to `dest`: resume `dest.part` where the server honours Range, check
    size / sha256 / md5 (those given), then rename into place. An existing `dest` is
    checked and kept. Raises DownloadError (network, server) or ChecksumError (the bytes
    moved to `dest.rejected`); an interrupted transfer leaves `dest.part` for the rerun."""
    if os.path.exists(dest):
        try:
            _check(dest, url, sha256, md5, size)
        except ChecksumError as e:
            raise ChecksumError(f"{e}; this file was already there: delete it to download "
                                f"afresh") from None
        return dest
    os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)
    part = dest + ".part"
    offset = os.path.getsize(part) if os.path.exists(part) else 0
    if size is not None and offset > size:
        offset = 0
    if size is None or offset < size:
        resp, resumes = _open(url, offset, timeout)
        if resp is not None:
            if offset and not resumes:
                log(f"download: {url}: the server ignored the range request; starting over")
                offset = 0
            elif offset:
                log(f"download: {url}: resuming at byte {offset}")
            expected = resp.headers.get("Content-Length")
            got = 0
            try:
                with resp, open(part, "ab" if offset else "wb") as f:
                    while chunk := resp.read(_CHUNK):
                        f.write(chunk)
                        got += len(chunk)
                    f.flush()
                    os.fsync(f.fileno())
            except (OSError, urllib.error.URLError, ValueError) as e:   # IncompleteRead too
                raise DownloadError(f"download: {url}: interrupted after {offset + got} bytes "
                                    f"({type(e).__name__}: {e}); {part} is kept and the next "
                                    f"run resumes it") from e
            if expected is not None and got != int(expected):
                raise DownloadError(f"download: {url}: the connection ended after {got} of "
                                    f"{expected} bytes; {part} is kept and the next run "
                                    f"resumes it")
    try:
        _check(part, url, sha256, md5, size)
    except ChecksumError as e:
        os.replace(part, dest + ".rejected")
        raise ChecksumError(f"{e}; moved to {dest}.rejected, the next run downloads "
                            f"afresh") from None
    os.replace(part, dest)
    _fsync_dir(os.path.dirname(os.path.abspath(dest)))
    return dest


def read_pins(download_dir: str) -> dict:
    path = os.path.join(download_dir, PINS)
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _write_pins(download_dir: str, pins: dict) -> None:
    fd, tmp = tempfile.mkstemp(dir=download_dir, prefix=".pins-")
    with os.fdopen(fd, "w") as f:
        json.dump(pins, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, os.path.join(download_dir, PINS))


def fetch_artifact(artifact: Artifact, download_dir: str, url: str | None = None,
                   sha256: str | None = None, log=print) -> str:
    """fetch() of one manifest entry into download_dir/<filename> (url / sha256 override
    the manifest's). Without a published sha256 the pin of PINNED.json applies; the first
    download writes that pin once the file (and, for a zip, every listed member) reads
    back whole."""
    url = url or artifact.urls[0]
    want_sha, md5, size = sha256 or artifact.sha256, artifact.md5, artifact.size
    if sha256:                                   # another file than the manifest's
        md5 = size = None
    pins = read_pins(download_dir) if os.path.isdir(download_dir) else {}
    pin = pins.get(artifact.filename)
    if want_sha is None and pin is not None:
        want_sha, size = pin["sha256"], pin["size"]
    dest = fetch(url, os.path.join(download_dir, artifact.filename), want_sha, md5, size,
                 log=log)
    if want_sha is None:
        if artifact.members:
            try:
                check_zip(dest, artifact.members)
            except ArchiveError as e:
                os.replace(dest, dest + ".rejected")
                raise ArchiveError(f"{e} (moved to {dest}.rejected; nothing pinned)") from None
        n, sha, _ = file_digests(dest)
        pins[artifact.filename] = {"sha256": sha, "size": n, "url": url}
        _write_pins(download_dir, pins)
        log(f"download: pinned {artifact.filename}: sha256 {sha}, {n} bytes "
            f"(in {os.path.join(download_dir, PINS)})")
    return dest


def _members(z: zipfile.ZipFile, archive: str, members) -> dict[str, str]:
    """{wanted member: its name in the archive}, matched by path ending (no __MACOSX)."""
    names = [n for n in z.namelist() if not n.startswith("__MACOSX") and not n.endswith("/")]
    out = {}
    for m in members:
        hits = [n for n in names if n == m or n.endswith("/" + m)]
        if len(hits) != 1:
            raise ArchiveError(f"download: {archive}: expected one member {m!r}, found "
                               f"{len(hits)} among {names[:20]}")
        out[m] = hits[0]
    return out


def _open_zip(archive: str) -> zipfile.ZipFile:
    try:
        return zipfile.ZipFile(archive)
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        raise ArchiveError(f"download: {archive}: not a readable zip archive, truncated or "
                           f"damaged ({e}); delete it and rerun") from e


def _copy_member(z: zipfile.ZipFile, archive: str, name: str, out) -> None:
    try:
        with z.open(name) as src:
            shutil.copyfileobj(src, out, _CHUNK)
    except (zipfile.BadZipFile, zlib.error, EOFError, OSError) as e:
        raise ArchiveError(f"download: {archive}: member {name} is damaged or truncated "
                           f"({type(e).__name__}: {e}); delete the archive and rerun") from e


def check_zip(archive: str, members) -> None:
    """Read every listed member of the zip whole (CRC checked); ArchiveError otherwise."""
    with _open_zip(archive) as z:
        for name in _members(z, archive, members).values():
            with open(os.devnull, "wb") as sink:
                _copy_member(z, archive, name, sink)


def unpack(archive: str, members, dest_dir: str) -> dict[str, str]:
    """Extract the listed members (by path ending) into dest_dir/<basename>; each file is
    written to a temporary name, CRC-checked and renamed into place, and a member already
    there is kept. Returns {member: path}."""
    os.makedirs(dest_dir, exist_ok=True)
    out = {m: os.path.join(dest_dir, os.path.basename(m)) for m in members}
    todo = [m for m in members if not os.path.exists(out[m])]
    if not todo:
        return out
    with _open_zip(archive) as z:
        names = _members(z, archive, todo)
        for m in todo:
            fd, tmp = tempfile.mkstemp(dir=dest_dir, prefix=".unpack-")
            try:
                with os.fdopen(fd, "wb") as f:
                    _copy_member(z, archive, names[m], f)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, out[m])
            finally:
                if os.path.exists(tmp):
                    os.remove(tmp)
    _fsync_dir(dest_dir)
    return out
