"""MovieLens reader and full-ranking metrics on small files written here."""

import zipfile

import numpy as np
import pytest

from gemjax.data.movielens import leave_last_out, load_movielens
from gemjax.train.ranking import ranking_metrics


def write_ml(tmp_path, train_lines, test_lines):
    with zipfile.ZipFile(tmp_path / "train.csv.zip", "w") as z:
        z.writestr("train.csv", "".join(l + "\n" for l in train_lines))
    (tmp_path / "test.csv").write_text("".join(l + "\n" for l in test_lines))
    return str(tmp_path)


def test_load_and_split(tmp_path):
    train = ["2-10-11-12,7-20", "1-13-11-12,3-21", "2-10-11-12,5-22", "1-13-11-12,4-20",
             "1-13-11-12,9-23"]
    d = write_ml(tmp_path, train, ["1-13-11-12,7-20", "2-10-11-12,3-21"])
    ml = load_movielens(d)
    np.testing.assert_array_equal(ml.histories[0], [3, 4, 9])
    np.testing.assert_array_equal(ml.histories[1], [7, 5])
    np.testing.assert_array_equal(ml.test_items, [7, 3])
    np.testing.assert_array_equal(ml.user_features, [[13, 11, 12], [10, 11, 12]])
    assert ml.num_items == 9 and ml.item_genre[9] == 23 and ml.item_genre[5] == 22
    np.testing.assert_array_equal(np.flatnonzero(ml.item_present), [3, 4, 5, 7, 9])
    s = leave_last_out(ml, max_len=2)
    np.testing.assert_array_equal(s["valid"][1], [9, 5])
    np.testing.assert_array_equal(s["valid"][0][0], [3, 4])
    np.testing.assert_array_equal(s["test"][0][0], [4, 9])      # cut to the 2 most recent
    np.testing.assert_array_equal(s["test"][1], [7, 3])


@pytest.mark.parametrize("bad,match", [
    ("1-2-3,5-6", "3 '-'-separated fields in '1-2-3', expected 4"),
    ("1-2-3-4,5", "1 '-'-separated fields in '5', expected 2 .item-genre."),      # truncated
    ("1-2-3-4", "0 commas, expected 1"), ("1-2-3-4,5-6,7", "2 commas"),
    ("1-x-3-4,5-6", "field gender: 'x' is not a non-negative integer"),
    ("1-2-3-4,5-6e3", "field genre: '6e3'"), ("1-2--4,5-6", "field age: ''"),
    ("1-2-3-4,0-6", "field item: item ids start at 1"),
    ("1-2-3-4,5-99999999999999999999", "field genre: 99999999999999999999 does not fit")])
def test_bad_line_names_file_line_and_field(tmp_path, bad, match):
    d = write_ml(tmp_path, ["1-2-3-4,5-6", bad, "1-2-3-4,7-6"], ["1-2-3-4,5-6"])
    with pytest.raises(ValueError, match=match) as e:
        load_movielens(d)
    assert "train.csv.zip/train.csv:2:" in str(e.value)
    d = write_ml(tmp_path, ["1-2-3-4,5-6"], ["1-2-3-4,5-6", bad])
    with pytest.raises(ValueError, match=match) as e:
        load_movielens(d)
    assert f"{tmp_path / 'test.csv'}:2:" in str(e.value)


def test_empty_files_and_a_zip_without_its_member_are_named(tmp_path):
    d = write_ml(tmp_path, ["1-2-3-4,5-6"], ["", " "])
    with pytest.raises(ValueError, match="test.csv holds no rows"):
        load_movielens(d)
    d = write_ml(tmp_path, [], ["1-2-3-4,5-6"])
    with pytest.raises(ValueError, match="train.csv.zip/train.csv holds no rows"):
        load_movielens(d)
    with zipfile.ZipFile(tmp_path / "train.csv.zip", "w") as z:
        z.writestr("__MACOSX/._train.csv", "junk")
        z.writestr("ratings.csv", "1-2-3-4,5-6\n")
    with pytest.raises(ValueError, match=r"train.csv.zip: expected one train.csv member .*"
                       r"found 0 among \['__MACOSX/._train.csv', 'ratings.csv'\]"):
        load_movielens(d)
    (tmp_path / "train.csv.zip").write_bytes(b"1-2-3-4,5-6\n")       # not a zip
    with pytest.raises(ValueError, match="train.csv.zip: not a readable zip archive"):
        load_movielens(d)
    d = write_ml(tmp_path, ["1-2-3-4,5-6"], [])
    (tmp_path / "test.csv").write_bytes(b"1-2-3-4,5-6\n\xff-2-3-4,5-6\n")
    with pytest.raises(ValueError, match="test.csv:2: not UTF-8"):
        load_movielens(d)


def test_damaged_zip_member_is_named(tmp_path):
    """Digits changed inside a stored member: the lines still parse, the CRC does not."""
    with zipfile.ZipFile(tmp_path / "train.csv.zip", "w", zipfile.ZIP_STORED) as z:
        z.writestr("train.csv", "".join(f"1-2-3-4,{i + 1}-6\n" for i in range(50)))
    (tmp_path / "test.csv").write_text("1-2-3-4,5-6\n")
    raw = bytearray((tmp_path / "train.csv.zip").read_bytes())
    at = raw.index(b"1-2-3-4,17-6")
    raw[at + 8:at + 10] = b"71"
    (tmp_path / "train.csv.zip").write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="train.csv.zip/train.csv: damaged archive member"):
        load_movielens(str(tmp_path))


def test_users_need_one_test_row_each(tmp_path):
    d = write_ml(tmp_path, ["1-2-3-4,5-6"], ["1-2-3-4,5-6", "2-2-3-4,7-6", "1-2-3-4,8-6"])
    with pytest.raises(ValueError, match=r"test.csv:3: user 1 already has a test row \(line 1\)"):
        load_movielens(d)
    d = write_ml(tmp_path, ["1-2-3-4,5-6", "3-2-3-4,5-6"], ["1-2-3-4,5-6"])
    with pytest.raises(ValueError, match="train.csv:2: user 3 has no row in .*test.csv"):
        load_movielens(d)


@pytest.mark.parametrize("big", [3_000_000_000, 10**12, 2**63 - 1])
def test_huge_sparse_ids_give_tables_of_the_ids_present(tmp_path, big):
    """Users, items and genres far beyond their distinct counts: the tables have one row
    per id present and the data equal a file with the same ids renumbered densely."""
    def lines(u_of, i_of, g_of, rows):
        return [f"{u_of[u]}-7-8-9,{i_of[i]}-{g_of[g]}" for u, i, g in rows]
    train = [(0, 0, 0), (1, 1, 1), (0, 2, 1), (1, 0, 0), (0, 3, 0), (1, 2, 1)]
    test = [(1, 3, 0), (0, 1, 1)]
    sparse = ({0: 5, 1: big}, {0: 4, 1: big - 3, 2: 9, 3: big}, {0: 3707, 1: big})
    dense = ({0: 1, 1: 2}, {0: 1, 1: 3, 2: 2, 3: 4}, {0: 0, 1: 1})    # ranks (items from 1)
    ml = load_movielens(write_ml(tmp_path, lines(*sparse, train), lines(*sparse, test)))
    assert ml.num_items == 4 and len(ml.item_present) == 5 and ml.item_present[1:].all()
    assert int(ml.item_genre.max()) + 1 == 2 and len(ml.histories) == 2
    assert ml.user_ids.tolist() == [5, big] and ml.item_ids.tolist() == [0, 4, 9, big - 3, big]
    assert ml.genre_ids.tolist() == [3707, big]
    ref_dir = tmp_path / "dense"
    ref_dir.mkdir()
    ref = load_movielens(write_ml(ref_dir, lines(*dense, train), lines(*dense, test)))
    assert ref.item_ids.tolist() == list(range(5)) and ref.genre_ids.tolist() == [0, 1]
    for a, b in zip(ml.histories, ref.histories, strict=True):
        np.testing.assert_array_equal(a, b)
    for f in ("test_items", "item_genre", "item_present", "user_features"):
        np.testing.assert_array_equal(getattr(ml, f), getattr(ref, f))


def test_ranking_metrics_against_hand_computed_ranks():
    scores = np.array([[0.0, 0.9, 0.1, 0.5],     # target 2: two items higher -> rank 2
                       [0.0, 0.2, 0.3, 0.1],     # target 2: rank 0
                       [0.0, 0.4, 0.4, 0.9]])    # target 1: one strictly higher (tie ignored)
    m = ranking_metrics(scores, np.array([2, 2, 1]), ks=(1, 2, 3))
    assert m["hr@1"] == pytest.approx(1 / 3)
    assert m["hr@2"] == pytest.approx(2 / 3)
    assert m["hr@3"] == pytest.approx(1.0)
    assert m["ndcg@3"] == pytest.approx((1 / np.log2(4) + 1 + 1 / np.log2(3)) / 3)
    assert m["mrr"] == pytest.approx((1 / 3 + 1 + 1 / 2) / 3)
    with pytest.raises(ValueError, match="outside"):
        ranking_metrics(scores, np.array([2, 2, 4]))
