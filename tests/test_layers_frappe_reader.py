"""Frappe libsvm reader on small files written here (the real data stays in ../shared)."""

import numpy as np
import pytest

from gemjax.data.frappe import load_frappe, load_libsvm
from gemjax.data.vocab import SLACK, table_rows


def write(path, lines):
    path.write_text("".join(l + "\n" for l in lines))
    return str(path)


def test_load_libsvm_parses_ids_and_labels(tmp_path):
    p = write(tmp_path / "a.libsvm", ["1 3:1 10:1 12:1", "0 0:1 9:1 14:1", ""])
    ids, y = load_libsvm(p)
    np.testing.assert_array_equal(ids, [[3, 10, 12], [0, 9, 14]])
    np.testing.assert_array_equal(y, [1, 0])
    assert ids.dtype == np.int64 and y.dtype == np.float32


@pytest.mark.parametrize("bad,match", [
    ("2 3:1 4:1", "label 0/1"), ("x 3:1 4:1", "label 0/1"),
    ("1 3:0.5 4:1", "field 1: expected id:1"),
    ("1 3:1", "1 fields, the first row had 2"), ("1 x:1 4:1", "field 1: cannot parse"),
    ("1 3:1 4", "field 2: cannot parse"), ("1 3:1 4:", "field 2: expected id:1"),   # truncated
    ("1 3:1 -4:1", "field 2: cannot parse"), ("1 3:1 4:1:1", "field 2: expected id:1"),
    ("1 3:1 4e3:1", "field 2: cannot parse"),
    ("1 3:1 10000000000000000000:1", "field 2: id 10000000000000000000 does not fit in int64")])
def test_load_libsvm_errors_name_file_line_and_field(tmp_path, bad, match):
    p = write(tmp_path / "b.libsvm", ["0 1:1 2:1", bad, "0 1:1 2:1"])
    with pytest.raises(ValueError, match=match) as e:
        load_libsvm(p)
    assert "b.libsvm:2:" in str(e.value)


def test_load_libsvm_refuses_empty_and_undecodable_files(tmp_path):
    p = write(tmp_path / "empty.libsvm", ["", "  "])
    with pytest.raises(ValueError, match="empty.libsvm holds no rows"):
        load_libsvm(p)
    p = tmp_path / "latin.libsvm"
    p.write_bytes(b"0 1:1 2:1\n1 1:1 \xe9:1\n")
    with pytest.raises(ValueError, match="latin.libsvm:2: not UTF-8"):
        load_libsvm(str(p))


def test_load_frappe_empty_test_file_names_it(tmp_path):
    write(tmp_path / "valid.libsvm", ["1 2:1 3:1", "0 4:1 6:1"])
    write(tmp_path / "test.libsvm", [])
    with pytest.raises(ValueError, match="test.libsvm holds no rows"):
        load_frappe(str(tmp_path))
    write(tmp_path / "test.libsvm", ["1 2:1 3:1 4:1"])
    with pytest.raises(ValueError, match="test.libsvm has 3 fields per row, .*valid.libsvm 2"):
        load_frappe(str(tmp_path))


def test_load_frappe_splits_valid_and_keeps_test(tmp_path):
    rng = np.random.default_rng(0)
    rows = [f"{rng.integers(2)} {rng.integers(5)}:1 {5 + rng.integers(5)}:1" for _ in range(50)]
    write(tmp_path / "valid.libsvm", rows)
    write(tmp_path / "test.libsvm", ["1 2:1 17:1", "0 4:1 6:1"])
    d = load_frappe(str(tmp_path), holdout_fraction=0.2, seed=1)
    assert len(d.train[1]) == 40 and len(d.holdout[1]) == 10 and len(d.test[1]) == 2
    assert d.num_features == 18 and d.num_fields == 2
    both = np.concatenate([d.train[0], d.holdout[0]])
    assert sorted(map(tuple, both)) == sorted(
        (int(r.split()[1][:-2]), int(r.split()[2][:-2])) for r in rows)
    with pytest.raises(ValueError, match="holdout_fraction"):
        load_frappe(str(tmp_path), holdout_fraction=1.0)


@pytest.mark.parametrize("big", [3_000_000_000, 200_000_000, 10**12, 2**63 - 1])
def test_huge_sparse_ids_give_a_table_of_the_ids_present(tmp_path, big):
    """Ids far beyond the distinct count (3e9 overflows int32; 2e8 among small ids) are
    remapped in increasing order: one row per distinct id, raw_ids maps rows back."""
    rng = np.random.default_rng(0)
    raw = [[int(rng.integers(20)), 100 + int(rng.integers(5))] for _ in range(40)]
    raw[7][1] = big
    raw[30][0] = big - 1
    write(tmp_path / "valid.libsvm", [f"{i % 2} {a}:1 {b}:1" for i, (a, b) in enumerate(raw)])
    write(tmp_path / "test.libsvm", ["1 3:1 7:1", f"0 {big}:1 55:1"])
    d = load_frappe(str(tmp_path), holdout_fraction=0.25, seed=0)
    every = sorted({x for r in raw for x in r} | {3, 7, big, 55})
    assert d.num_features == len(every) and d.raw_ids.tolist() == every
    for part in (d.train, d.holdout, d.test):
        assert part[0].dtype == np.int32 and part[0].min() >= 0
        assert part[0].max() < d.num_features
    got = np.concatenate([d.train[0], d.holdout[0]])
    assert sorted(map(tuple, d.raw_ids[got].tolist())) == sorted(map(tuple, raw))
    assert d.raw_ids[d.test[0]].tolist() == [[3, 7], [big, 55]]


def test_table_rows_keeps_nearly_dense_ids_and_bounds_the_rest():
    ids = np.array([[5, 0], [9, 5]])
    rows, raw = table_rows(ids)
    np.testing.assert_array_equal(rows, ids)                 # raw ids are the rows
    np.testing.assert_array_equal(raw, np.arange(10))
    edge = 2 * 3 + SLACK - 1         # 3 distinct ids: a table of edge + 1 rows is kept
    rows, raw = table_rows(np.array([0, 1, edge]))
    assert rows.tolist() == [0, 1, edge] and len(raw) == edge + 1
    rows, raw = table_rows(np.array([0, 1, edge + 1, 1]))    # one row more: remapped
    assert rows.tolist() == [0, 1, 2, 1] and raw.tolist() == [0, 1, edge + 1]
    rows, raw = table_rows(np.array([4, 10**12, 4]), first=1)   # rows below first reserved
    assert rows.tolist() == [1, 2, 1] and raw.tolist() == [0, 4, 10**12]
    with pytest.raises(ValueError, match=">= 1"):
        table_rows(np.array([0, 3]), first=1)
