"""MovieLens as GroupLens ships it -> the MovieLens sequences of gemjax.data.movielens.

    load_ml1m(data_dir)  -> MovieLens   ratings.dat `UserID::MovieID::Rating::Timestamp`,
                                        users.dat `UserID::Gender::Age::Occupation::Zip`,
                                        movies.dat `MovieID::Title::Genres`
    load_ml20m(data_dir) -> MovieLens   ratings.csv `userId,movieId,rating,timestamp`,
                                        movies.csv `movieId,title,genres` (headers)
    build_sequences(user, item, time, genre, user_features) -> MovieLens
    write_movielens_files(ml, directory) -> the train.csv.zip + test.csv layout that
                                        gemjax.data.movielens.load_movielens reads

Every rating is an interaction (implicit feedback, as HSTU's sequential benchmarks).
Each user's items are ordered by timestamp, ties by their order in the ratings file
(a stable sort); the last one is the test item, the others the history, as
load_movielens returns them. Users are in increasing id order; item rows come from
gemjax.data.vocab.table_rows over the movie ids (ML-1M keeps the raw ids 1..3952).

Features: genre = the first genre listed for the movie (rows: genre names in sorted
order; genre_ids holds the names); ML-1M's user features are gender (F 0, M 1), age and
occupation as in users.dat; ML-20M has none (all 0). Every error names the file and line.
"""

from __future__ import annotations

import csv
import io
import os
import tempfile
import zipfile

import numpy as np

from gemjax.data.movielens import MovieLens
from gemjax.data.vocab import table_rows


def build_sequences(user, item, time, genre, user_features=None) -> MovieLens:
    """Events -> MovieLens. user [N] (any sortable ids), item [N] int64 raw ids >= 1,
    time [N] int64, genre [N] int64 >= 0 (the item's genre code); user_features
    [U, 3] int64 >= 0 for the U distinct users in sorted order (None: zeros)."""
    user, item = np.asarray(user), np.asarray(item, np.int64)
    time, genre = np.asarray(time, np.int64), np.asarray(genre, np.int64)
    if not len(user):
        raise ValueError("movielens: no interactions")
    users, u = np.unique(user, return_inverse=True)
    order = np.lexsort((np.arange(len(u)), time, u))        # user, time, file order
    item_rows, item_ids = table_rows(item, first=1)
    genre_rows, genre_ids = table_rows(genre)
    us, seq = u[order], item_rows[order]
    bounds = np.searchsorted(us, np.arange(len(users) + 1))
    histories = [seq[bounds[k]:bounds[k + 1] - 1] for k in range(len(users))]
    num_items = len(item_ids) - 1
    item_genre = np.zeros(num_items + 1, np.int64)
    item_genre[item_rows] = genre_rows
    present = np.zeros(num_items + 1, bool)
    present[item_rows] = True
    feats = (np.zeros((len(users), 3), np.int64) if user_features is None
             else np.asarray(user_features, np.int64))
    if feats.shape != (len(users), 3):
        raise ValueError(f"movielens: user_features must be [{len(users)}, 3], got "
                         f"{feats.shape}")
    return MovieLens(histories, seq[bounds[1:] - 1], feats, item_genre, present, num_items,
                     users, item_ids, genre_ids)


def _lines(path: str, encoding: str = "utf-8"):
    """(line number, text) of the file's non-empty lines."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"movielens: {path} not found (pass --data_dir)")
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode(encoding).rstrip("\r\n")
            except UnicodeDecodeError as e:
                raise ValueError(f"movielens: {path}:{lineno}: not {encoding} text "
                                 f"({e.reason})") from e
            if line.strip():
                yield lineno, line


def _int(tok: str, where: str, field: str) -> int:
    t = tok.strip()
    if not (t.isascii() and t.lstrip("-").isdigit()):
        raise ValueError(f"movielens: {where}: field {field}: {tok!r} is not an integer")
    return int(t)


def read_ratings(path: str, sep: str, header: bool, with_rating: bool = False) -> tuple:
    """A ratings file of integer user, integer item, rating, integer timestamp ->
    (user, item, time) int64 [N] in file order (with_rating: then the ratings, float64
    [N]). sep: "::" (ML-1M) or "," (ML-20M);
    header: skip the first line. pyarrow parses; a file it refuses is scanned line by
    line so that the error names the line and field."""
    import pyarrow as pa
    import pyarrow.csv as pacsv

    if not os.path.exists(path):
        raise FileNotFoundError(f"movielens: {path} not found (pass --data_dir)")
    with open(path, "rb") as f:
        data = f.read()
    if sep != ",":
        data = data.replace(sep.encode(), b"\x1f")
    names = ["user", "item", "rating", "time"]
    try:
        t = pacsv.read_csv(
            io.BytesIO(data),
            read_options=pacsv.ReadOptions(column_names=names, skip_rows=int(header)),
            parse_options=pacsv.ParseOptions(delimiter="," if sep == "," else "\x1f",
                                             quote_char=False),
            convert_options=pacsv.ConvertOptions(column_types={
                "user": pa.int64(), "item": pa.int64(), "rating": pa.float64(),
                "time": pa.int64()}))
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        for lineno, line in _lines(path):
            if header and lineno == 1:
                continue
            parts = line.split(sep)
            where = f"{path}:{lineno}"
            if len(parts) != 4:
                raise ValueError(f"movielens: {where}: {len(parts)} {sep!r}-separated fields, "
                                 f"expected 4 (user{sep}item{sep}rating{sep}timestamp); got "
                                 f"{line!r}") from e
            for tok, field in zip(parts, ("user", "item", "timestamp")):
                _int(tok, where, field)
        raise ValueError(f"movielens: {path}: unreadable ({e})") from e
    if t.num_rows == 0:
        raise ValueError(f"movielens: {path} holds no ratings")
    cols = [t[n].to_numpy() for n in ("user", "item", "time")]
    for col, field in ((cols[0], "user"), (cols[1], "item")):
        if col.min() < 1:
            i = int(np.argmax(col < 1))
            raise ValueError(f"movielens: {path}:{i + 1 + int(header)}: field {field}: ids "
                             f"start at 1, got {col[i]}")
    if with_rating:
        return cols[0], cols[1], cols[2], t["rating"].to_numpy()
    return cols[0], cols[1], cols[2]


def _first_genres(movie_genre: dict, items: np.ndarray, ratings_path: str, movies_path: str):
    """(genre code [N] per rating, sorted genre names) from {movie id: first genre}."""
    names = sorted(set(movie_genre.values()))
    code = {g: i for i, g in enumerate(names)}
    ids = np.fromiter(movie_genre.keys(), np.int64, len(movie_genre))
    codes = np.fromiter((code[g] for g in movie_genre.values()), np.int64, len(movie_genre))
    sort = np.argsort(ids)
    ids, codes = ids[sort], codes[sort]
    at = np.minimum(np.searchsorted(ids, items), len(ids) - 1)
    missing = ids[at] != items
    if missing.any():
        i = int(np.argmax(missing))
        raise ValueError(f"movielens: {ratings_path}: rating {i + 1} names movie {items[i]}, "
                         f"which {movies_path} does not list")
    return codes[at], np.asarray(names, dtype=object)


def _with_names(ml: MovieLens, genre_names) -> MovieLens:
    import dataclasses
    return dataclasses.replace(ml, genre_ids=genre_names[ml.genre_ids])


def load_ml1m(data_dir: str) -> MovieLens:
    """GroupLens' ml-1m folder (ratings.dat, users.dat, movies.dat) -> MovieLens."""
    ratings = os.path.join(data_dir, "ratings.dat")
    user, item, time = read_ratings(ratings, "::", header=False)
    users_path, movies_path = os.path.join(data_dir, "users.dat"), os.path.join(data_dir,
                                                                                "movies.dat")
    feats = {}
    for lineno, line in _lines(users_path, "latin-1"):
        where = f"{users_path}:{lineno}"
        p = line.split("::")
        if len(p) != 5 or p[1] not in ("F", "M"):
            raise ValueError(f"movielens: {where}: expected UserID::Gender(F/M)::Age::"
                             f"Occupation::Zip-code, got {line!r}")
        feats[_int(p[0], where, "UserID")] = (int(p[1] == "M"), _int(p[2], where, "Age"),
                                              _int(p[3], where, "Occupation"))
    genre = {}
    for lineno, line in _lines(movies_path, "latin-1"):
        where = f"{movies_path}:{lineno}"
        p = line.split("::")
        if len(p) != 3:
            raise ValueError(f"movielens: {where}: expected MovieID::Title::Genres, got {line!r}")
        genre[_int(p[0], where, "MovieID")] = p[2].split("|")[0]
    codes, names = _first_genres(genre, item, ratings, movies_path)
    users = np.unique(user)
    missing = [int(x) for x in users if int(x) not in feats]
    if missing:
        raise ValueError(f"movielens: {ratings}: user {missing[0]} has ratings but no line in "
                         f"{users_path}")
    ufeat = np.asarray([feats[int(x)] for x in users], np.int64)
    return _with_names(build_sequences(user, item, time, codes, ufeat), names)


def load_ml20m(data_dir: str) -> MovieLens:
    """GroupLens' ml-20m folder (ratings.csv, movies.csv) -> MovieLens (no user features)."""
    ratings, movies_path = (os.path.join(data_dir, "ratings.csv"),
                            os.path.join(data_dir, "movies.csv"))
    user, item, time = read_ratings(ratings, ",", header=True)
    genre = {}
    lines = [(n, line) for n, line in _lines(movies_path) if n > 1]     # after the header
    for (lineno, _), p in zip(lines, csv.reader(line for _, line in lines)):
        where = f"{movies_path}:{lineno}"
        if len(p) != 3:
            raise ValueError(f"movielens: {where}: expected movieId,title,genres, got {p!r}")
        genre[_int(p[0], where, "movieId")] = p[2].split("|")[0]
    codes, names = _first_genres(genre, item, ratings, movies_path)
    return _with_names(build_sequences(user, item, time, codes), names)


def _joined(cols: list[np.ndarray]):
    """pa string array: the integer columns in decimal, joined by "-"."""
    import pyarrow as pa
    import pyarrow.compute as pc

    return pc.binary_join_element_wise(*[pa.array(c).cast(pa.string()) for c in cols], "-")


def _write_lines(user, item, path: str) -> None:
    """Lines `user,item` (two string arrays without commas) to path."""
    import pyarrow as pa
    import pyarrow.csv as pacsv
    pacsv.write_csv(pa.table({"user": user, "item": item}), path,
                    pacsv.WriteOptions(include_header=False, quoting_style="none"))


def write_movielens_files(ml: MovieLens, directory: str) -> tuple[str, str]:
    """Write ml as train.csv.zip + test.csv in load_movielens's line format
    `user-f1-f2-f3,item-genre`: user = user index + 1, f = the raw user features, item =
    the item row, genre = its genre row; load_movielens(directory) returns the same
    histories, test items, features and tables (rows unchanged). Each file is written
    under a temporary name and renamed into place, test.csv last."""
    lens = np.asarray([len(h) for h in ml.histories], np.int64)
    feats = np.asarray(ml.user_features, np.int64)
    if feats.size and feats.min() < 0:
        raise ValueError("movielens: user features must be >= 0 to be written")
    owner = np.repeat(np.arange(len(lens)), lens)
    hist = np.concatenate(ml.histories) if lens.sum() else np.zeros(0, np.int64)
    os.makedirs(directory, exist_ok=True)
    train_zip, test_csv = os.path.join(directory, "train.csv.zip"), os.path.join(directory,
                                                                                 "test.csv")
    with tempfile.TemporaryDirectory(dir=directory, prefix=".write-") as tmp:
        for users, items, name in ((owner, hist, "train.csv"),
                                   (np.arange(len(lens)), ml.test_items, "test.csv")):
            f = feats[users]
            _write_lines(_joined([users + 1, f[:, 0], f[:, 1], f[:, 2]]),
                         _joined([items, ml.item_genre[items]]), os.path.join(tmp, name))
        with zipfile.ZipFile(os.path.join(tmp, "train.csv.zip"), "w", zipfile.ZIP_DEFLATED,
                             compresslevel=1) as z:
            z.write(os.path.join(tmp, "train.csv"), "train.csv")
        os.replace(os.path.join(tmp, "train.csv.zip"), train_zip)
        os.replace(os.path.join(tmp, "test.csv"), test_csv)
    return train_zip, test_csv
