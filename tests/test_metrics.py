"""Metrics against independent float64 references written a different way."""

import math

import numpy as np
import pytest

from gemjax.train import metrics


def ref_auc_pairwise(y, p, w):
    """O(n^2) definition: weighted share of (pos, neg) pairs ranked right, ties 1/2."""
    num = den = 0.0
    for i in range(len(y)):
        for j in range(len(y)):
            if y[i] == 1 and y[j] == 0:
                pair = w[i] * w[j]
                den += pair
                if p[i] > p[j]:
                    num += pair
                elif p[i] == p[j]:
                    num += 0.5 * pair
    return num / den if den > 0 else math.nan


def ref_auc_ranks(y, p):
    """Mann-Whitney U with average ranks (unweighted), ranks built by a python loop."""
    order = sorted(range(len(p)), key=lambda i: p[i])
    ranks = [0.0] * len(p)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and p[order[j + 1]] == p[order[i]]:
            j += 1
        for t in range(i, j + 1):
            ranks[order[t]] = (i + j) / 2.0 + 1.0
        i = j + 1
    n_pos = sum(1 for v in y if v == 1)
    n_neg = len(y) - n_pos
    r_pos = sum(r for r, v in zip(ranks, y) if v == 1)
    return (r_pos - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg)


def ref_ne(y, p, w):
    loss = tot = pos = 0.0
    for yi, pi, wi in zip(map(float, y), map(float, p), map(float, w)):
        pi = min(max(pi, metrics.EPS), 1 - metrics.EPS)
        loss -= wi * (yi * math.log(pi) + (1 - yi) * math.log(1 - pi))
        tot += wi
        pos += wi * yi
    r = pos / tot
    if r in (0.0, 1.0):
        return math.nan
    return (loss / tot) / -(r * math.log(r) + (1 - r) * math.log(1 - r))


def random_set(seed, n, tie_digits=1, pos_rate=0.3):
    rng = np.random.default_rng(seed)
    y = (rng.random(n) < pos_rate).astype(np.float64)
    p = np.round(np.clip(0.3 * y + 0.7 * rng.random(n), 0, 1), tie_digits)  # many ties
    w = rng.integers(1, 4, n).astype(np.float64)
    return y, p, w


@pytest.mark.parametrize("seed", range(6))
def test_auc_matches_pairwise_and_rank_definitions(seed):
    y, p, w = random_set(seed, 60 + seed)
    assert metrics.auc(y, p, w) == pytest.approx(ref_auc_pairwise(y, p, w), abs=1e-12)
    assert metrics.auc(y, p) == pytest.approx(ref_auc_ranks(list(y), list(p)), abs=1e-12)
    # integer weights mean repeated samples
    rep = w.astype(int)
    assert metrics.auc(y, p, w) == pytest.approx(metrics.auc(np.repeat(y, rep), np.repeat(p, rep)),
                                                 abs=1e-12)


def test_auc_extremes_and_all_ties():
    y = np.array([0, 0, 1, 1.0])
    assert metrics.auc(y, [0.1, 0.2, 0.3, 0.4]) == 1.0
    assert metrics.auc(y, [0.4, 0.3, 0.2, 0.1]) == 0.0
    assert metrics.auc(y, [0.5, 0.5, 0.5, 0.5]) == 0.5
    assert metrics.auc(y, [0.1, 0.3, 0.3, 0.4]) == pytest.approx(0.875)
    assert math.isnan(metrics.auc([1, 1, 1.0], [0.1, 0.2, 0.3]))
    assert math.isnan(metrics.auc([0, 0.0], [0.1, 0.2]))
    # zero weight removes a sample
    assert metrics.auc([0, 1, 0.0], [0.1, 0.5, 0.9], [1, 1, 0]) == 1.0


@pytest.mark.parametrize("seed", range(4))
def test_ne_and_log_loss_match_direct_formula(seed):
    y, p, w = random_set(100 + seed, 200, tie_digits=3)
    p[:3] = [0.0, 1.0, 1e-12]  # exercises clipping
    assert metrics.ne(y, p, w) == pytest.approx(ref_ne(y, p, w), rel=1e-12)
    ll = sum(-wi * (yi * math.log(min(max(pi, 1e-7), 1 - 1e-7))
                    + (1 - yi) * math.log(1 - min(max(pi, 1e-7), 1 - 1e-7)))
             for yi, pi, wi in zip(y, p, w)) / w.sum()
    assert metrics.log_loss(y, p, w) == pytest.approx(ll, rel=1e-12)


def test_ne_of_base_rate_predictor_is_one_and_single_class_is_nan():
    y = np.array([1, 0, 0, 0, 1, 0, 0, 0.0])
    assert metrics.ne(y, np.full(8, 0.25)) == pytest.approx(1.0, rel=1e-12)
    assert metrics.ne(y, np.where(y > 0, 0.9, 0.1)) < 1.0
    assert math.isnan(metrics.ne(np.ones(5), np.full(5, 0.7)))
    assert math.isnan(metrics.ne(np.zeros(5), np.full(5, 0.1)))
    assert math.isnan(metrics.ne([], []))


def test_calibration():
    y = np.array([1, 0, 0, 1.0])
    p = np.array([0.6, 0.2, 0.2, 0.6])
    w = np.array([1, 2, 1, 3.0])
    assert metrics.calibration(y, p, w) == pytest.approx((0.6 + 0.4 + 0.2 + 1.8) / 4.0)
    assert metrics.calibration(y, p) == pytest.approx(1.6 / 2.0)
    assert math.isnan(metrics.calibration(np.zeros(3), [0.1, 0.2, 0.3]))


@pytest.mark.parametrize("bad, match", [
    (dict(preds=[0.5, np.nan]), "preds"),
    (dict(preds=[0.5, 1.5]), "preds"),
    (dict(labels=[0, 2]), "labels"),
    (dict(weights=[1, -1]), "weights"),
    (dict(preds=[0.5]), "preds"),
])
def test_bad_input_names_the_input(bad, match):
    args = dict(labels=[0, 1], preds=[0.2, 0.7], weights=[1, 1]) | bad
    with pytest.raises(ValueError, match=match):
        metrics.ne(**args)


def test_accumulator_per_surface_task_matches_reference():
    rng = np.random.default_rng(7)
    S, K = 3, 2
    acc = metrics.EvalAccumulator(S, K)
    chunks = []
    for b in (17, 1, 30, 0, 22):
        preds = np.round(rng.random((b, K)), 1)
        labels = (rng.random((b, K)) < 0.4).astype(np.float32)
        mask = (rng.random((b, K)) < 0.8).astype(np.float32)
        labels[mask == 0] = 7.0  # unobserved labels are garbage and must be ignored
        surface = rng.integers(0, S, b).astype(np.int32)
        weights = rng.integers(0, 3, b).astype(np.float32)
        acc.add(preds, labels, mask, surface, weights)
        chunks.append((preds, labels, mask, surface, weights))
    P, Y, M, SF, W = (np.concatenate(c) for c in zip(*chunks))
    res = acc.result()
    counts = []
    for t in range(K):
        sel = [i for i in range(len(W)) if M[i, t] > 0 and W[i] > 0]
        y, p, w = Y[sel, t], P[sel, t], W[sel]
        got = res["tasks"][t]
        assert got["count"] == len(sel)
        assert got["ne"] == pytest.approx(ref_ne(y, p, w), rel=1e-10)
        assert got["auc"] == pytest.approx(ref_auc_pairwise(y, p, w), abs=1e-12)
        assert got["positive_rate"] == pytest.approx(np.dot(w, y) / w.sum())
        counts.append(len(sel))
        for s in range(S):
            sel_s = [i for i in sel if SF[i] == s]
            y, p, w = Y[sel_s, t], P[sel_s, t], W[sel_s]
            got = res["surface_tasks"][s][t]
            assert got["count"] == len(sel_s)
            assert got["auc"] == pytest.approx(ref_auc_pairwise(y, p, w), abs=1e-12)
            assert got["calibration"] == pytest.approx(np.dot(w, p) / np.dot(w, y), rel=1e-12)
    expect_ne = sum(c * res["tasks"][t]["ne"] for t, c in enumerate(counts)) / sum(counts)
    assert res["ne"] == pytest.approx(expect_ne, rel=1e-12)
    assert res["count"] == sum(counts)
    flat = metrics.flat(res)
    assert flat["surface2/task1/auc"] == res["surface_tasks"][2][1]["auc"]
    assert flat["task0/ne"] == res["tasks"][0]["ne"]


def test_accumulator_single_class_task_and_nonfinite_preds():
    acc = metrics.EvalAccumulator(1, 2)
    labels = np.array([[1, 0], [1, 1], [1, 0], [1, 1.0]])  # task 0 has one class only
    preds = np.array([[0.9, 0.2], [0.8, 0.7], [0.7, 0.4], [0.6, 0.6]])
    acc.add(preds, labels, np.ones((4, 2)), np.zeros(4, np.int32), np.ones(4))
    res = acc.result()
    assert math.isnan(res["tasks"][0]["ne"]) and math.isnan(res["tasks"][0]["auc"])
    # the summary skips the nan task instead of becoming nan
    assert res["ne"] == pytest.approx(res["tasks"][1]["ne"])
    assert res["auc"] == 1.0
    preds[0, 1] = np.nan
    acc.add(preds, labels, np.ones((4, 2)), np.zeros(4, np.int32), np.ones(4))
    res = acc.result()
    assert res["nonfinite_preds"] == 1
    assert math.isnan(res["tasks"][1]["ne"]) and math.isnan(res["ne"])


def test_accumulator_empty_and_bad_input():
    res = metrics.EvalAccumulator(2, 1).result()
    assert res["count"] == 0 and math.isnan(res["ne"])
    acc = metrics.EvalAccumulator(2, 2)
    ok = dict(preds=np.full((3, 2), 0.5), labels=np.zeros((3, 2)), label_mask=np.ones((3, 2)),
              surface=np.zeros(3, np.int32), weights=np.ones(3))
    for bad, match in [(dict(surface=np.array([0, 1, 2])), "surface"),
                       (dict(surface=np.zeros(3)), "surface"),
                       (dict(preds=np.full((3, 3), 0.5)), "preds"),
                       (dict(label_mask=np.ones((2, 2))), "label_mask"),
                       (dict(labels=np.full((3, 2), 2.0)), "labels")]:
        with pytest.raises(ValueError, match=match):
            acc.add(**(ok | bad))
