"""Synthetic recommendation stream with a planted teacher (known Bayes-optimal NE).

Every batch is a pure function of (seed, stream, step, shard): resuming, or
splitting the global batch over a different number of processes, reproduces the
same samples, on any CPU type: the values come from numpy's Generator draws and
exactly rounded arithmetic (`portable_math` for exp / log / pow and for the dot
products: no BLAS kernel or SIMD dispatch decides a bit). Shards are numbered globally (process_index * local_devices + d).

Features of one sample (`gemjax.config.synthetic_schema(cfg)` is their FeatureSchema):
  sparse   user (Zipf over data.synthetic.vocab_user; no direct signal), segment (a hash of
           the user), context (Zipf), item (candidate, Zipf within its category),
           item_cat (= item % num_categories)
  dense    num_dense standard normals
  clicks   event sequence {item, cat, event}: log-normal length, each event from
           one of the user's 3 favourite categories with probability 0.7
  views    the same with probability 0.5
  surface  uniform over num_surfaces

The teacher's logit for (surface s, task k) is base[s,k] + alpha[s,k] * z with
  z = w_seg[segment] + w_ctx[context] + w_item[item]                  first order
    + fm * (<u[segment], c[context]> + <g[item_cat], h[context]>)     pairwise
    + dense @ w_dense
    + clicks_signal * frac(cat == item_cat over the last `recent` clicks)
    + views_signal * mean(q[cat] over the last `recent` views) * q[item_cat]
so a model needs feature interactions and both sequences to reach the Bayes NE.
The user's favourite categories are a hash of the user id (100k values by
default), so only the sequences reveal them.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from gemjax.config import (SEQUENCE_FIELDS, SEQUENCES, SPARSE_FEATURES,  # noqa: F401 (the stream's names)
                           DataConfig, synthetic_schema)
from gemjax.data.batch import Batch
from gemjax.data import portable_math
from gemjax.data.jagged import Jagged, fit_to_capacity, layout_from_lengths
from gemjax.features import FeatureSchema

_FAV_PROB = {"clicks": 0.7, "views": 0.5}
_NUM_FAV = 3
_STREAMS = {"train": 0, "eval": 1, "valid": 2}   # seeds apart: train, test, validation


def _multiplier(v: int) -> int:
    """A large multiplier coprime to v, so rank -> rank * m % v is a bijection."""
    m = 2_654_435_761
    while math.gcd(m, v) != 1:
        m += 2
    return m


# Vocabularies up to this size sample Zipf ranks from a table of their CDF (see zipf_ranks).
ZIPF_TABLE_MAX_VOCAB = 1 << 22
_GUIDE_CELLS = 1 << 16


def _zipf_cdf_at(n: np.ndarray, vocab: int, a: float) -> np.ndarray:
    """u at which the continuous inverse CDF reaches n (float64, `portable_math`)."""
    if abs(a - 1.0) < 1e-9:
        return portable_math.log(n) / portable_math.log(vocab + 1.0)
    return (portable_math.pow(n, 1 - a) - 1) / (portable_math.pow(vocab + 1.0, 1 - a) - 1)


@functools.lru_cache(maxsize=64)
def _zipf_table(vocab: int, a: float) -> tuple[np.ndarray, np.ndarray]:
    """(thresholds [vocab], guide [_GUIDE_CELLS]) of the rank table.

    rank(u) = #{r in 1..vocab-1: u >= thresholds[r - 1]} (thresholds[vocab - 1] = inf
    ends every search); guide[g] = rank(g / _GUIDE_CELLS), the smallest rank in cell g.
    """
    t = _zipf_cdf_at(np.arange(2, vocab + 1, dtype=np.float64), vocab, a)
    np.maximum.accumulate(t, out=t)                       # monotone whatever the rounding
    t = np.append(t, np.inf)
    cells = np.arange(_GUIDE_CELLS, dtype=np.float64) / _GUIDE_CELLS
    guide = np.searchsorted(t, cells, side="right").astype(np.int32)
    t.setflags(write=False)
    guide.setflags(write=False)
    return t, guide


def zipf_ranks(rng: np.random.Generator, vocab: int, a: float, size,
               out: np.ndarray | None = None) -> np.ndarray:
    """Ranks in [0, vocab) with P(rank r) ~ (r + 1)^-a (continuous inverse CDF, floored).

    int64 array of shape `size`, or written into `out` (an integer array of that
    shape, e.g. an int32 slice of a packed buffer) and returned. One uniform draw per
    rank. The same ranks on every CPU type: for vocab <= ZIPF_TABLE_MAX_VOCAB a rank is
    the number of CDF thresholds (the inverse CDF's integer crossings, computed once per
    (vocab, a) with `portable_math`) at or below its draw, found from a guide table of
    2**16 cells and a few compares; larger vocabularies floor the inverse CDF itself
    (`portable_math.pow` / `exp` per draw). Both read only exactly rounded operations.
    """
    x = rng.random(size)
    if out is not None and (out.shape != x.shape or out.dtype.kind not in "iu"):
        raise ValueError(f"zipf_ranks: out must be an integer array of shape {x.shape}, got "
                         f"{out.dtype} {out.shape}")
    r = np.empty(x.shape, np.int64) if out is None else out
    if vocab <= ZIPF_TABLE_MAX_VOCAB:
        t, guide = _zipf_table(vocab, float(a))
        flat_x = x.reshape(-1)
        cell = np.multiply(flat_x, _GUIDE_CELLS).astype(np.int32)   # exact: * 2**16, floored
        rank = guide.take(cell)                                     # int32, ranks < vocab
        idx = np.flatnonzero(flat_x >= t.take(rank))                # the few not yet at their rank
        while idx.size:
            rank[idx] += 1
            idx = idx[flat_x[idx] >= t.take(rank[idx])]
        np.copyto(r, rank.reshape(x.shape), casting="unsafe")
        return r
    if abs(a - 1.0) < 1e-9:
        x *= portable_math.log(vocab + 1.0)
        x = portable_math.exp(x)
    else:
        x *= portable_math.pow(vocab + 1.0, 1 - a) - 1
        x += 1
        x = portable_math.pow(x, 1 / (1 - a))
    np.floor(x, out=x)
    np.copyto(r, x, casting="unsafe")                     # exact: integral values < vocab + 2
    r -= 1
    return np.clip(r, 0, vocab - 1, out=r)


@dataclasses.dataclass
class PlantedTeacher:
    """The known logistic model behind the labels (parameters drawn from seed)."""

    cfg: DataConfig
    seed: int

    def __post_init__(self):
        c = self.cfg.synthetic
        rng = np.random.default_rng([self.seed, 7919])
        r = 4
        self.w_seg = rng.normal(0, c.first_order, c.vocab_segment)
        self.w_ctx = rng.normal(0, c.first_order, c.vocab_context)
        self.w_item = rng.normal(0, 1.0, c.vocab_item) * c.item_bias
        self.u_seg = rng.normal(0, 1 / math.sqrt(math.sqrt(r)), (c.vocab_segment, r))
        self.c_ctx = rng.normal(0, 1 / math.sqrt(math.sqrt(r)), (c.vocab_context, r))
        self.g_cat = rng.normal(0, 1 / math.sqrt(math.sqrt(r)), (c.num_categories, r))
        self.h_ctx = rng.normal(0, 1 / math.sqrt(math.sqrt(r)), (c.vocab_context, r))
        self.w_dense = rng.normal(0, c.dense_signal / math.sqrt(max(c.num_dense, 1)), c.num_dense)
        self.q_cat = rng.choice([-1.0, 1.0], c.num_categories)
        base = np.array([-0.8, -1.6, -0.4, -1.2, -1.0, -2.0])
        self.base = np.resize(base, c.num_surfaces * c.num_tasks).reshape(c.num_surfaces, c.num_tasks)
        self.alpha = rng.uniform(0.7, 1.3, (c.num_surfaces, c.num_tasks))

    def logits(self, segment, context, item, item_cat, dense, clicks_frac, views_q, surface):
        """[B, K] true logits."""
        c = self.cfg.synthetic
        z = self.w_seg[segment] + self.w_ctx[context] + self.w_item[item]
        pair = np.zeros_like(z)
        for u, v in ((self.u_seg[segment], self.c_ctx[context]),
                     (self.g_cat[item_cat], self.h_ctx[context])):
            pair += portable_math.dot(u * v, np.ones(u.shape[1]))
        z = z + c.fm * pair
        z = z + portable_math.dot(dense, self.w_dense)
        z = z + c.clicks_signal * clicks_frac + c.views_signal * views_q * self.q_cat[item_cat]
        return self.base[surface] + self.alpha[surface] * z[:, None]


@dataclasses.dataclass
class ShardInfo:
    """Side outputs of one shard's batch: true probabilities and fallback counters."""

    true_probs: np.ndarray          # [B, K]
    seq_truncated_to_cap: int       # sequences longer than data.synthetic.seq_cap (oldest events dropped)
    seq_truncated_to_capacity: int  # sequences cut so a packed batch fits its capacity


class SyntheticStream:
    """Planted-teacher batches: `shard_batch(step, shard, num_shards)`."""

    def __init__(self, cfg: DataConfig, seed: int, stream: str = "train"):
        if stream not in _STREAMS:
            raise ValueError(f"stream must be one of {sorted(_STREAMS)}, got {stream!r}")
        self.cfg, self.seed, self.stream = cfg, seed, stream
        self.teacher = PlantedTeacher(cfg, seed)
        self._user_mult = _multiplier(cfg.synthetic.vocab_user)

    @property
    def schema(self) -> FeatureSchema:
        """The features of every batch (`synthetic_schema`)."""
        return synthetic_schema(self.cfg)

    def local_batch_size(self, num_shards: int) -> int:
        if self.cfg.batch_size % num_shards:
            raise ValueError(f"data.batch_size={self.cfg.batch_size} is not divisible by the "
                             f"{num_shards} batch shards (devices)")
        return self.cfg.batch_size // num_shards

    def sequence_capacity(self, num_shards: int) -> int:
        per = self.cfg.sequence_capacity / num_shards
        return max(128, int(math.ceil(per / 128)) * 128)

    def _favourites(self, user: np.ndarray) -> np.ndarray:
        """[B, 3] favourite categories, a hash of the user id."""
        c = self.cfg.synthetic.num_categories
        ks = np.array([0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D], np.int64)
        return ((user[:, None] * ks[None, :] + (user[:, None] >> 7)) % 2_147_483_647) % c

    def _items_of(self, rng, cats: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Item ids: category + num_categories * Zipf rank within the category (int64, or
        written into the integer array `out`)."""
        c = self.cfg.synthetic
        per_cat = c.vocab_item // c.num_categories
        items = zipf_ranks(rng, per_cat, c.zipf, cats.shape, out=out)
        items *= c.num_categories
        items += cats
        return items

    def _sequence(self, rng, name, fav, capacity):
        """One event sequence of the shard, packed into `capacity` tokens.

        Returns (Jagged, (seg_r, cats_r), over_cap, n_cut): seg_r / cats_r are the
        sample index and category of every token in the teacher's recency window
        (the last `recent` events of each sample, before any capacity cut), in
        token order. The random draws (their order and sizes) define the stream;
        everything else is vectorised numpy on int32 where the values allow.
        """
        c = self.cfg.synthetic
        b = fav.shape[0]
        raw = portable_math.exp(rng.normal(float(portable_math.log(c.seq_median)), c.seq_sigma, b))
        lengths = np.maximum(np.rint(raw).astype(np.int64), 1)
        lengths[rng.random(b) < 0.05] = 0                 # new users: empty histories
        over_cap = int((lengths > c.seq_cap).sum())
        lengths = np.minimum(lengths, c.seq_cap)          # keep the most recent seq_cap events
        total = int(lengths.sum())
        fits = total <= capacity
        if fits:                                          # the usual case: the layout is final
            off, seg_ids, posn = layout_from_lengths(lengths, capacity)
            seg = seg_ids[:total]
        else:
            seg = np.repeat(np.arange(b, dtype=np.int32), lengths)
        use_fav = rng.random(total) < _FAV_PROB[name]
        fav_slot = rng.integers(0, _NUM_FAV, total, dtype=np.int32)   # index into fav.ravel()
        fav_slot += seg * _NUM_FAV
        cats = rng.integers(0, c.num_categories, total, dtype=np.int32)
        np.copyto(cats, fav.ravel().astype(np.int32).take(fav_slot), where=use_fav)
        del fav_slot, use_fav
        item_buf = np.zeros(capacity, np.int32) if fits else np.empty(total, np.int32)
        self._items_of(rng, cats, out=item_buf[:total])   # written in place when the batch fits
        events = rng.integers(0, c.num_event_types, total, dtype=np.int32)
        ends = np.cumsum(lengths)                         # offsets[1:] of the uncut sequence
        # the teacher's recency window: tokens [end - min(L, recent), end) of each sample
        n_recent = np.minimum(lengths, self.cfg.recent)
        r_total = int(n_recent.sum())
        seg_r = np.repeat(np.arange(b, dtype=np.int32), n_recent)
        r_start = np.zeros(b, np.int64)
        np.cumsum(n_recent[:-1], out=r_start[1:])
        idx_r = np.repeat(ends - n_recent - r_start, n_recent)
        idx_r += np.arange(r_total)
        cats_r = cats[idx_r]
        n_cut = 0
        if fits:
            fields = (("cat", cats), ("event", events))
        else:
            # packed batch must fit `capacity`: cut the longest sequences (oldest events first)
            cut = fit_to_capacity(lengths, capacity)
            n_cut = int((cut < lengths).sum())
            pos_from_end = ends[seg] - 1 - np.arange(total)
            keep = pos_from_end < cut[seg]
            off, seg_ids, posn = layout_from_lengths(cut, capacity)
            fields = (("cat", cats[keep]), ("event", events[keep]))
            items = item_buf[keep]
            item_buf = np.zeros(capacity, np.int32)
            item_buf[:items.shape[0]] = items
        vals = {"item": item_buf}
        for f, v in fields:
            buf = np.zeros(capacity, np.int32)            # calloc: the padding tail is never touched
            buf[:v.shape[0]] = v
            vals[f] = buf
        jag = Jagged(vals, off, seg_ids, posn)
        return jag, (seg_r, cats_r), over_cap, n_cut

    def shard_batch(self, step: int, shard: int = 0, num_shards: int = 1):
        """(Batch of numpy arrays, ShardInfo) for one shard of global step `step`."""
        c = self.cfg.synthetic
        if not 0 <= shard < num_shards:
            raise ValueError(f"shard {shard} out of range for {num_shards} shards")
        b = self.local_batch_size(num_shards)
        cap = self.sequence_capacity(num_shards)
        rng = np.random.default_rng([self.seed, _STREAMS[self.stream], step, shard])
        user = (zipf_ranks(rng, c.vocab_user, c.zipf, b) * self._user_mult) % c.vocab_user
        segment = (user * 40503 + 17) % c.vocab_segment
        context = zipf_ranks(rng, c.vocab_context, c.zipf, b)
        fav = self._favourites(user)
        cand_cat = np.where(rng.random(b) < 0.5, fav[np.arange(b), rng.integers(0, _NUM_FAV, b)],
                            rng.integers(0, c.num_categories, b))
        item = self._items_of(rng, cand_cat)
        dense = rng.normal(size=(b, c.num_dense)).astype(np.float32)
        surface = rng.integers(0, c.num_surfaces, b)
        seqs, stats = {}, [0, 0]
        signal = {}
        for name in SEQUENCES:
            jag, (seg_r, cats_r), over_cap, n_cut = self._sequence(rng, name, fav, cap)
            seqs[name] = jag
            stats[0] += over_cap
            stats[1] += n_cut
            cnt = np.bincount(seg_r, minlength=b).astype(np.float64)
            if name == "clicks":
                hit = np.bincount(seg_r, weights=(cats_r == cand_cat[seg_r]), minlength=b)
                signal[name] = np.where(cnt > 0, hit / np.maximum(cnt, 1), 0.0)
            else:
                q = np.bincount(seg_r, weights=self.teacher.q_cat[cats_r], minlength=b)
                signal[name] = np.where(cnt > 0, q / np.maximum(cnt, 1), 0.0)
        logits = self.teacher.logits(segment, context, item, cand_cat, dense.astype(np.float64),
                                     signal["clicks"], signal["views"], surface)
        probs = 1.0 / (1.0 + portable_math.exp(-logits))
        labels = (rng.random(probs.shape) < probs).astype(np.float32)
        label_mask = np.ones_like(labels)
        if c.num_tasks > 1:
            label_mask[:, 1:] = (rng.random((b, c.num_tasks - 1)) < 0.8)
        i32 = lambda a: np.asarray(a, np.int32)  # noqa: E731
        batch = Batch(
            sparse={"user": i32(user), "segment": i32(segment), "context": i32(context),
                    "item": i32(item), "item_cat": i32(cand_cat)},
            dense=dense, sequences=seqs, labels=labels, label_mask=label_mask,
            surface=i32(surface), weights=np.ones(b, np.float32))
        return batch, ShardInfo(probs, stats[0], stats[1])
