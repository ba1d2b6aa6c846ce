"""Full-ranking metrics of next-item retrieval: ranks, HR@k, NDCG@k, MRR.

A row's rank is the number of items scoring strictly higher than its target (ties in
the target's favour; rank 0: the target scored highest), over the items the row ranks:

    ranks = target_ranks(scores, targets, exclude)   # scores [N, V] -> [N] int32 (jnp, on device)
    ranking_summary(ranks, ks)                      # {"hr@k", "ndcg@k" for k in ks, "mrr"}
    ranking_metrics(scores, targets, ks)            # both, from host scores [N, V]

    HR@k   = mean(rank < k)
    NDCG@k = mean(1 / log2(rank + 2) if rank < k else 0)   (one relevant item per row)
    MRR    = mean(1 / (rank + 1))

Every figure is NaN over zero rows. gemjax.train.retrieval's evaluator (ranks on device,
summary on the host) and offline scorers of [N, V] score matrices (ranking_metrics) share
these definitions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def target_ranks(scores: jax.Array, targets: jax.Array, exclude: jax.Array | None = None):
    """Items scoring strictly higher than the target (ties in the target's favour) [N] int32.

    scores [N, V]; targets [N] int in [0, V); exclude [N, V] bool (True: the item is
    out of that row's ranking; the target itself is never excluded). Works on jax or
    numpy arrays (jnp ops)."""
    t = jnp.take_along_axis(scores, targets[:, None], axis=1)
    above = scores > t
    if exclude is not None:
        above = above & ~exclude
    return jnp.sum(above, axis=1).astype(jnp.int32)


def ranking_summary(ranks: np.ndarray, ks=(10, 50)) -> dict[str, float]:
    """{"hr@k", "ndcg@k" for each k in ks, "mrr"} (module docstring) over ranks [N], in float64."""
    r = np.asarray(ranks, np.float64)
    if not r.size:
        return {**{f"{m}@{k}": float("nan") for k in ks for m in ("hr", "ndcg")}, "mrr": float("nan")}
    out = {}
    for k in ks:
        hit = r < k
        out[f"hr@{k}"] = float(hit.mean())
        out[f"ndcg@{k}"] = float(np.where(hit, 1.0 / np.log2(r + 2), 0.0).mean())
    out["mrr"] = float(np.mean(1.0 / (r + 1.0)))
    return out


def ranking_metrics(scores: np.ndarray, targets: np.ndarray, ks=(10, 50)) -> dict[str, float]:
    """`ranking_summary` of host scores [N, V] (column j = item j; columns a row does not
    rank, such as the padding item 0 or its history, set to -inf by the caller) and
    targets [N] int item ids. ValueError naming the shapes, or a target outside the
    columns."""
    scores = np.asarray(scores, np.float64)
    targets = np.asarray(targets, np.int64)
    if scores.ndim != 2 or targets.shape != (scores.shape[0],):
        raise ValueError(f"ranking_metrics: scores [N, V] and targets [N] expected, got "
                         f"{scores.shape} and {targets.shape}")
    if targets.size and (targets.min() < 0 or targets.max() >= scores.shape[1]):
        raise ValueError("ranking_metrics: a target is outside the score columns")
    t = scores[np.arange(len(targets)), targets]
    return ranking_summary(np.sum(scores > t[:, None], axis=1), ks)
