"""Negatives resampled per epoch (gemjax.data.negatives) against plain-Python references:
the k-th allowed item of a user computed from sets, the draws' spread, a positives-only
Parquet file read through ResampledNegatives (resume gives the same negatives, another
epoch others), and the MovieLens converter's --resample_negatives output through
make_source."""

import dataclasses
import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from experiments import convert_movielens as cm
from gemjax.config import get_config
from gemjax.features import FeatureSchema
from gemjax.data.negatives import NegativeSampler, ResampledNegatives, draw_keys
from gemjax.data.parquet import ParquetColumns, ParquetSource, SequenceColumns
from gemjax.data.source import make_source
from tests.test_converters import ITEMS, write_ml

ITEM_ROWS = [2, 3, 5, 8, 9, 11, 12, 15]             # items that may be drawn
RATED = {0: [3, 9, 100], 1: [], 2: [2, 3, 5, 8, 9, 11, 12]}     # 100: not an item


def sampler() -> NegativeSampler:
    off = np.cumsum([0] + [len(RATED[u]) for u in range(3)])
    rated = [i for u in range(3) for i in RATED[u]]
    return NegativeSampler.build("user", "item", ITEM_ROWS,
                                 {"genre": [i % 4 for i in ITEM_ROWS]}, off, rated)


def test_draws_are_the_kth_allowed_item():
    s = sampler()
    users = np.array([0, 1, 2, 0, 2])
    keys = draw_keys(7, np.zeros(5, np.int64), np.arange(5), 6)
    got = s.items[s.draw(users, keys)]
    for r, u in enumerate(users):
        allowed = sorted(set(ITEM_ROWS) - set(RATED[int(u)]))
        for j in range(6):
            k = (int(keys[r, j]) >> 32) * len(allowed) >> 32      # the documented k
            assert got[r, j] == allowed[k]
    assert (got[users == 2] == 15).all()                           # its one allowed item
    neg = s.negatives(users, 7, np.zeros(5, np.int64), np.arange(5), 6)
    assert (neg["genre"] == neg["item"] % 4).all()


def test_draws_are_uniform_over_the_allowed_items():
    s = sampler()
    n = 6000
    got = s.items[s.draw(np.zeros(n, np.int64), draw_keys(0, np.zeros(n), np.arange(n), 1))][:, 0]
    allowed = sorted(set(ITEM_ROWS) - set(RATED[0]))
    counts = np.array([(got == i).sum() for i in allowed])
    assert counts.sum() == n                                       # never a rated item
    expect = n / len(allowed)
    assert ((counts - expect) ** 2 / expect).sum() < 20.5          # chi2, 5 dof, p ~ 0.001


def test_bad_sampler_inputs_are_named(tmp_path):
    with pytest.raises(ValueError, match="user 0 excludes all 2 items"):
        NegativeSampler.build("user", "item", [1, 2], {}, [0, 2], [1, 2])
    with pytest.raises(ValueError, match="sorted list of distinct"):
        NegativeSampler.build("user", "item", [2, 1], {}, [0, 0], [])
    with pytest.raises(ValueError, match="side column 'genre'"):
        NegativeSampler.build("user", "item", [1, 2], {"genre": [0]}, [0, 0], [])
    bad = tmp_path / "n.npz"
    np.savez(bad, items=np.arange(3))
    with pytest.raises(ValueError, match=r"n.npz: missing arrays \['user_column'"):
        NegativeSampler.load(str(bad))
    with pytest.raises(FileNotFoundError, match="nope.npz not found"):
        NegativeSampler.load(str(tmp_path / "nope.npz"))
    with pytest.raises(ValueError, match="user id 3 is outside the sampler's 3 users"):
        sampler().draw(np.array([3]), draw_keys(0, [0], [0], 1))


def test_save_and_load_round_trip(tmp_path):
    s = sampler()
    s.save(str(tmp_path / "n.npz"))
    t = NegativeSampler.load(str(tmp_path / "n.npz"))
    keys = draw_keys(3, np.arange(4), np.arange(4), 5)
    users = np.array([0, 1, 2, 1])
    assert np.array_equal(s.draw(users, keys), t.draw(users, keys))
    assert t.columns == ("item", "genre")


def positives_file(path, users=(0, 1, 2, 0, 1, 2, 0, 1)):
    """One positive per user entry: item 12 + user, history of user + 1 events."""
    n = len(users)
    hist = [[20 + u] * (u + 1) for u in users]
    pq.write_table(pa.table({
        "user": pa.array(users, pa.int32()), "item": pa.array([12 + u for u in users], pa.int32()),
        "genre": pa.array([(12 + u) % 4 for u in users], pa.int32()),
        "history_item": pa.array(hist, pa.list_(pa.int32())),
        "label": pa.array(np.ones(n, np.float32))}), path, row_group_size=3)
    return hist


COLS = ParquetColumns(sparse=("user", "item", "genre"), labels=("label",),
                      sequences=(SequenceColumns("history", (("item", "history_item"),), cap=8),))


@pytest.mark.parametrize("order", ["time", "shuffle"])
def test_resampled_batches(tmp_path, order):
    path = str(tmp_path / "pos.parquet")
    hist = positives_file(path)
    make = lambda: ResampledNegatives(ParquetSource(path, COLS, 4, seed=5, order=order, window=3),
                                      sampler(), 3)
    src = make()
    assert src.local_batch_size(2) == 8 and src.batch_size == 16
    steps = src.steps_per_epoch(1)                 # 8 positives, 4 a step: 2 steps an epoch
    assert steps == 2
    seen = {}
    for step in range(3 * steps):
        b, info = src.shard_batch(step, 0, 1)
        assert b.labels.shape == (16, 1) and (b.label_mask == 1).all()
        assert (b.labels[:, 0] == np.tile([1, 0, 0, 0], 4)).all()
        rows = info.rows.reshape(4, 4)
        assert (rows == rows[:, :1]).all()
        user, item = b.sparse["user"].reshape(4, 4), b.sparse["item"].reshape(4, 4)
        assert (user == user[:, :1]).all() and (item[:, 0] == 12 + user[:, 0]).all()
        assert (b.sparse["genre"] == b.sparse["item"] % 4).all()
        for r in range(4):
            u = int(user[r, 0])
            assert set(item[r, 1:]) <= set(ITEM_ROWS) - set(RATED[u])
        jag = b.sequences["history"]
        for i in range(16):                        # every row carries its positive's history
            lo, hi = jag.offsets[i], jag.offsets[i + 1]
            assert list(jag.values["item"][lo:hi]) == hist[int(info.rows[i])]
        for r in range(4):
            seen.setdefault(int(rows[r, 0]), []).append((step // steps, tuple(item[r, 1:])))
        again, _ = make().shard_batch(step, 0, 1)  # a fresh source (a resumed run): same bytes
        assert all(np.array_equal(again.sparse[c], b.sparse[c]) for c in b.sparse)
    # user 0 and 1 rows get other negatives in other epochs (user 2 has one allowed item)
    changed = [len({negs for _, negs in draws}) > 1 for row, draws in seen.items()
               if RATED[[0, 1, 2, 0, 1, 2, 0, 1][row]] != RATED[2]]
    assert all(len({e for e, _ in draws}) == 3 for draws in seen.values())
    assert all(changed)


def test_sampler_ids_outside_the_tables_are_refused(tmp_path):
    path = str(tmp_path / "pos.parquet")
    positives_file(path)
    cols = dataclasses.replace(COLS, vocab=(("item", 15),))
    with pytest.raises(ValueError, match=r"column 'item' holds ids in \[2, 15\], outside its "
                                         r"table's 15 rows"):
        ResampledNegatives(ParquetSource(path, cols, 4, order="time"), sampler(), 3)


def test_other_seeds_draw_other_negatives(tmp_path):
    path = str(tmp_path / "pos.parquet")
    positives_file(path)
    got = [ResampledNegatives(ParquetSource(path, COLS, 4, seed=s, order="time"), sampler(), 3)
           .shard_batch(0, 0, 1)[0].sparse["item"] for s in (1, 2)]
    assert not np.array_equal(*got)


def test_converter_writes_positives_and_a_sampler_make_source_reads(tmp_path):
    d = tmp_path / "ml"
    d.mkdir()
    seqs = write_ml(d)
    out = tmp_path / "out"
    counts = cm.convert(str(d), str(out), seed=1, negatives=3, max_history=4,
                        row_group_rows=10, valid=True, resample_negatives=True)["ranking"]
    cm.convert(str(d), str(tmp_path / "fixed"), seed=1, negatives=3, max_history=4,
               row_group_rows=10, valid=True)
    for split in ("train", "valid", "test"):                     # retrieval: unchanged
        assert pq.read_table(out / "retrieval" / f"{split}.parquet").equals(
            pq.read_table(tmp_path / "fixed" / "retrieval" / f"{split}.parquet"))
    for split in ("valid", "test"):                              # fixed negatives: unchanged
        assert pq.read_table(out / "ranking" / f"{split}.parquet").equals(
            pq.read_table(tmp_path / "fixed" / "ranking" / f"{split}.parquet"))
    r = out / "ranking"
    assert counts["train_negatives"] == "resampled per epoch"
    train = pq.read_table(r / "train.parquet")
    assert set(train.column("label").to_pylist()) == {1.0}
    n_train = sum(max(len(s) - 3, 0) for s in seqs.values())    # t = 1..L-2, L = len - 1
    assert train.num_rows == n_train
    assert counts["splits"]["valid"]["rows"] == 4 * sum(len(s) >= 3 for s in seqs.values())
    s = NegativeSampler.load(str(r / "negatives.npz"))
    assert list(s.items) == ITEMS
    uids = sorted(seqs)
    for u, uid in enumerate(uids):
        ex = s.items[s.excl_ranks[s.excl_offsets[u]:s.excl_offsets[u + 1]]]
        assert sorted(ex) == sorted(set(seqs[uid]))
    with open(r / "schema.json") as f:
        schema = FeatureSchema.from_dict(json.load(f))
    base = get_config("tiny")
    cfg = dataclasses.replace(base, features=schema, data=dataclasses.replace(
        base.data, source="parquet", train_path=str(r / "train.parquet"),
        eval_path=str(r / "test.parquet"), negatives=3, batch_size=8))
    src = make_source(cfg, "train")
    b, info = src.shard_batch(0, 0, 1)
    assert b.labels[:, 0].tolist() == [1, 0, 0, 0] * 2
    for i in range(8):
        uid = uids[int(b.sparse["user"][i])]
        if i % 4:
            assert b.sparse["item"][i] not in seqs[uid] and b.sparse["item"][i] in ITEMS
    ev = make_source(cfg, "eval")                                  # test rows as written
    assert isinstance(ev, ParquetSource) and ev.shard_batch(0, 0, 1)[0].labels.shape == (8, 1)
    bad = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, negatives_path=str(tmp_path)))
    with pytest.raises(ValueError, match="not an .npz file"):
        make_source(bad, "train")
    os.remove(r / "negatives.npz")
    with pytest.raises(FileNotFoundError, match="negatives.npz not found"):
        make_source(cfg, "train")


def test_config_checks_negatives():
    with pytest.raises(ValueError, match="needs data.source=parquet"):
        get_config("tiny", "data.negatives=3")
    with pytest.raises(ValueError, match=r"multiple of 1 \+ data.negatives"):
        get_config("tiny", "data.negatives=3,data.batch_size=10")


@pytest.mark.parametrize("order,shards", [("time", 1), ("shuffle", 1), ("shuffle", 2)])
def test_epochs_of_counts_passes_over_the_rows(tmp_path, order, shards):
    """Within a lane (shuffle) or the file (time), the rows served in epoch e are every
    row of that lane once; epochs rise by one at a time."""
    path = str(tmp_path / "pos.parquet")
    positives_file(path, users=tuple(i % 3 for i in range(11)))
    src = ParquetSource(path, COLS, 2 * shards, seed=3, order=order, window=4)
    for shard in range(shards):
        served = {}
        for step in range(14):
            rows = src.rows_of(step, shard, shards)
            for r, e in zip(rows, src.epochs_of(step, shard, shards)):
                served.setdefault(int(e), []).append(int(r))
        lane = 11 if order == "time" else 11 // shards
        epochs = sorted(served)
        assert epochs == list(range(len(epochs))) and len(epochs) >= 2
        for e in epochs[:-1]:                      # complete epochs
            assert len(served[e]) == lane == len(set(served[e]))
