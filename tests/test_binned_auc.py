"""The bounded-memory AUC (score histograms) against an exact Mann-Whitney AUC computed by
a plain numpy sort, and EvalAccumulator's switch to it past train.exact_auc_rows."""

import math

import numpy as np
import pytest

from gemjax.config import get_config
from gemjax.train import metrics

H = 2 * metrics.AUC_LOGIT_RANGE / metrics.AUC_BINS     # bin width in logits


def mann_whitney_auc(y, p):
    """Unweighted AUC = (rank sum of positives - n1 (n1 + 1) / 2) / (n1 n0), average
    ranks over tied scores (a sort, run boundaries, mean rank per run)."""
    y, p = np.asarray(y), np.asarray(p, np.float64)
    n1 = int(np.sum(y == 1))
    n0 = y.size - n1
    if n1 == 0 or n0 == 0:
        return math.nan
    order = np.argsort(p, kind="stable")
    s = p[order]
    starts = np.flatnonzero(np.r_[True, s[1:] != s[:-1]])
    ends = np.r_[starts[1:], s.size]                    # runs [start, end), 0-based
    mean_rank = (starts + ends + 1) / 2.0               # mean of 1-based ranks start+1..end
    ranks = np.empty(s.size)
    ranks[order] = np.repeat(mean_rank, ends - starts)
    return (ranks[y == 1].sum() - n1 * (n1 + 1) / 2.0) / (n1 * n0)


def hist(y, p, w=None):
    w = np.ones_like(p) if w is None else w
    b = metrics.score_bins(p)
    return (np.bincount(b, w * y, metrics.AUC_BINS), np.bincount(b, w * (1 - y), metrics.AUC_BINS))


def sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


def normal_logits(rng, n):
    """CTR-like: 5% positives, logits N(-3, 1) and N(-2, 1), float32 probabilities."""
    y = (rng.random(n) < 0.05).astype(np.float64)
    return y, sigmoid(rng.normal(-3 + y, 1.0)).astype(np.float32).astype(np.float64)


def uniform_probs(rng, n):
    """Calibrated: p ~ U(0, 1), y ~ Bernoulli(p)."""
    p = rng.random(n)
    return (rng.random(n) < p).astype(np.float64), p


# the largest density, per logit unit, of either class's logit (the bound f * h / 2)
CONTINUOUS = [(normal_logits, 1 / math.sqrt(2 * math.pi)), (uniform_probs, 2 * 0.25)]


@pytest.mark.parametrize("draw,density", CONTINUOUS)
def test_binned_auc_is_within_its_bound_on_continuous_scores(draw, density):
    rng = np.random.default_rng(3)
    y, p = draw(rng, 40_000)
    exact = mann_whitney_auc(y, p)
    got, bound = metrics.binned_auc(*hist(y, p))
    assert abs(got - exact) <= bound + 1e-12
    # the bound from the bin width: each bin holds at most density * H of a class
    assert bound <= 2 * density * H / 2          # x2: sampling noise of 40k draws
    assert abs(got - exact) <= density * H / 2
    assert metrics.auc(y, p) == pytest.approx(exact, abs=1e-12)   # the reference agrees


def test_binned_auc_is_exact_when_every_bin_pair_is_a_tie():
    # three decimals: distinct values lie >= 0.004 logits apart (> H), so a shared
    # bin means a tied score, which both AUCs count 1/2
    rng = np.random.default_rng(5)
    p = np.round(rng.random(20_000), 3)
    y = (rng.random(p.size) < p).astype(np.float64)
    w = rng.integers(1, 4, p.size).astype(np.float64)
    got, bound = metrics.binned_auc(*hist(y, p, w))
    assert bound > 0                                     # ties share bins
    assert got == pytest.approx(mann_whitney_auc(np.repeat(y, w.astype(int)),
                                                 np.repeat(p, w.astype(int))), abs=1e-12)


def test_binned_auc_edge_cases():
    one_class = metrics.binned_auc(*hist(np.ones(50), np.linspace(0.1, 0.9, 50)))
    assert all(math.isnan(x) for x in one_class)
    no_pos = metrics.binned_auc(*hist(np.zeros(50), np.linspace(0.1, 0.9, 50)))
    assert all(math.isnan(x) for x in no_pos)
    y = np.array([0, 1] * 25, np.float64)
    assert metrics.binned_auc(*hist(y, np.full(50, 0.3))) == (0.5, 0.5)   # one tie
    assert metrics.binned_auc(*hist(y, np.where(y > 0, 0.9, 0.1)))[0] == 1.0
    assert metrics.binned_auc(*hist(y, np.where(y > 0, 0.1, 0.9)))[0] == 0.0
    # beyond +-AUC_LOGIT_RANGE (0 and 1 included) scores share the end bins
    p = np.array([0.0, 1e-12, 1e-9, 1e-8, 1 - 1e-9, 1 - 1e-12, 1.0] * 4)
    y = np.array([1, 0, 1, 0, 1, 0, 1] * 4, np.float64)
    assert metrics.score_bins(p).tolist()[:7] == [0, 0, 0, 0, metrics.AUC_BINS - 1,
                                                  metrics.AUC_BINS - 1, metrics.AUC_BINS - 1]
    got, bound = metrics.binned_auc(*hist(y, p))
    assert abs(got - mann_whitney_auc(y, p)) <= bound + 1e-12
    assert np.all(np.diff(metrics.score_bins(np.linspace(0, 1, 10_001))) >= 0)   # monotone


def batches(seed, sizes, S=3, K=2, nan_at=None):
    rng = np.random.default_rng(seed)
    out = []
    for i, b in enumerate(sizes):
        y = (rng.random((b, K)) < 0.2).astype(np.float64)
        p = sigmoid(rng.normal(-1.5 + y, 1.0))
        if nan_at == i:
            p[0, 1] = np.nan
        mask = (rng.random((b, K)) < 0.9).astype(np.float64)
        out.append((p, y, mask, rng.integers(0, S, b), rng.integers(0, 3, b).astype(np.float64)))
    return out


def accumulate(chunks, **kw):
    acc = metrics.EvalAccumulator(3, 2, **kw)
    for c in chunks:
        acc.add(*c)
    return acc


def assert_close_to_exact(got, exact):
    groups = [(got["tasks"], exact["tasks"])] + list(zip(got["surface_tasks"], exact["surface_tasks"]))
    for row_got, row_exact in groups:
        for g, e in zip(row_got, row_exact):
            assert g["count"] == e["count"]
            for name in ("ne", "calibration", "log_loss", "positive_rate"):
                assert g[name] == pytest.approx(e[name], rel=1e-9, nan_ok=True), name
            if math.isnan(e["auc"]):
                assert math.isnan(g["auc"])
            else:
                assert abs(g["auc"] - e["auc"]) <= got["auc_bin_error"] + 1e-12
    assert got["nonfinite_preds"] == exact["nonfinite_preds"]


def test_the_accumulator_switches_past_exact_auc_rows():
    chunks = batches(11, [600, 400, 1, 700])
    exact = [accumulate(chunks[:n], exact_auc_rows=10**9).result() for n in (2, 4)]
    at = accumulate(chunks[:2], exact_auc_rows=1000)           # 1000 rows: still exact
    assert at.result() == exact[0] and at.result()["auc_binned"] is False
    at.add(*chunks[2])                                          # 1001 rows: binned
    at.add(*chunks[3])
    res = at.result()
    assert at.binned and res["auc_binned"] is True and 0 < res["auc_bin_error"] < 1e-3
    assert_close_to_exact(res, exact[1])
    assert metrics.flat(res)["auc_binned"] is True
    assert_close_to_exact(accumulate(chunks, exact_auc_rows=0).result(), exact[1])
    at.reset()
    assert not at.binned and at.result()["count"] == 0


def test_binned_accumulator_counts_nonfinite_preds_like_the_exact_one():
    chunks = batches(12, [300, 300], nan_at=1)
    got = accumulate(chunks, exact_auc_rows=0).result()
    exact = accumulate(chunks, exact_auc_rows=10**9).result()
    assert got["nonfinite_preds"] == 1 and math.isnan(got["tasks"][1]["auc"])
    assert_close_to_exact(got, exact)
    with pytest.raises(ValueError, match="preds"):
        accumulate([(np.full((2, 2), 1.5), np.zeros((2, 2)), np.ones((2, 2)), np.zeros(2, int),
                     np.ones(2))], exact_auc_rows=0)


def held_bytes(acc):
    """Bytes of every numpy array the accumulator holds."""
    total = 0
    for v in vars(acc).values():
        items = v.values() if isinstance(v, dict) else v if isinstance(v, list) else [v]
        for x in items:
            for a in (x if isinstance(x, tuple) else [x]):
                total += a.nbytes if isinstance(a, np.ndarray) else 0
    return total


def test_binned_accumulator_memory_does_not_grow_with_rows():
    acc = metrics.EvalAccumulator(3, 2, exact_auc_rows=500)
    chunks = batches(13, [250] * 12)
    for c in chunks[:2]:
        acc.add(*c)
    exact_held = held_bytes(acc)
    assert exact_held >= 500 * 2 * 8                   # the predictions themselves
    acc.add(*chunks[2])
    after_switch = held_bytes(acc)
    for c in chunks[3:]:
        acc.add(*c)
    assert held_bytes(acc) == after_switch == 2 * 2 * 3 * metrics.AUC_BINS * 8 + (2 + 4) * 2 * 3 * 8
    assert acc._chunks == []


def test_the_config_default_is_the_accumulators():
    assert get_config("tiny").train.exact_auc_rows == metrics.EXACT_AUC_ROWS == 2_000_000
    with pytest.raises(ValueError, match="exact_auc_rows"):
        metrics.EvalAccumulator(1, 1, exact_auc_rows=-1)
