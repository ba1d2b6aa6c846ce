"""Evaluation metrics for binary tasks: log loss, NE, AUC, calibration.

All functions run on the host in float64 numpy. Inputs:

    labels  [N] float   0/1 labels (soft labels in [0, 1] are accepted: a sample
                        counts as `label` positive and `1 - label` negative)
    preds   [N] float   predicted probabilities in [0, 1] (not logits)
    weights [N] float   optional non-negative sample weights (default all 1)

Conventions (one place, so every number a user sees means the same thing):

- `log_loss` clips preds to [EPS, 1 - EPS] before taking logs.
- `ne` = weighted mean log loss / entropy of the weighted base positive rate
  p = sum(w * y) / sum(w). NE is undefined when p is 0 or 1 (a single-class
  set has zero entropy): `ne` then returns nan and the caller shows it.
- `auc` is the weighted ROC AUC, tie-aware: a (positive, negative) pair with
  equal scores counts 1/2. It equals the Mann-Whitney statistic with average
  ranks. nan when there is no positive or no negative weight.
- `calibration` = sum(w * pred) / sum(w * y) (mean prediction over observed
  rate); nan when there is no positive weight.
- Every metric of an empty set (or zero total weight) is nan.

Non-finite preds, labels outside [0, 1] and negative or non-finite weights
raise ValueError naming the input. `EvalAccumulator` streams eval batches and
reports everything per task and per (surface, task).

Bounded-memory AUC (`score_bins`, `binned_auc`): scores go to AUC_BINS = 2^16
equal bins of the logit log(p / (1 - p)) over [-AUC_LOGIT_RANGE, AUC_LOGIT_RANGE]
= [-16, 16] (bin width h = 32 / 2^16 ~ 4.9e-4 logits; preds beyond the range,
0 and 1 included, fall into the end bins, where `log_loss`'s EPS clip already
treats them alike). A (positive, negative) pair in different bins counts as the
exact AUC counts it; a pair sharing a bin counts 1/2, which is exact for tied
scores. So |binned - exact| <= 1/2 * sum_b pos_b * neg_b / (P * N) (P, N: the
positive and negative weight; pos_b, neg_b: theirs in bin b), the bound
`binned_auc` returns; with the negatives' logit density at most f per logit unit
(scores within the range) this is <= f * h / 2 (2.5e-4 for f = 1, a spread no
tighter than one logit).
"""

from __future__ import annotations

import math

import numpy as np

EPS = 1e-7
METRIC_NAMES = ("ne", "auc", "calibration", "log_loss", "count", "positive_rate")
AUC_BINS = 2 ** 16
AUC_LOGIT_RANGE = 16.0
EXACT_AUC_ROWS = 2_000_000   # EvalAccumulator's default (config train.exact_auc_rows)


def _check(labels, preds, weights):
    """Validate and convert to float64 1-D arrays; returns (labels, preds, weights)."""
    y = np.asarray(labels, dtype=np.float64).reshape(-1)
    p = np.asarray(preds, dtype=np.float64).reshape(-1)
    if y.shape != p.shape:
        raise ValueError(f"labels has {y.size} elements but preds has {p.size}")
    w = np.ones_like(y) if weights is None else np.asarray(weights, np.float64).reshape(-1)
    if w.shape != y.shape:
        raise ValueError(f"weights has {w.size} elements but labels has {y.size}")
    if not np.all(np.isfinite(p)):
        raise ValueError(f"preds has {int(np.sum(~np.isfinite(p)))} non-finite values")
    if np.any((p < 0) | (p > 1)):
        raise ValueError("preds must be probabilities in [0, 1] (got values outside; logits?)")
    if not np.all(np.isfinite(y)) or np.any((y < 0) | (y > 1)):
        raise ValueError("labels must be finite and in [0, 1]")
    if not np.all(np.isfinite(w)) or np.any(w < 0):
        raise ValueError("weights must be finite and non-negative")
    return y, p, w


def _log_loss(y, p, w) -> float:
    total = w.sum()
    if total <= 0:
        return math.nan
    p = np.clip(p, EPS, 1.0 - EPS)
    losses = -(y * np.log(p) + (1.0 - y) * np.log1p(-p))
    return float(np.sum(w * losses) / total)


def _base_entropy(y, w) -> float:
    total = w.sum()
    if total <= 0:
        return math.nan
    return _entropy(float(np.sum(w * y) / total))


def _entropy(rate: float) -> float:
    if not 0.0 < rate < 1.0:
        return math.nan
    return -(rate * math.log(rate) + (1.0 - rate) * math.log1p(-rate))


def _auc(y, p, w) -> float:
    pos_w, neg_w = w * y, w * (1.0 - y)
    total_pos, total_neg = pos_w.sum(), neg_w.sum()
    if total_pos <= 0 or total_neg <= 0:
        return math.nan
    # Group equal scores; a positive beats every negative with a lower score
    # and half of the negatives with the same score.
    scores, group = np.unique(p, return_inverse=True)
    pos_g = np.bincount(group, weights=pos_w, minlength=scores.size)
    neg_g = np.bincount(group, weights=neg_w, minlength=scores.size)
    neg_below = np.cumsum(neg_g) - neg_g
    wins = np.sum(pos_g * (neg_below + 0.5 * neg_g))
    return float(wins / (total_pos * total_neg))


def _calibration(y, p, w) -> float:
    observed = np.sum(w * y)
    if observed <= 0:
        return math.nan
    return float(np.sum(w * p) / observed)


def log_loss(labels, preds, weights=None) -> float:
    """Weighted mean binary cross-entropy (natural log), preds clipped to [EPS, 1-EPS]."""
    return _log_loss(*_check(labels, preds, weights))


def ne(labels, preds, weights=None) -> float:
    """Normalized entropy: log_loss / entropy(base rate); nan if the base rate is 0 or 1."""
    y, p, w = _check(labels, preds, weights)
    return _log_loss(y, p, w) / _base_entropy(y, w)


def auc(labels, preds, weights=None) -> float:
    """Weighted tie-aware ROC AUC (ties count 1/2); nan without both classes."""
    return _auc(*_check(labels, preds, weights))


def calibration(labels, preds, weights=None) -> float:
    """sum(w * preds) / sum(w * labels); 1.0 is calibrated, nan without positives."""
    return _calibration(*_check(labels, preds, weights))


def binary_metrics(labels, preds, weights=None) -> dict[str, float]:
    """All of METRIC_NAMES for one set. count = samples with weight > 0 (an int)."""
    y, p, w = _check(labels, preds, weights)
    total = w.sum()
    return {
        "ne": _log_loss(y, p, w) / _base_entropy(y, w),
        "auc": _auc(y, p, w),
        "calibration": _calibration(y, p, w),
        "log_loss": _log_loss(y, p, w),
        "count": int(np.count_nonzero(w > 0)),
        "positive_rate": float(np.sum(w * y) / total) if total > 0 else math.nan,
    }


def score_bins(preds, bins: int = AUC_BINS) -> np.ndarray:
    """Bin index [N] int64 in [0, bins) of each prediction [N] in [0, 1]: equal bins of
    the logit over [-AUC_LOGIT_RANGE, AUC_LOGIT_RANGE], monotone in the prediction
    (the module doc)."""
    p = np.asarray(preds, np.float64)
    with np.errstate(divide="ignore"):
        z = np.log(p) - np.log1p(-p)
    u = (np.clip(z, -AUC_LOGIT_RANGE, AUC_LOGIT_RANGE) + AUC_LOGIT_RANGE) / (2 * AUC_LOGIT_RANGE)
    return np.minimum((u * bins).astype(np.int64), bins - 1)


def binned_auc(pos, neg) -> tuple[float, float]:
    """(auc, bound) from per-bin positive and negative weight [..., B] (bins in score
    order; leading axes summed): the tie-aware AUC of the bins (a pair sharing a bin
    counts 1/2) and 1/2 * sum_b pos_b * neg_b / (P * N), the most it can differ from
    the exact AUC of the binned scores. (nan, nan) without both classes."""
    pos = np.asarray(pos, np.float64).reshape(-1, np.shape(pos)[-1]).sum(0)
    neg = np.asarray(neg, np.float64).reshape(-1, np.shape(neg)[-1]).sum(0)
    total_pos, total_neg = pos.sum(), neg.sum()
    if total_pos <= 0 or total_neg <= 0:
        return math.nan, math.nan
    neg_below = np.cumsum(neg) - neg
    pairs = total_pos * total_neg
    return (float(np.sum(pos * (neg_below + 0.5 * neg)) / pairs),
            float(0.5 * np.sum(pos * neg) / pairs))


def _count_weighted_mean(values: list[float], counts: list[int]) -> float:
    pairs = [(v, c) for v, c in zip(values, counts) if c > 0 and math.isfinite(v)]
    if not pairs:
        return math.nan
    return float(sum(v * c for v, c in pairs) / sum(c for _, c in pairs))


class EvalAccumulator:
    """Streams eval batches and computes metrics per task and per (surface, task).

    add(preds [B, K], labels [B, K], label_mask [B, K], surface [B] int, weights [B])
    with K = num_tasks and surface ids in [0, num_surfaces). A (sample, task) pair
    takes part when label_mask > 0 and weight > 0 (padding samples carry weight 0).

    Up to `exact_auc_rows` rows (the B rows of every add() together) the kept values
    stay in host memory and every metric is exact. Once an add() takes the total
    past it, they are folded into fixed-size state and dropped, and so is every
    later batch: per (task, surface) the kept pairs' count, non-finite count and
    weighted sums (w, w * y, w * p, w * log loss), and per class a histogram of
    `auc_bins` score bins (`score_bins`), 2 * K * S * auc_bins float64 in all
    (K * S MiB at 2^16 bins) however many rows follow. NE, log loss, calibration,
    count and positive rate stay exact (up to float64 summation order); AUC becomes
    `binned_auc`'s, within the bound the module doc derives. exact_auc_rows=0 bins
    from the first row.

    result() returns
        {"ne", "auc", "calibration", "log_loss": summary over tasks,
         "count": labelled pairs over all tasks,
         "nonfinite_preds": count of non-finite preds among the kept pairs,
         "auc_binned": False for exact AUCs, True for binned ones,
         "auc_bin_error": (binned only) the largest of the groups' bounds on
           |binned - exact| AUC (nan when no group has both classes),
         "tasks": [K dicts of METRIC_NAMES],
         "surface_tasks": [S lists of K dicts of METRIC_NAMES]}
    The summary metrics are the count-weighted mean of the per-task values,
    skipping tasks whose value is nan (e.g. a task with one class only); nan if
    every task is skipped. Non-finite preds (a diverged model) are not an
    error here: they are counted, and every metric of an affected task or
    (surface, task) group becomes nan instead of silently dropping them.
    `flat(result)` turns the nested dict into "task0/ne"-style keys for logs.
    """

    def __init__(self, num_surfaces: int, num_tasks: int, *,
                 exact_auc_rows: int = EXACT_AUC_ROWS, auc_bins: int = AUC_BINS):
        if num_surfaces < 1 or num_tasks < 1:
            raise ValueError(f"num_surfaces={num_surfaces} and num_tasks={num_tasks} must be >= 1")
        if exact_auc_rows < 0 or auc_bins < 1:
            raise ValueError(f"exact_auc_rows={exact_auc_rows} must be >= 0 and "
                             f"auc_bins={auc_bins} >= 1")
        self.num_surfaces = num_surfaces
        self.num_tasks = num_tasks
        self.exact_auc_rows = exact_auc_rows
        self.auc_bins = auc_bins
        self.reset()

    def reset(self) -> None:
        self._chunks: list[tuple[np.ndarray, ...]] = []
        self.rows = 0
        self._binned: dict[str, np.ndarray] | None = None

    @property
    def binned(self) -> bool:
        """True once the rows went past exact_auc_rows (AUC from histograms)."""
        return self._binned is not None

    def add(self, preds, labels, label_mask, surface, weights) -> None:
        preds = np.asarray(preds, np.float64)
        labels = np.asarray(labels, np.float64)
        label_mask = np.asarray(label_mask)
        surface = np.asarray(surface)
        weights = np.asarray(weights, np.float64)
        k = self.num_tasks
        if preds.ndim != 2 or preds.shape[1] != k:
            raise ValueError(f"preds must be [B, {k}], got shape {preds.shape}")
        b = preds.shape[0]
        for name, arr, shape in (("labels", labels, (b, k)), ("label_mask", label_mask, (b, k)),
                                 ("surface", surface, (b,)), ("weights", weights, (b,))):
            if arr.shape != shape:
                raise ValueError(f"{name} must have shape {shape}, got {arr.shape}")
        if not np.issubdtype(surface.dtype, np.integer):
            raise ValueError(f"surface must be integer, got {surface.dtype}")
        if b and (surface.min() < 0 or surface.max() >= self.num_surfaces):
            raise ValueError(f"surface ids must be in [0, {self.num_surfaces}), "
                             f"got range [{surface.min()}, {surface.max()}]")
        if not np.all(np.isfinite(weights)) or np.any(weights < 0):
            raise ValueError("weights must be finite and non-negative")
        keep = (label_mask > 0) & (weights > 0)[:, None]
        observed = labels[keep]
        if not np.all(np.isfinite(observed)) or np.any((observed < 0) | (observed > 1)):
            raise ValueError("labels must be finite and in [0, 1] where label_mask > 0")
        self.rows += b
        if self._binned is None and self.rows <= self.exact_auc_rows:
            # copies: callers may reuse their buffers after add() returns
            self._chunks.append((preds.copy(), labels.copy(), keep, surface.astype(np.int64),
                                 weights.copy()))
            return
        if self._binned is None:
            k, s, nb = self.num_tasks, self.num_surfaces, self.auc_bins
            self._binned = {"n": np.zeros((k, s), np.int64), "bad": np.zeros((k, s), np.int64),
                            "sums": np.zeros((4, k, s)), "pos": np.zeros((k, s, nb)),
                            "neg": np.zeros((k, s, nb))}
            for chunk in self._chunks:
                self._fold(*chunk)
            self._chunks = []
        self._fold(preds, labels, keep, surface.astype(np.int64), weights)

    def _fold(self, preds, labels, keep, surface, weights) -> None:
        """Add one batch's kept pairs to the binned state."""
        st, s, nb = self._binned, self.num_surfaces, self.auc_bins
        kept = preds[keep]
        if np.any((kept < 0) | (kept > 1)):     # nan compares False: counted below
            raise ValueError("preds must be probabilities in [0, 1] (got values outside; logits?)")
        for t in range(self.num_tasks):
            m = keep[:, t]
            p, y, w, srf = preds[m, t], labels[m, t], weights[m], surface[m]
            ok = np.isfinite(p)
            st["n"][t] += np.bincount(srf, minlength=s)
            st["bad"][t] += np.bincount(srf[~ok], minlength=s)
            p, y, w, srf = p[ok], y[ok], w[ok], srf[ok]
            c = np.clip(p, EPS, 1.0 - EPS)
            loss = -(y * np.log(c) + (1.0 - y) * np.log1p(-c))
            for i, v in enumerate((w, w * y, w * p, w * loss)):
                st["sums"][i, t] += np.bincount(srf, weights=v, minlength=s)
            idx = srf * nb + score_bins(p, nb)
            st["pos"][t] += np.bincount(idx, weights=w * y, minlength=s * nb).reshape(s, nb)
            st["neg"][t] += np.bincount(idx, weights=w * (1.0 - y), minlength=s * nb).reshape(s, nb)

    def _group(self, p, y, w) -> tuple[dict[str, float], int]:
        bad = ~np.isfinite(p)
        if bad.any():
            out = {name: math.nan for name in METRIC_NAMES}
            out["count"] = int(p.size)
            return out, int(bad.sum())
        return binary_metrics(y, p, w), 0

    def _binned_group(self, t, srf) -> tuple[dict[str, float], float]:
        """(metrics, AUC bound) of task t over surfaces `srf` (an index or a slice)."""
        st = self._binned
        n, bad = int(np.sum(st["n"][t, srf])), int(np.sum(st["bad"][t, srf]))
        if bad:
            return {name: math.nan for name in METRIC_NAMES} | {"count": n}, math.nan
        sw, swy, swp, swl = (float(np.sum(st["sums"][i, t, srf])) for i in range(4))
        log_loss_ = swl / sw if sw > 0 else math.nan
        auc_, bound = binned_auc(st["pos"][t, srf], st["neg"][t, srf])
        return {"ne": log_loss_ / _entropy(swy / sw) if sw > 0 else math.nan,
                "auc": auc_,
                "calibration": swp / swy if swy > 0 else math.nan,
                "log_loss": log_loss_,
                "count": n,
                "positive_rate": swy / sw if sw > 0 else math.nan}, bound

    def _binned_result(self) -> tuple[list, list, int, float]:
        k, s = self.num_tasks, self.num_surfaces
        tasks, surface_tasks, bounds = [], [[None] * k for _ in range(s)], []
        for t in range(k):
            out, bound = self._binned_group(t, slice(None))
            tasks.append(out)
            bounds.append(bound)
            for srf in range(s):
                surface_tasks[srf][t], bound = self._binned_group(t, srf)
                bounds.append(bound)
        finite = [x for x in bounds if math.isfinite(x)]
        return (tasks, surface_tasks, int(self._binned["bad"].sum()),
                max(finite) if finite else math.nan)

    def _exact_result(self) -> tuple[list, list, int]:
        k, s = self.num_tasks, self.num_surfaces
        if self._chunks:
            preds, labels, keep, surface, weights = (np.concatenate(c) for c in zip(*self._chunks))
        else:
            preds = labels = np.zeros((0, k))
            keep = np.zeros((0, k), bool)
            surface, weights = np.zeros((0,), np.int64), np.zeros((0,))
        tasks, surface_tasks = [], [[None] * k for _ in range(s)]
        nonfinite = 0
        for t in range(k):
            m = keep[:, t]
            out, bad = self._group(preds[m, t], labels[m, t], weights[m])
            tasks.append(out)
            nonfinite += bad
            for srf in range(s):
                ms = m & (surface == srf)
                surface_tasks[srf][t] = self._group(preds[ms, t], labels[ms, t], weights[ms])[0]
        return tasks, surface_tasks, nonfinite

    def result(self) -> dict:
        if self._binned is not None:
            tasks, surface_tasks, nonfinite, bin_error = self._binned_result()
            auc_keys = {"auc_binned": True, "auc_bin_error": bin_error}
        else:
            tasks, surface_tasks, nonfinite = self._exact_result()
            auc_keys = {"auc_binned": False}
        counts = [d["count"] for d in tasks]
        summary = {name: _count_weighted_mean([d[name] for d in tasks], counts)
                   for name in ("ne", "auc", "calibration", "log_loss")}
        summary.update(count=int(sum(counts)), nonfinite_preds=nonfinite, **auc_keys,
                       tasks=tasks, surface_tasks=surface_tasks)
        return summary


def flat(result: dict, prefix: str = "") -> dict[str, float]:
    """EvalAccumulator.result() as flat JSON-ready keys: "ne", "task1/auc", "surface0/task1/ne"."""
    out = {f"{prefix}{key}": value for key, value in result.items()
           if key not in ("tasks", "surface_tasks")}
    for t, metrics in enumerate(result["tasks"]):
        out.update({f"{prefix}task{t}/{name}": v for name, v in metrics.items()})
    for srf, row in enumerate(result["surface_tasks"]):
        for t, metrics in enumerate(row):
            out.update({f"{prefix}surface{srf}/task{t}/{name}": v for name, v in metrics.items()})
    return out
