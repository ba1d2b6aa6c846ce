"""A time-ordered synthetic stream whose planted model drifts (online training).

The stream is `gemjax.data.synthetic`'s planted-teacher stream cut into windows of
cfg.drift.every steps; window(step) = step // drift.every. Within a window the
stream is stationary; at each window start three things move:

  label function  the teacher's first-order weights (segment, context, item), FM
                  factors (u, c, g, h) and dense weights take a step of a random walk
                  that keeps their scale:  p_w = sqrt(1 - s^2) * p_{w-1} + s * n_w
                  (s = drift_strength, n_w drawn like p_0 from (seed, w)), so the
                  correlation of p_w with p_0 is (1 - s^2)^(w/2);
  popularity      the item of within-category Zipf rank r is rank
                  (r + w * popularity_shift) mod per_cat (candidates and sequence
                  events): the head items of window w were tail items before;
  new ids         window w opens a block of NEW_BLOCK = per_cat // 4 fresh ranks per
                  category, ranks per_cat + w * NEW_BLOCK + j (j < NEW_BLOCK): raw item
                  ids (category + num_categories * rank) that no earlier window holds.
                  Each item (candidate or event) is, with probability new_id_rate, a
                  fresh one: the fresh ranks opened so far ordered newest first, Zipf
                  over that order (the newest ids most popular, older ones fading).
                  Raw ids reach beyond data.synthetic.vocab_item; `gemjax.sparse.admission`
                  maps them to table rows. A fresh id's item bias is drawn once from
                  (seed, its block) with the scale of data.synthetic.item_bias and does not drift.

per_cat = vocab_item // num_categories. Every batch is a pure function of
(seed, stream, step, shard, num_shards), as in the synthetic stream (the same
numpy draws and exactly rounded arithmetic: the drift uses only +, *, sqrt), so a
resumed run reads the same samples. Shard infos are `synthetic.ShardInfo`; their
true_probs give the Bayes-optimal NE of any window. `shard_batch(...,
teacher_window=v)` labels window w's samples with window v's teacher (same features
and the same label draws): how a model of the label function of window v fares on
window w.
"""

from __future__ import annotations

import math
import threading

import numpy as np

from gemjax.config import DataConfig
from gemjax.data.synthetic import PlantedTeacher, SyntheticStream, zipf_ranks

# The teacher parameters that drift (PlantedTeacher attribute names).
DRIFTING = ("w_seg", "w_ctx", "w_item", "u_seg", "c_ctx", "g_cat", "h_ctx", "w_dense")


def per_category(cfg: DataConfig) -> int:
    """Base item ranks per category (vocab_item // num_categories)."""
    return cfg.synthetic.vocab_item // cfg.synthetic.num_categories


def new_block(cfg: DataConfig) -> int:
    """Fresh ranks per category opened by each window (>= 1)."""
    return max(1, per_category(cfg) // 4)


class _ItemBias:
    """Item biases indexed by raw item id: base ids from the window's drifted array,
    fresh ids (>= the base id range) from their block's fixed draw."""

    def __init__(self, base: np.ndarray, cfg: DataConfig, seed: int):
        self.base, self.cfg, self.seed = base, cfg, seed
        self._blocks: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()

    def _block(self, b: int) -> np.ndarray:
        with self._lock:
            if b not in self._blocks:
                rng = np.random.default_rng([self.seed, 7919, 1, b])
                s = self.cfg.synthetic
                self._blocks[b] = rng.normal(0, 1.0, new_block(self.cfg) * s.num_categories) \
                    * s.item_bias
            return self._blocks[b]

    def __getitem__(self, item) -> np.ndarray:
        item = np.asarray(item, np.int64)
        c = self.cfg.synthetic.num_categories
        base_ids = per_category(self.cfg) * c
        out = self.base[np.minimum(item, base_ids - 1)]
        fresh = item >= base_ids
        if fresh.any():
            rank = item[fresh] // c - per_category(self.cfg)
            blk, j = rank // new_block(self.cfg), rank % new_block(self.cfg)
            vals = np.empty(blk.shape, np.float64)
            for b in np.unique(blk):
                sel = blk == b
                vals[sel] = self._block(int(b))[j[sel] * c + item[fresh][sel] % c]
            out = out.copy()
            out[fresh] = vals
        return out


def _noise(cfg: DataConfig, seed: int, window: int) -> dict[str, np.ndarray]:
    """n_w: the drifting parameters drawn afresh (the scales of PlantedTeacher)."""
    rng = np.random.default_rng([seed, 7919, 0, window])
    r = 4
    f = 1 / math.sqrt(math.sqrt(r))
    s = cfg.synthetic
    return {"w_seg": rng.normal(0, s.first_order, s.vocab_segment),
            "w_ctx": rng.normal(0, s.first_order, s.vocab_context),
            "w_item": rng.normal(0, 1.0, s.vocab_item) * s.item_bias,
            "u_seg": rng.normal(0, f, (s.vocab_segment, r)),
            "c_ctx": rng.normal(0, f, (s.vocab_context, r)),
            "g_cat": rng.normal(0, f, (s.num_categories, r)),
            "h_ctx": rng.normal(0, f, (s.vocab_context, r)),
            "w_dense": rng.normal(0, s.dense_signal / math.sqrt(max(s.num_dense, 1)),
                                  s.num_dense)}


class _WindowStream(SyntheticStream):
    """The synthetic stream with window `window`'s items (popularity shift, fresh ids)
    and a given teacher."""

    def __init__(self, cfg: DataConfig, seed: int, stream: str, window: int, teacher):
        super().__init__(cfg, seed, stream)
        self.window, self.teacher = window, teacher

    def _items_of(self, rng, cats: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        c = self.cfg
        per_cat = per_category(c)
        ranks = zipf_ranks(rng, per_cat, c.synthetic.zipf, cats.shape)
        if c.drift.popularity_shift:
            ranks += self.window * c.drift.popularity_shift
            ranks %= per_cat
        if c.drift.new_id_rate > 0:
            fresh = rng.random(cats.shape) < c.drift.new_id_rate
            opened = (self.window + 1) * new_block(c)          # fresh ranks opened so far
            age = zipf_ranks(rng, opened, c.synthetic.zipf, cats.shape)  # 0: the newest fresh rank
            ranks = np.where(fresh, per_cat + opened - 1 - age, ranks)
        items = ranks * c.synthetic.num_categories + cats
        if out is None:
            return items
        np.copyto(out, items, casting="unsafe")
        return out


class DriftingStream:
    """Source protocol (`gemjax.data.source`) over the drifting stream (module doc).

    Raw item ids exceed data.synthetic.vocab_item once new_id_rate > 0 (fresh ids); feed the
    batches through an id admission (`gemjax.sparse.admission`) before a model.
    """

    def __init__(self, cfg: DataConfig, seed: int, stream: str = "train"):
        if cfg.drift.every < 1:
            raise ValueError(f"DriftingStream needs data.drift.every >= 1 (steps per window), "
                             f"got {cfg.drift.every}")
        self.cfg, self.seed, self.stream = cfg, seed, stream
        self._teachers: dict[int, PlantedTeacher] = {0: PlantedTeacher(cfg, seed)}
        self._streams: dict[tuple[int, int], _WindowStream] = {}
        self._lock = threading.Lock()
        self._teachers[0].w_item = _ItemBias(self._teachers[0].w_item, cfg, seed)

    def window(self, step: int) -> int:
        """The window of global step `step`."""
        return step // self.cfg.drift.every

    def window_steps(self, window: int) -> range:
        """The global steps of `window`."""
        return range(window * self.cfg.drift.every, (window + 1) * self.cfg.drift.every)

    def teacher(self, window: int) -> PlantedTeacher:
        """The planted teacher of `window` (computed once, from window 0 on)."""
        with self._lock:
            w = max(self._teachers)
            while w < window:
                prev, s = self._teachers[w], self.cfg.drift.strength
                keep = math.sqrt(1.0 - s * s)
                t = PlantedTeacher.__new__(PlantedTeacher)
                t.__dict__.update(prev.__dict__)
                noise = _noise(self.cfg, self.seed, w + 1)
                for name in DRIFTING:
                    old = prev.w_item.base if name == "w_item" else getattr(prev, name)
                    new = old * keep + noise[name] * s
                    setattr(t, name, _ItemBias(new, self.cfg, self.seed) if name == "w_item" else new)
                w += 1
                self._teachers[w] = t
            return self._teachers[window]

    def _stream_of(self, window: int, teacher_window: int) -> _WindowStream:
        teacher = self.teacher(teacher_window)
        with self._lock:
            key = (window, teacher_window)
            if key not in self._streams:
                self._streams[key] = _WindowStream(self.cfg, self.seed, self.stream, window, teacher)
            return self._streams[key]

    @property
    def schema(self):
        """The features of every batch (`gemjax.config.synthetic_schema`; item ids raw)."""
        return self._stream_of(0, 0).schema

    def local_batch_size(self, num_shards: int) -> int:
        return self._stream_of(0, 0).local_batch_size(num_shards)

    def sequence_capacity(self, num_shards: int) -> int:
        return self._stream_of(0, 0).sequence_capacity(num_shards)

    def shard_batch(self, step: int, shard: int = 0, num_shards: int = 1, *,
                    teacher_window: int | None = None):
        """(Batch of numpy arrays with raw item ids, synthetic.ShardInfo) for one shard of
        global step `step`; teacher_window: label with that window's teacher instead."""
        w = self.window(step)
        return self._stream_of(w, w if teacher_window is None else teacher_window).shard_batch(
            step, shard, num_shards)


class StreamFrom:
    """Source protocol over `stream` (a DriftingStream) read from global step `start`:
    shard_batch(step, ...) is stream.shard_batch(start + step, ...)."""

    def __init__(self, stream: DriftingStream, start: int):
        if start < 0:
            raise ValueError(f"StreamFrom: start must be >= 0, got {start}")
        self.stream, self.start = stream, start

    @property
    def schema(self):
        return self.stream.schema

    def local_batch_size(self, num_shards: int) -> int:
        return self.stream.local_batch_size(num_shards)

    def sequence_capacity(self, num_shards: int) -> int:
        return self.stream.sequence_capacity(num_shards)

    def shard_batch(self, step: int, shard: int = 0, num_shards: int = 1):
        return self.stream.shard_batch(self.start + step, shard, num_shards)
