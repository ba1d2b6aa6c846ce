"""The drifting stream (gemjax.data.drift) and new-id admission (gemjax.sparse.admission)."""

import numpy as np
import pytest

from gemjax.config import get_config
from gemjax.data.drift import DriftingStream, new_block, per_category
from gemjax.sparse.admission import FrequencyAdmission, bucket_of
from gemjax.train.metrics import ne

DRIFT = ("data.drift_every=3,data.drift_strength=0.6,data.popularity_shift=5,"
         "data.new_id_rate=0.1,data.item_bias=0.5")


def _stream(overrides=DRIFT, seed=0):
    return DriftingStream(get_config("tiny", overrides).data, seed)


def _window_ne(stream, window, teacher_window=None):
    """(NE of the window's labels under its own teacher, under `teacher_window`'s)."""
    y, own, other = [], [], []
    for step in stream.window_steps(window):
        b, info = stream.shard_batch(step, 0, 2)
        b2, info2 = stream.shard_batch(step, 0, 2, teacher_window=teacher_window)
        y.append(b.labels[:, 0])
        own.append(info.true_probs[:, 0])
        other.append(info2.true_probs[:, 0])
    y = np.concatenate(y)
    return ne(y, np.concatenate(own)), ne(y, np.concatenate(other))


def test_drift_degrades_the_window0_label_function():
    s = _stream()
    bayes0, same = _window_ne(s, 0, teacher_window=0)
    assert bayes0 == same
    for k in (1, 3):
        bayes_k, with_teacher0 = _window_ne(s, k, teacher_window=0)
        assert with_teacher0 > bayes_k + 0.1, (k, bayes_k, with_teacher0)
    # no drift: window 3's labels are window 0's label function
    still = _stream(DRIFT.replace("drift_strength=0.6", "drift_strength=0.0"))
    bayes3, with_teacher0 = _window_ne(still, 3, teacher_window=0)
    assert bayes3 == with_teacher0


def test_deterministic_and_popularity_moves():
    a, b = _stream(), _stream()
    for step in (7, 2, 7):                      # any order, fresh objects
        x, xi = a.shard_batch(step, 1, 2)
        y, yi = b.shard_batch(step, 1, 2)
        np.testing.assert_array_equal(x.sparse["item"], y.sparse["item"])
        np.testing.assert_array_equal(x.sequences["clicks"].values["item"],
                                      y.sequences["clicks"].values["item"])
        np.testing.assert_array_equal(x.labels, y.labels)
        np.testing.assert_array_equal(xi.true_probs, yi.true_probs)
    assert not np.array_equal(_stream(seed=1).shard_batch(7, 1, 2)[0].labels, x.labels)
    cfg = get_config("tiny", DRIFT).data
    s, C = _stream(), cfg.synthetic.num_categories

    def top_rank(window):
        ranks = np.concatenate([s.shard_batch(t, 0, 1)[0].sparse["item"] // C
                                for t in s.window_steps(window)])
        ranks = ranks[ranks < per_category(cfg)]
        return np.bincount(ranks).argmax()
    assert top_rank(0) == 0 and top_rank(1) == 5 % per_category(cfg)


def test_new_ids_keep_appearing_and_are_counted():
    s = _stream()
    cfg = s.cfg
    base = per_category(cfg) * cfg.synthetic.num_categories
    adm = FrequencyAdmission(rows=cfg.synthetic.vocab_item, min_count=2, buckets=4)
    new_per_window, seen = [], set()
    for w in range(4):
        ids = []
        for step in s.window_steps(w):
            b, _ = s.shard_batch(step, 0, 1)
            item = b.sparse["item"].astype(np.int64)
            ids.append(item)
            for name in ("clicks", "views"):
                seq = b.sequences[name]
                ids.append(seq.values["item"][:int(seq.offsets[-1])].astype(np.int64))
        ids = np.concatenate(ids)
        fresh_rank = ids[ids >= base] // cfg.synthetic.num_categories - per_category(cfg)
        # fresh ids come from the blocks opened so far, window w's the most common
        assert fresh_rank.max() < (w + 1) * new_block(cfg)
        blocks = np.bincount(fresh_rank // new_block(cfg), minlength=w + 1)
        assert blocks.argmax() == w and (w == 0 or blocks[:w].sum() > 0), blocks
        new_per_window.append(adm.observe(ids)["new_ids"])
        assert new_per_window[-1] == len(set(ids.tolist()) - seen)
        seen |= set(ids.tolist())
    assert all(n > 0 for n in new_per_window[1:]), new_per_window
    assert adm.totals["seen"] == len(seen)


class _Reference:
    """Admission one id at a time, in plain python."""

    def __init__(self, rows, k, buckets):
        self.rows, self.k, self.buckets = rows, k, buckets
        self.count, self.row, self.next, self.refused = {}, {}, buckets, set()

    def lookup(self, ids):
        return [self.row.get(i, (i * 2654435761 % 2**32) % self.buckets) for i in ids]

    def observe(self, ids):
        for i in ids:
            self.count[i] = self.count.get(i, 0) + 1
            if i not in self.row and i not in self.refused and self.count[i] >= self.k:
                if self.next < self.rows:
                    self.row[i] = self.next
                    self.next += 1
                else:
                    self.refused.add(i)


@pytest.mark.parametrize("rows,k,buckets", [(40, 3, 5), (12, 1, 1), (30, 2, 7)])
def test_admission_matches_python_reference(rows, k, buckets):
    rng = np.random.default_rng(rows)
    adm, ref = FrequencyAdmission(rows, k, buckets), _Reference(rows, k, buckets)
    hashed_total = 0
    for step in range(12):
        ids = rng.zipf(1.3, size=rng.integers(0, 40)) + step * 3
        rows_got, hashed = adm.lookup(ids)
        want = ref.lookup(ids.tolist())
        np.testing.assert_array_equal(rows_got, want)
        assert hashed == sum(i not in ref.row for i in ids.tolist())
        hashed_total += hashed
        adm.observe(ids)
        ref.observe(ids.tolist())
        assert adm.row_of == ref.row and adm.counts == ref.count
        assert adm.totals["refused"] == len(ref.refused)
        if step == 5:                                   # round trip through the JSON state
            import json
            adm = FrequencyAdmission.from_state(json.loads(json.dumps(adm.state())))
    assert adm.totals["hashed"] == hashed_total
    assert adm.totals["admitted"] == len(ref.row)
    assert set(adm.row_of.values()) == set(range(buckets, buckets + len(ref.row)))
    np.testing.assert_array_equal(bucket_of(np.array([0, 1, 12345]), 7),
                                  [(i * 2654435761 % 2**32) % 7 for i in (0, 1, 12345)])


def test_admission_bad_arguments():
    with pytest.raises(ValueError, match="buckets"):
        FrequencyAdmission(4, 1, 4)
    with pytest.raises(ValueError, match="min_count"):
        FrequencyAdmission(4, 0, 1)
    with pytest.raises(ValueError, match="raw ids"):
        FrequencyAdmission(4, 1, 1).lookup(np.array([-1]))
    with pytest.raises(ValueError, match="drift.every"):
        DriftingStream(get_config("tiny").data, 0)
    with pytest.raises(ValueError, match="drift.strength"):
        get_config("tiny", "data.drift_strength=1.5")
