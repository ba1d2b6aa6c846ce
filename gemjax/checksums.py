"""SHA-256 manifests of a directory's files: written once its files are complete,
checked before anything reads them.

    write(directory, skip=())            # DIRECTORY/checksums.sha256
    problem = check(directory, skip=())  # None, NO_SUMS, or what is wrong (one line)

The manifest is `sha256sum -c` text: one "<sha256 hex>  <path relative to directory>"
line per file under the directory (recursive), sorted by path, except itself and the
names in `skip`. `check` names a missing, altered or unexpected file, or a malformed
manifest line. Used by checkpoint steps (gemjax.train.checkpoint) and serving exports
(gemjax.serve.export).
"""

from __future__ import annotations

import hashlib
import os

FILE = "checksums.sha256"
NO_SUMS = "unverified: no " + FILE


def files_under(directory: str) -> list[str]:
    """Paths of every file under `directory`, relative to it, sorted."""
    out = []
    for root, _, files in os.walk(directory):
        out += [os.path.relpath(os.path.join(root, f), directory) for f in files]
    return sorted(out)


def sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write(directory: str, skip: tuple[str, ...] = (), *, fsync: bool = False) -> None:
    """DIRECTORY/checksums.sha256 of every file under `directory` but `skip` (fsync: the
    manifest is flushed to disk before this returns)."""
    lines = [f"{sha256(os.path.join(directory, rel))}  {rel}\n" for rel in files_under(directory)
             if rel not in skip and rel != FILE]
    with open(os.path.join(directory, FILE), "w") as f:
        f.writelines(lines)
        if fsync:
            f.flush()
            os.fsync(f.fileno())


def check(directory: str, skip: tuple[str, ...] = ()) -> str | None:
    """None when every listed file matches and no other file (but `skip`) is there;
    NO_SUMS without a manifest; else what is wrong, naming the file (one line)."""
    files = files_under(directory)
    if FILE not in files:
        return NO_SUMS
    want = {}
    with open(os.path.join(directory, FILE), "rb") as f:
        for n, line in enumerate(f, 1):
            digest, sep, rel = line.rstrip(b"\n").partition(b"  ")
            if not sep or len(digest) != 64:
                return f"{FILE} line {n} is not '<sha256>  <path>'"
            want[rel.decode("utf-8", "replace")] = digest.decode("ascii", "replace")
    have = {rel for rel in files if rel not in skip and rel != FILE}
    for rel in sorted(want):
        path = os.path.join(directory, rel)
        if rel not in have:
            return f"file {rel} is missing"
        if sha256(path) != want[rel]:
            return f"file {rel} does not match its checksum ({os.path.getsize(path)} bytes)"
    extra = sorted(have - set(want))
    if extra:
        return f"unexpected files {extra[:3]}"
    return None
