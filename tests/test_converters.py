"""Dataset converters (experiments/convert_frappe.py, convert_movielens.py) on tiny files
written here in the datasets' own formats, read back through ParquetSource.

The references are built per row with plain Python from the lines the test wrote (a
user's history = every earlier item of that user, the newest `cap` kept); the Parquet
is read both in time order (file order) and shuffled (rows named by SourceInfo.rows).
The real data (../shared/datasets) is checked against its README's counts when present.
"""

import json
import os
import subprocess
import sys
import zipfile

import numpy as np
import pyarrow.parquet as pq
import pytest

from experiments import convert_frappe as cf
from experiments import convert_movielens as cm
from gemjax.features import EventField, FeatureSchema, SequenceFeature, SparseFeature, Table
from gemjax.data.frappe import DEFAULT_DIR as FRAPPE_DIR
from gemjax.data.frappe import load_frappe
from gemjax.data.movielens import DEFAULT_DIR as ML_DIR
from gemjax.data.parquet import ParquetSource
from gemjax.data.parquet import columns_from_schema
from gemjax.data.parquet_writer import check_out_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read_rows(directory, split, order, batch_size=None, seed=0):
    """Every row of directory/split.parquet through ParquetSource: {row number: sample}
    (sample: sparse ids, label, and per sequence field the list of values)."""
    with open(os.path.join(directory, "schema.json")) as f:
        schema = FeatureSchema.from_dict(json.load(f))
    cols = columns_from_schema(schema)
    path = os.path.join(directory, f"{split}.parquet")
    n = pq.ParquetFile(path).metadata.num_rows
    b = batch_size or n
    caps = {s.name: b * s.max_len for s in schema.sequences}     # no capacity cut
    src = ParquetSource(path, cols, batch_size=b, seed=seed, order=order, window=7,
                        capacity_tokens=caps)
    out = {}
    for step in range(src.steps_per_epoch(1)):
        batch, info = src.shard_batch(step)
        for i, row in enumerate(info.rows):
            sample = {k: int(v[i]) for k, v in batch.sparse.items()}
            sample["label"] = float(batch.labels[i, 0])
            for name, jag in batch.sequences.items():
                lo, hi = int(jag.offsets[i]), int(jag.offsets[i + 1])
                for field, vals in jag.values.items():
                    sample[f"{name}.{field}"] = [int(v) for v in vals[lo:hi]]
            assert out.setdefault(int(row), sample) == sample
    return out, src


# ------------------------------------------------------------------------------- Frappe

def write_frappe(d, n_valid=53, n_test=21, seed=0):
    rng = np.random.default_rng(seed)
    lines = {}
    for name, n in (("valid", n_valid), ("test", n_test)):
        rows = [[int(rng.integers(2))] + [30 * j + int(rng.integers(8)) for j in range(10)]
                for _ in range(n)]
        (d / f"{name}.libsvm").write_text("".join(
            f"{r[0]} " + " ".join(f"{i}:1" for i in r[1:]) + "\n" for r in rows))
        lines[name] = rows
    return lines


def test_frappe_split_rows_and_schema(tmp_path):
    src_dir, out = tmp_path / "frappe", tmp_path / "out"
    src_dir.mkdir()
    lines = write_frappe(src_dir)
    counts = cf.convert(str(src_dir), str(out), seed=3, holdout_fraction=0.25, row_group_rows=8)
    ref = load_frappe(str(src_dir), 0.25, 3)               # the split experiments/frappe.py uses
    want = FeatureSchema(tables=(Table("feature", ref.num_features),),
                         sparse=tuple(SparseFeature(n, "feature") for n in cf.FIELDS),
                         tasks=("label",))
    with open(out / "schema.json") as f:
        saved = json.load(f)
    assert FeatureSchema.from_dict(saved) == want and want.to_dict() == saved
    assert ref.num_features == 30 * 9 + 8                  # raw ids kept as table rows
    seen = []
    for split, n in (("train", 40), ("holdout", 13), ("test", 21)):
        assert counts["splits"][split]["rows"] == n
        for order in ("time", "shuffle"):
            rows, _ = read_rows(out, split, order, batch_size=None if order == "time" else 4)
            served = len(rows) if order == "time" else (n // 4) * 4
            assert len(rows) == served
            ids, y = getattr(ref, split)
            for r, s in rows.items():
                assert [s[name] for name in cf.FIELDS] == ids[r].tolist()
                assert s["label"] == y[r]
        rows, _ = read_rows(out, split, "time")
        got = sorted([s["label"]] + [s[name] for name in cf.FIELDS] for s in rows.values())
        if split == "test":
            assert got == sorted(map(list, lines["test"]))
        seen += got
        assert counts["splits"][split]["positive_share"] == pytest.approx(
            np.mean([s["label"] for s in rows.values()]))
    train_hold = sorted(seen[:53])                         # train + holdout = valid.libsvm
    assert train_hold == sorted(map(list, lines["valid"]))


# ---------------------------------------------------------------------------- MovieLens

USERS = {   # uid: (gender, age, occupation) raw feature ids, as the file's offset ids
    3: (6041, 6045, 6060), 1: (6042, 6044, 6051), 7: (6041, 6046, 6051), 2: (6042, 6044, 6052),
    5: (6041, 6047, 6053)}
ITEMS = [i for i in range(1, 31) if i % 7]                 # items 7, 14, 21, 28 never occur
GENRE = {i: 3707 + (i * 5) % 6 for i in ITEMS}             # raw genre ids of the items


def write_ml(d, seed=0):
    """Histories of 1..24 train items (user 1: one item, no train target; user 5 rates
    every item but ITEMS[0], which user 7 rates) interleaved across users; test.csv: each
    user's next item."""
    rng = np.random.default_rng(seed)
    seqs = {}
    for uid, n in ((3, 9), (1, 2), (7, 14), (2, 5), (5, len(ITEMS) - 1)):
        seqs[uid] = [int(i) for i in rng.permutation(ITEMS[1:])[:n]]
    seqs[7][5] = ITEMS[0]                                 # the item user 5 never rates occurs
    events = [(uid, t) for uid, s in seqs.items() for t in range(len(s) - 1)]
    events = [events[i] for i in rng.permutation(len(events))]
    events.sort(key=lambda e: e[1])                       # interleaved, each user in time order
    line = lambda uid, item: (f"{uid}-{'-'.join(map(str, USERS[uid]))},{item}-{GENRE[item]}")
    with zipfile.ZipFile(d / "train.csv.zip", "w") as z:
        z.writestr("train.csv", "".join(line(u, seqs[u][t]) + "\n" for u, t in events))
        z.writestr("__MACOSX/._train.csv", "junk")
    (d / "test.csv").write_text("".join(line(u, s[-1]) + "\n" for u, s in seqs.items()))
    return seqs


def ml_reference(seqs, split, cap, valid=False):
    """[(uid, history, target)] by uid then time: train targets t = 1..L-1 of the L train
    items (valid: 1..L-2), valid the last train item (L >= 2), test the test item after
    every train item; histories keep the newest cap."""
    out = []
    for uid in sorted(seqs):
        s = seqs[uid]
        n = len(s) - 1                                      # train items
        ts = {"train": range(1, n - 1 if valid else n), "valid": [n - 1] if n >= 2 else [],
              "test": [n]}[split]
        out += [(uid, s[max(0, t - cap):t], s[t]) for t in ts]
    return out


def check_ml_rows(rows, ref, seqs, raw, k):
    """rows (row number -> sample) against the reference positions, k negatives each."""
    uids = sorted(seqs)
    for r, s in rows.items():
        uid, hist, target = ref[r // (k + 1)]
        assert s["user"] == uids.index(uid)
        assert [raw[n][s[n]] for n in cm.USER_FIELDS] == list(USERS[uid])
        assert s["history.item"] == hist
        assert [raw["genre"][g] for g in s["history.genre"]] == [GENRE[i] for i in hist]
        assert raw["genre"][s["genre"]] == GENRE[s["item"]]
        if r % (k + 1) == 0:
            assert s["item"] == target and s["label"] == 1.0
        else:                                # a negative: occurs, never rated by the user
            assert s["label"] == 0.0
            assert s["item"] in ITEMS and s["item"] not in seqs[uid]


@pytest.fixture(scope="module")
def ml_out(tmp_path_factory):
    d = tmp_path_factory.mktemp("ml-1m")
    seqs = write_ml(d)
    out = tmp_path_factory.mktemp("out")
    counts = cm.convert(str(d), str(out), seed=1, negatives=3, max_history=4, row_group_rows=10)
    return d, out, seqs, counts


@pytest.mark.parametrize("task", cm.TASKS)
def test_movielens_rows_against_a_per_row_reference(ml_out, task):
    _, out, seqs, counts = ml_out
    k = 3 if task == "ranking" else 0
    c = counts[task]
    raw = c["raw_ids"]
    assert c["users"] == 5 and c["items"] == len(ITEMS) and c["item_rows"] == 31
    assert sorted(c["splits"]) == ["test", "train"]
    for split in ("train", "test"):
        ref = ml_reference(seqs, split, 4)
        n = len(ref) * (k + 1)
        sc = c["splits"][split]
        assert sc["rows"] == n and sc["positive_share"] == pytest.approx(1 / (k + 1))
        assert sc["history_mean"] == pytest.approx(np.mean([len(h) for _, h, _ in ref]))
        assert sc["history_median"] == pytest.approx(np.median([len(h) for _, h, _ in ref]))
        rows, src = read_rows(out / task, split, "time")
        assert sorted(rows) == list(range(n))             # time order = file order, all rows
        check_ml_rows(rows, ref, seqs, raw, k)
        if split == "train":
            assert len(src.index.rows) > 1                # several row groups, users whole
            rows, _ = read_rows(out / task, split, "shuffle", batch_size=5, seed=2)
            assert len(rows) == n - n % 5
            check_ml_rows(rows, ref, seqs, raw, k)
    want = FeatureSchema(
        tables=(Table("user", 5), Table("gender", 2), Table("age", 4), Table("occupation", 4),
                Table("item", 31), Table("genre", 6)),
        sparse=tuple(SparseFeature(n, n) for n in ("user", "gender", "age", "occupation",
                                                   "item", "genre")),
        sequences=(SequenceFeature("history", (EventField("item", "item"),
                                               EventField("genre", "genre")), 4),),
        tasks=("label",))
    with open(out / task / "schema.json") as f:
        saved = json.load(f)
    assert FeatureSchema.from_dict(saved) == want and want.to_dict() == saved


def test_movielens_valid_split_takes_the_last_train_item(ml_out, tmp_path):
    d, out, seqs, _ = ml_out
    counts = cm.convert(str(d), str(tmp_path), seed=1, negatives=3, max_history=4,
                        row_group_rows=10, valid=True)
    for task, k in (("ranking", 3), ("retrieval", 0)):
        raw = counts[task]["raw_ids"]
        for split in ("train", "valid"):
            ref = ml_reference(seqs, split, 4, valid=True)
            rows, _ = read_rows(tmp_path / task, split, "time")
            assert len(rows) == len(ref) * (k + 1) == counts[task]["splits"][split]["rows"]
            check_ml_rows(rows, ref, seqs, raw, k)
        before, _ = read_rows(out / task, "test", "time")            # test rows unchanged
        assert read_rows(tmp_path / task, "test", "time")[0] == before


def test_movielens_negatives_are_seeded_and_cover_the_unrated_items(ml_out, tmp_path):
    d, out, seqs, _ = ml_out
    cm.convert(str(d), str(tmp_path / "same"), tasks=("ranking",), seed=1, negatives=3,
               max_history=4, row_group_rows=10)
    cm.convert(str(d), str(tmp_path / "other"), tasks=("ranking",), seed=2, negatives=3,
               max_history=4, row_group_rows=10)
    items = {name: pq.read_table(p / "ranking" / "train.parquet").column("item").to_pylist()
             for name, p in (("first", out), ("same", tmp_path / "same"),
                             ("other", tmp_path / "other"))}
    assert items["first"] == items["same"] and items["first"] != items["other"]
    # user 7 (index 4): 12 train positions x 3 negatives drawn from its 12 unrated items
    rows, _ = read_rows(out / "ranking", "train", "time")
    negs = {s["item"] for s in rows.values() if s["user"] == 4 and s["label"] == 0}
    assert negs <= set(ITEMS) - set(seqs[7]) and len(negs) >= 8


def test_movielens_train_positions_keeps_the_last_targets(ml_out, tmp_path):
    d, _, seqs, _ = ml_out
    cm.convert(str(d), str(tmp_path), tasks=("retrieval",), max_history=4, train_positions=2)
    rows, _ = read_rows(tmp_path / "retrieval", "train", "time")
    ref = []
    for uid in sorted(seqs):
        ref += [x for x in ml_reference(seqs, "train", 4) if x[0] == uid][-2:]
    assert len(rows) == len(ref)
    assert [(s["history.item"], s["item"]) for _, s in sorted(rows.items())] == \
        [(h, t) for _, h, t in ref]


def test_movielens_bad_inputs_are_named(tmp_path):
    d = tmp_path / "ml"
    d.mkdir()
    with pytest.raises(FileNotFoundError, match="train.csv.zip not found"):
        cm.convert(str(d), str(tmp_path / "o"))
    write_ml(d)
    with pytest.raises(ValueError, match="--negatives must be >= 0"):
        cm.convert(str(d), str(tmp_path / "o"), negatives=-1)
    with pytest.raises(ValueError, match="--tasks"):
        cm.convert(str(d), str(tmp_path / "o"), tasks=("ctr",))
    line = "9-6041-6044-6051,{}-3707\n"                    # user 9 rates every item
    with zipfile.ZipFile(d / "train.csv.zip", "w") as z:
        z.writestr("train.csv", "".join(line.format(i) for i in ITEMS[:-1]))
    (d / "test.csv").write_text(line.format(ITEMS[-1]))
    with pytest.raises(ValueError, match="user index 0 rated all 26 items"):
        cm.convert(str(d), str(tmp_path / "o"))


def test_output_inside_a_git_work_tree_is_refused(tmp_path):
    (tmp_path / "repo" / ".git").mkdir(parents=True)
    with pytest.raises(ValueError, match="inside the git work tree"):
        check_out_dir(str(tmp_path / "repo" / "data" / "ml"))
    assert not (tmp_path / "repo" / "data").exists()
    r = subprocess.run([sys.executable, "experiments/convert_frappe.py",
                        f"--data_dir={tmp_path}", "--out=runs/frappe-data"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "lies inside the git work tree" in r.stderr
    assert not os.path.exists(os.path.join(ROOT, "runs", "frappe-data"))


# ----------------------------------------------------------------------------- real data

@pytest.mark.skipif(not os.path.isdir(ML_DIR) or not os.path.isdir(FRAPPE_DIR),
                    reason="../shared/datasets is absent")
def test_real_datasets_match_their_readme(tmp_path):
    counts = cf.convert(FRAPPE_DIR, str(tmp_path / "frappe"))
    s = counts["splits"]
    assert s["train"]["rows"] + s["holdout"]["rows"] == 57_722 and s["test"]["rows"] == 28_860
    assert counts["table_rows"] == 5_382
    assert 0.3 < s["test"]["positive_share"] < 0.36                       # ~33% positive
    counts = cm.convert(ML_DIR, str(tmp_path / "ml"), max_users=60, negatives=2)
    for task in cm.TASKS:
        c = counts[task]
        assert c["dataset_users"] == 6_040 and c["items"] == 3_706
        assert c["dataset_interactions"] == 1_000_209
        assert c["users"] == 60 and c["splits"]["test"]["users"] == 60
        assert c["splits"]["test"]["rows"] == 60 * (c["negatives"] + 1)
        assert c["splits"]["train"]["history_max"] == 200
    rows, _ = read_rows(tmp_path / "ml" / "ranking", "test", "time")
    assert sum(s["label"] for s in rows.values()) == 60
