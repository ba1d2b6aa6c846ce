"""MovieLens reader and full-ranking metrics on small files written here."""

import zipfile

import numpy as np
import pytest

from gemjax.data.movielens import leave_last_out, load_movielens, ranking_metrics


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


def test_bad_line_names_file_and_line(tmp_path):
    d = write_ml(tmp_path, ["1-2-3-4,5-6", "1-2-3,5-6"], ["1-2-3-4,5-6"])
    with pytest.raises(ValueError, match="train.csv:2"):
        load_movielens(d)


def test_ranking_metrics_against_hand_computed_ranks():
    scores = np.array([[0.0, 0.9, 0.1, 0.5],     # target 2: two items higher -> rank 2
                       [0.0, 0.2, 0.3, 0.1],     # target 2: rank 0
                       [0.0, 0.4, 0.4, 0.9]])    # target 1: one strictly higher (tie ignored)
    m = ranking_metrics(scores, np.array([2, 2, 1]), ks=(1, 2, 3))
    assert m["hr@1"] == pytest.approx(1 / 3)
    assert m["hr@2"] == pytest.approx(2 / 3)
    assert m["hr@3"] == pytest.approx(1.0)
    assert m["ndcg@3"] == pytest.approx((1 / np.log2(4) + 1 + 1 / np.log2(3)) / 3)
    with pytest.raises(ValueError, match="outside"):
        ranking_metrics(scores, np.array([2, 2, 4]))
