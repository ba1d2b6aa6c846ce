"""Frappe libsvm reader on small files written here (the real data stays in ../shared)."""

import numpy as np
import pytest

from gemjax.data.frappe import load_frappe, load_libsvm


def write(path, lines):
    path.write_text("".join(l + "\n" for l in lines))
    return str(path)


def test_load_libsvm_parses_ids_and_labels(tmp_path):
    p = write(tmp_path / "a.libsvm", ["1 3:1 10:1 12:1", "0 0:1 9:1 14:1", ""])
    ids, y = load_libsvm(p)
    np.testing.assert_array_equal(ids, [[3, 10, 12], [0, 9, 14]])
    np.testing.assert_array_equal(y, [1, 0])
    assert ids.dtype == np.int32 and y.dtype == np.float32


@pytest.mark.parametrize("bad,match", [("2 3:1 4:1", "label 0/1"), ("1 3:0.5 4:1", "id:1"),
                                       ("1 3:1", "fields"), ("1 x:1 4:1", "cannot parse")])
def test_load_libsvm_errors_name_file_and_line(tmp_path, bad, match):
    p = write(tmp_path / "b.libsvm", ["0 1:1 2:1", bad])
    with pytest.raises(ValueError, match=match) as e:
        load_libsvm(p)
    assert "b.libsvm:2" in str(e.value)


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
