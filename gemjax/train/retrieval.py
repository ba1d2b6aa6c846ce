"""Next-item retrieval through the trainer: its objective (NextItemSoftmax, run by the one
train / eval step of gemjax.train.step) and the evaluator.

model.kind="retrieval" (gemjax.models.retrieval.RetrievalTower) trains on rows of
(history, next item): every history token predicts the item after it (the last token
the row's candidate item), with a softmax over the rows of the SHARED item table, the
one the history tokens read (gemjax.train.retrieval_loss). The scored rows are looked
up through the EmbeddingCollection as one more feature of the item table
(CANDIDATES), so its row-wise optimizer updates the rows they touch:

  model.retrieval.negatives = 0   every item row is scored by every token: the full
                                  softmax over the catalogue
  model.retrieval.negatives = N   N rows drawn uniformly from [1, V) per device per
                                  step, shared by that device's tokens (sampled
                                  softmax; a negative equal to the target is dropped)

Negatives are shared per device (one [T, N] product instead of gathering [T, N, d]
rows per token), so N can be large; for a catalogue of a few thousand rows (ML-1M:
3,953) the full softmax costs one [T, V] product and is the default. The draw and the
input dropout take their keys from (train.seed, state["step"]) (and
the device's batch shard), so a resumed run draws what the uninterrupted one drew.

Eval (RetrievalEvaluator, every row of the eval stream once): the user vector at the
last history token of each row scored against every item row; rank = items scoring
strictly higher than the row's candidate (ties in its favour), among the catalogue
(rows >= 1 that occur in the train or eval data: a row's item or history), with the
row's history items excluded ("hr@10", "ndcg@10", "hr@50", "ndcg@50", "hr@200",
"ndcg@200", "mrr" = mean 1 / (rank + 1); the published protocol) and kept
("..._unmasked"). Scores and ranks are computed on device (NextItemSoftmax.predict); the
host receives [B, 2] ranks per batch and summarises them (gemjax.train.ranking).

Train metrics: "loss" (mean per-token cross-entropy), "loss_sum" / "weight_sum" [1]
(sums over the tokens, weighted by the row weights), "grad_norm", the collection's
stats. There is no NE for a softmax over items: metrics.jsonl carries ne null.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from gemjax.config import Config, schema_of
from gemjax.data.batch import Batch
from gemjax.data.feeding import Feeder
from gemjax.data.source import eval_steps, make_source, valid_files
from gemjax.models.retrieval import (CANDIDATES, ITEM_FIELD, item_table, l2_normalize,
                                     retrieval_sequence, target_feature)
from gemjax.train.ranking import ranking_summary, target_ranks
from gemjax.train.retrieval_loss import history_mask, next_item_targets, sampled_softmax
from gemjax.train.step import Shard, StepContext, Trainer, eval_step, process_rows

KS = (10, 50, 200)
METRICS = tuple(name for s in ("", "_unmasked")
                for name in [f"{m}@{k}{s}" for k in KS for m in ("hr", "ndcg")] + [f"mrr{s}"])
_NEGATIVES, _DROPOUT = 1, 2             # fold_in tags of the per-step keys


def is_retrieval(cfg: Config) -> bool:
    return cfg.model.kind == "retrieval"


@dataclasses.dataclass(frozen=True, eq=False)
class NextItemSoftmax:
    """The retrieval objective (module docstring), an `Objective` of gemjax.train.step.

    lookup_ids: {CANDIDATES: the scored item rows} (`candidate_ids`); loss_sums:
    {"loss_sum" [1], "weight_sum" [1]}, the softmax cross-entropy of every history token
    against its next item, weighted by the row weights; predict: ranks [B_local, 2] int32
    of each row's candidate among the catalog rows, its history excluded and kept.
    vocab: rows of the item table; catalog [V] bool: the rows an eval ranks (None: every
    row >= 1).
    """

    cfg: Config
    vocab: int
    catalog: np.ndarray | None = None
    metrics: tuple[str, ...] = METRICS

    def candidate_ids(self, ctx: StepContext, step: jax.Array, train: bool) -> jax.Array:
        """[num_shards * N] int32 ids, shard i's N rows on device i (P(batch axes)): every
        item row (eval, or retrieval_negatives 0), else N uniform rows in [1, V) drawn
        from (train.seed, step)."""
        s, n = ctx.mesh.size, self.cfg.model.retrieval.negatives
        if not train or n == 0:
            ids = jnp.tile(jnp.arange(self.vocab, dtype=jnp.int32), s)
        else:
            key = jax.random.fold_in(jax.random.fold_in(jax.random.key(self.cfg.train.seed),
                                                        _NEGATIVES), step)
            ids = jax.random.randint(key, (s * n,), 1, self.vocab, dtype=jnp.int32)
        return jax.lax.with_sharding_constraint(ids, NamedSharding(ctx.mesh, P(ctx.batch_axes)))

    def lookup_ids(self, ctx: StepContext, step: jax.Array, train: bool) -> dict[str, jax.Array]:
        return {CANDIDATES: self.candidate_ids(ctx, step, train)}

    def _items(self, e: jax.Array) -> jax.Array:
        return l2_normalize(e) if self.cfg.model.retrieval.l2norm else e.astype(jnp.float32)

    def loss_sums(self, model, acts: dict, batch: Batch, shard: Shard) -> dict[str, jax.Array]:
        cfg, seq, tgt_feat = self.cfg, retrieval_sequence(self.cfg), target_feature(self.cfg)
        key = jax.random.fold_in(jax.random.key(cfg.train.seed), _DROPOUT)
        key = jax.random.fold_in(jax.random.fold_in(key, shard.step), jax.lax.axis_index(shard.axes))
        h = model(acts, batch, key)                                              # [T, d]
        jag = batch.sequences[seq]
        tgt_e = next_item_targets(jag, self._items(acts[f"{seq}.{ITEM_FIELD}"]),
                                  self._items(acts[tgt_feat]))
        tgt_ids = next_item_targets(jag, jag.values[ITEM_FIELD], batch.sparse[tgt_feat])
        ce = sampled_softmax(h, tgt_e, tgt_ids, self._items(acts[CANDIDATES]),
                             shard.ids[CANDIDATES], cfg.model.retrieval.temperature)
        seg = jnp.minimum(jag.segment_ids, jag.num_samples - 1)
        w = jnp.where(jag.mask, jnp.take(batch.weights, seg), 0.0)
        return {"loss_sum": jnp.sum(ce * w)[None], "weight_sum": jnp.sum(w)[None]}

    def predict(self, model, acts: dict, batch: Batch, shard: Shard) -> jax.Array:
        seq, tgt_feat = retrieval_sequence(self.cfg), target_feature(self.cfg)
        h = model(acts, batch, None)                                             # [T, d]
        jag = batch.sequences[seq]
        last = jnp.maximum(jag.offsets[1:] - 1, 0)
        scores = ((jnp.take(h, last, axis=0) @ self._items(acts[CANDIDATES]).T)
                  / self.cfg.model.retrieval.temperature)                        # [B, V]
        b, v = scores.shape
        catalog = np.ones(self.vocab, bool) if self.catalog is None else self.catalog
        not_item = jnp.broadcast_to(~jnp.asarray(catalog) | (jnp.arange(v) == 0), (b, v))
        hist = history_mask(jag, jag.values[ITEM_FIELD], v)
        targets = batch.sparse[tgt_feat]
        kept = target_ranks(scores, targets, not_item)
        masked = target_ranks(scores, targets, not_item | hist)
        return jnp.stack([masked, kept], axis=1)


class RetrievalTrainer(Trainer):
    """Trainer whose objective is `NextItemSoftmax` (module docstring); create() / state /
    checkpoints / the train step as Trainer."""

    @classmethod
    def create(cls, cfg: Config, *args, **kw) -> "RetrievalTrainer":
        trainer = super().create(cfg, *args, **kw)
        trainer.objective = NextItemSoftmax(cfg, schema_of(cfg).table(item_table(cfg)).vocab)
        return trainer

    @property
    def vocab(self) -> int:
        """Rows of the item table (row 0: padding)."""
        return self.objective.vocab

    def make_eval_step(self, catalog: np.ndarray | None = None) -> Callable:
        """(state, batch) -> ranks [rows of this process's shards, 2] int32 numpy: per row,
        items above its candidate with its history excluded, and kept. catalog [V] bool:
        the rankable rows (None: every row >= 1)."""
        ctx = dataclasses.replace(self.context(),
                                  objective=dataclasses.replace(self.objective, catalog=catalog))
        planned = self._planned(functools.partial(eval_step, ctx), "eval step")

        def local_rows(state, batch):
            return process_rows(planned(state, batch))

        return local_rows


def catalog_rows(cfg: Config, vocab: int, stream: str = "eval") -> np.ndarray:
    """[V] bool: the item rows a ranking competes over. A file source: rows >= 1 that
    occur in the train data or the ranked rows (`stream` "eval" or "valid": a row's next
    item or a history item), read once in file order through make_source; the synthetic
    stream: every row >= 1."""
    out = np.zeros(vocab, bool)
    if cfg.data.source == "synthetic":
        out[1:] = True
        return out
    seq, tgt = retrieval_sequence(cfg), target_feature(cfg)
    ranked = valid_files(cfg.data) if stream == "valid" else cfg.data.eval_path
    for path in (cfg.data.train_path, ranked):
        one_pass = dataclasses.replace(cfg, data=dataclasses.replace(
            cfg.data, eval_path=path, eval_batches=0))
        source = make_source(one_pass, "eval")
        for step in range(eval_steps(source, one_pass)):
            batch, _ = source.shard_batch(step, 0, 1)
            for ids in (batch.sparse[tgt], batch.sequences[seq].values[ITEM_FIELD]):
                ids = np.asarray(ids, np.int64)
                out[ids[(ids >= 0) & (ids < vocab)]] = True
    out[0] = False           # padding: the item of no row, and the value of unused tokens
    return out


def _all_processes(x: np.ndarray) -> np.ndarray:
    if jax.process_count() == 1:
        return x
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


class RetrievalEvaluator:
    """Full-ranking metrics over every row of the eval stream (module docstring);
    __call__(state) -> {"hr@10", "ndcg@10", "hr@50", "ndcg@50", "mrr" (mean 1 / (rank + 1)),
    the same "_unmasked", "rows", "catalog"}. stream: "eval" (the test rows) or "valid"
    (the validation rows of model selection)."""

    def __init__(self, trainer: RetrievalTrainer, cfg: Config, stream: str = "eval"):
        self.stream = make_source(cfg, stream)
        self.feeder = Feeder(self.stream.shard_batch, trainer.mesh, prefetch=0)
        self.catalog = catalog_rows(cfg, trainer.vocab, stream)
        self.step_fn = trainer.make_eval_step(self.catalog)
        self._host = [self.feeder.host_batch(i) for i in range(eval_steps(self.stream, cfg))]
        self.bayes = {"ne": None, "auc": None}

    def __call__(self, state) -> dict[str, Any]:
        ranks = []
        for batch, _, _ in self._host:
            r = np.asarray(self.step_fn(state, self.feeder.to_device(batch)))
            ranks.append(r[np.asarray(batch.weights) > 0])
        r = _all_processes(np.concatenate(ranks))
        out = {**ranking_summary(r[:, 0], KS),
               **{f"{k}_unmasked": v for k, v in ranking_summary(r[:, 1], KS).items()}}
        return {**out, "rows": int(len(r)), "catalog": int(self.catalog.sum())}

    @staticmethod
    def line(step: int, res: dict) -> str:
        return (f"[eval] step {step}: HR@10 {res['hr@10']:.4f} NDCG@10 {res['ndcg@10']:.4f} "
                f"HR@50 {res['hr@50']:.4f} HR@200 {res['hr@200']:.4f} MRR {res['mrr']:.4f} "
                f"(history excluded; kept: HR@10 "
                f"{res['hr@10_unmasked']:.4f}) over {res['rows']} rows, {res['catalog']} items")
