"""Negatives resampled every epoch for a positives-only ranking train stream.

    sampler = NegativeSampler.load("ml-1m/ranking/negatives.npz")
    src = ResampledNegatives(ParquetSource(path, cols, batch_size=128, seed=0), sampler, 4)
    batch, info = src.shard_batch(step, shard, num_shards)     # 128 * (1 + 4) rows

The train file holds positives only (label 1). Each row served in epoch e gets N
negatives: the same row (user side, history, dense features) with the candidate item
and its item-side columns replaced by an item drawn uniformly from the sampler's
items minus the items of the row's user's exclusion list (the items the user rated).
Draw j of row r in epoch e is a pure function of (seed, e, r, j): a counter-based hash
(splitmix64 rounds) picks k uniform in [0, allowed_u) and the negative is the k-th
allowed item in item order, computed exactly (no rejection loop). A resumed run
therefore draws the same negatives, another epoch or seed draws others.

The batch of shard `shard` holds b = b_pos (1 + N) rows, b_pos the base source's local
batch: positive i at row i (1 + N), its negatives in the N rows after it (label 0,
label_mask 1, the positive's weight and surface). Sequences are the positive's, once
per row: capacity (1 + N) x the base source's. Counters (`SourceInfo.counters`) are the
base's times (1 + N) (each served row repeats its positive's repairs), `rows` the
positive's file row for each of its 1 + N rows.

The sampler file (an .npz, np.load without pickles; experiments/convert_movielens.py
--resample_negatives writes it next to train.parquet):

  user_column    str       the rows' user id column (a sparse feature), e.g. "user"
  item_column    str       the candidate item column (a sparse feature), e.g. "item"
  side_columns   [C] str   other sparse features that follow the item, e.g. ["genre"]
  items          [P] int   the items negatives are drawn from, sorted, distinct
  side           [C, P] int  the side columns' value for each item
  rated_offsets  [U + 1] int, rated_items [M] int: user u's excluded items are
                 rated_items[rated_offsets[u]:rated_offsets[u + 1]]
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from gemjax.data.jagged import Jagged, layout_from_lengths

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _splitmix(z: np.ndarray) -> np.ndarray:
    """One splitmix64 round of uint64 values (add the golden gamma, then finalise)."""
    z = z + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def draw_keys(seed: int, epoch: np.ndarray, row: np.ndarray, n: int) -> np.ndarray:
    """[R, n] uint64 hash of (seed, epoch [R], row [R], j) for j < n: the random bits of
    draw j of each row."""
    with np.errstate(over="ignore"):
        h = _splitmix(np.full(len(row), np.uint64(seed % 2 ** 64), np.uint64))
        h = _splitmix(h ^ np.asarray(epoch, np.int64).astype(np.uint64))
        h = _splitmix(h ^ np.asarray(row, np.int64).astype(np.uint64))
        return _splitmix(h[:, None] ^ np.arange(n, dtype=np.uint64)[None, :])


@dataclasses.dataclass(frozen=True)
class NegativeSampler:
    """Uniform negatives over `items` minus each user's excluded items (module docstring).

    items [P] sorted distinct; side {column: [P]}; excl_offsets [U + 1] and excl_ranks [M]:
    user u's excluded items as ascending indices into `items`; allowed [U] = P - their count.
    search_keys [M]: u (P + 1) + g_i per excluded item i of user u, g_i = its rank minus
    its index among u's excluded items = the allowed items before it (ascending).
    """

    user_column: str
    item_column: str
    items: np.ndarray
    side: dict
    excl_offsets: np.ndarray
    excl_ranks: np.ndarray
    search_keys: np.ndarray
    path: str = ""

    @classmethod
    def build(cls, user_column: str, item_column: str, items, side: dict, rated_offsets,
              rated_items, path: str = "") -> "NegativeSampler":
        """From raw arrays (rated items outside `items` are ignored: never drawn anyway).
        ValueError (naming `path`) for unsorted / repeated items, ragged side columns, bad
        offsets, or a user with no item left to draw."""
        where = f"negatives: {path}: " if path else "negatives: "
        items = np.asarray(items, np.int64)
        off = np.asarray(rated_offsets, np.int64)
        rated = np.asarray(rated_items, np.int64)
        if items.ndim != 1 or items.size == 0 or (np.diff(items) <= 0).any():
            raise ValueError(f"{where}items must be a non-empty sorted list of distinct ids")
        side = {c: np.asarray(v, np.int64) for c, v in side.items()}
        for c, v in side.items():
            if v.shape != items.shape:
                raise ValueError(f"{where}side column {c!r} has {v.shape} values, items {items.shape}")
        if (off.ndim != 1 or off.size < 1 or off[0] != 0 or (np.diff(off) < 0).any()
                or off[-1] != rated.size):
            raise ValueError(f"{where}rated_offsets must rise from 0 to len(rated_items) "
                             f"({rated.size})")
        user = np.repeat(np.arange(off.size - 1, dtype=np.int64), np.diff(off))
        rank = np.minimum(np.searchsorted(items, rated), items.size - 1)
        keep = items[rank] == rated
        keys = np.unique(user[keep] * items.size + rank[keep])       # per user, ascending
        u, r = np.divmod(keys, items.size)
        excl_off = np.zeros(off.size, np.int64)
        np.cumsum(np.bincount(u, minlength=off.size - 1), out=excl_off[1:])
        g = r - (np.arange(r.size) - excl_off[u])
        s = cls(user_column, item_column, items, side, excl_off, r, u * (items.size + 1) + g, path)
        full = np.flatnonzero(s.allowed == 0)
        if full.size:
            raise ValueError(f"{where}user {int(full[0])} excludes all {items.size} items; no "
                             f"negative can be drawn for it")
        return s

    @classmethod
    def load(cls, path: str) -> "NegativeSampler":
        """The sampler of an .npz file (module docstring); FileNotFoundError / ValueError
        naming the file and the missing key."""
        if not os.path.exists(path):
            raise FileNotFoundError(f"negatives: {path} not found (experiments/convert_movielens.py "
                                    f"--resample_negatives writes it next to train.parquet)")
        try:
            z = np.load(path, allow_pickle=False)
        except Exception as e:  # noqa: BLE001 - zip / format errors of several types
            raise ValueError(f"negatives: {path}: not an .npz file ({type(e).__name__}: {e})") from e
        with z:
            need = ("user_column", "item_column", "side_columns", "items", "side",
                    "rated_offsets", "rated_items")
            missing = [k for k in need if k not in z.files]
            if missing:
                raise ValueError(f"negatives: {path}: missing arrays {missing} (has {z.files})")
            cols = [str(c) for c in z["side_columns"].reshape(-1)]
            side = z["side"].reshape(len(cols), -1) if cols else np.zeros((0, 0))
            return cls.build(str(z["user_column"]), str(z["item_column"]), z["items"],
                             dict(zip(cols, side)), z["rated_offsets"], z["rated_items"], path)

    def save(self, path: str) -> None:
        """Write the sampler as `load` reads it (excluded items inside `items` only)."""
        cols = list(self.side)
        np.savez(path, user_column=np.array(self.user_column), item_column=np.array(self.item_column),
                 side_columns=np.array(cols, dtype=str),
                 items=self.items,
                 side=(np.stack([self.side[c] for c in cols]) if cols
                       else np.zeros((0, self.items.size), np.int64)),
                 rated_offsets=self.excl_offsets, rated_items=self.items[self.excl_ranks])

    @property
    def num_users(self) -> int:
        return self.excl_offsets.size - 1

    @property
    def allowed(self) -> np.ndarray:
        """[U] items each user may draw."""
        return self.items.size - np.diff(self.excl_offsets)

    @property
    def columns(self) -> tuple[str, ...]:
        """The columns a negative replaces: the item column, then the side columns."""
        return (self.item_column,) + tuple(self.side)

    def draw(self, users: np.ndarray, keys: np.ndarray) -> np.ndarray:
        """[R, n] indices into `items`: users [R], keys [R, n] uint64 (draw_keys). Draw
        (r, j) is the k-th allowed item of users[r], k = floor(hi32(key) * allowed / 2^32)."""
        users = np.asarray(users, np.int64)
        bad = (users < 0) | (users >= self.num_users)
        if bad.any():
            raise ValueError(f"negatives: {self.path or 'sampler'}: user id {int(users[bad][0])} "
                             f"is outside the sampler's {self.num_users} users")
        allowed = self.allowed[users].astype(np.uint64)[:, None]
        k = ((keys >> np.uint64(32)) * allowed) >> np.uint64(32)          # [R, n] < allowed
        k = k.astype(np.int64)
        # the k-th allowed item sits at rank k + #{excluded i of the user: g_i <= k}
        q = users[:, None] * (self.items.size + 1) + k
        before = np.searchsorted(self.search_keys, q, side="right") - self.excl_offsets[users][:, None]
        return k + before

    def negatives(self, users: np.ndarray, seed: int, epoch: np.ndarray, row: np.ndarray,
                  n: int) -> dict[str, np.ndarray]:
        """{column: [R, n]} the item and side columns of n negatives per row (users [R],
        epoch [R], row [R] the rows' global file numbers)."""
        idx = self.draw(users, draw_keys(seed, epoch, row, n))
        out = {self.item_column: self.items[idx]}
        out.update({c: v[idx] for c, v in self.side.items()})
        return out


class ResampledNegatives:
    """A positives-only train source with `n` negatives per row, redrawn each epoch
    (module docstring). base: a ParquetSource whose batch_size counts positives."""

    def __init__(self, base, sampler: NegativeSampler, n: int):
        if n < 1:
            raise ValueError(f"negatives per positive must be >= 1, got {n}")
        missing = [c for c in (sampler.user_column,) + sampler.columns
                   if c not in base.columns.sparse]
        if missing:
            raise ValueError(f"negatives: {sampler.path}: columns {missing} are not sparse "
                             f"features of the rows ({list(base.columns.sparse)})")
        vocab = dict(base.columns.vocab)
        for c, v in ((sampler.item_column, sampler.items), *sampler.side.items()):
            if c in vocab and (v.min() < 0 or v.max() >= vocab[c]):
                raise ValueError(f"negatives: {sampler.path}: column {c!r} holds ids in "
                                 f"[{v.min()}, {v.max()}], outside its table's {vocab[c]} rows")
        self.base, self.sampler, self.n = base, sampler, n
        self.group = 1 + n
        self.batch_size = base.batch_size * self.group
        self.seed, self.order = base.seed, base.order
        self.counter_names = tuple(getattr(base, "counter_names", ()))

    @property
    def num_rows(self) -> int:
        """Rows of one epoch: positives x (1 + n)."""
        return self.base.num_rows * self.group

    def local_batch_size(self, num_shards: int) -> int:
        return self.base.local_batch_size(num_shards) * self.group

    def sequence_capacity(self, num_shards: int) -> dict[str, int]:
        return {k: v * self.group for k, v in self.base.sequence_capacity(num_shards).items()}

    def steps_per_epoch(self, num_shards: int) -> int:
        return self.base.steps_per_epoch(num_shards)

    def shard_batch(self, step: int, shard: int = 0, num_shards: int = 1):
        pos, info = self.base.shard_batch(step, shard, num_shards)
        g, s = self.group, self.sampler
        b_pos = pos.labels.shape[0]
        epoch = self.base.epochs_of(step, shard, num_shards)
        neg = s.negatives(pos.sparse[s.user_column], self.seed, epoch, info.rows, self.n)
        rep = lambda x: np.repeat(x, g, axis=0)                          # noqa: E731
        sparse = {}
        for c, v in pos.sparse.items():
            sparse[c] = rep(v)
            if c in neg:
                sparse[c].reshape(b_pos, g)[:, 1:] = neg[c]
        is_pos = np.zeros((b_pos, g), bool)
        is_pos[:, 0] = True
        is_pos = is_pos.reshape(-1, 1)
        labels = np.where(is_pos, rep(pos.labels), 0.0).astype(np.float32)
        mask = np.where(is_pos, rep(pos.label_mask), 1.0).astype(np.float32)
        caps = self.sequence_capacity(num_shards)
        seqs = {k: repeat_jagged(j, g, caps[k]) for k, j in pos.sequences.items()}
        batch = pos.replace(sparse=sparse, dense=rep(pos.dense), sequences=seqs, labels=labels,
                            label_mask=mask, surface=rep(pos.surface), weights=rep(pos.weights))
        counters = type(info.counters)({k: int(v) * g for k, v in info.counters.items()})
        return batch, dataclasses.replace(info, counters=counters, rows=rep(info.rows))


def repeat_jagged(j, times: int, capacity: int):
    """Every sample of Jagged `j` (numpy) `times` times in a row: B -> B * times samples,
    packed into `capacity` tokens."""
    off = np.asarray(j.offsets, np.int64)
    lens = np.repeat(np.diff(off), times)
    offsets, seg, positions = layout_from_lengths(lens, capacity)
    total = int(lens.sum())
    src = np.repeat(np.repeat(off[:-1], times), lens) + positions[:total]
    values = {}
    for f, v in j.values.items():
        out = np.zeros((capacity,) + v.shape[1:], v.dtype)
        out[:total] = v[src]
        values[f] = out
    return Jagged(values, offsets, seg, positions)


def resample(base, cfg) -> ResampledNegatives:
    """The train source of a config with data.negatives = N > 0: `base` (a ParquetSource
    over data.train_path of data.batch_size / (1 + N) positives per step) in
    ResampledNegatives with the sampler of data.negatives_path ("": negatives.npz beside
    the train file, or inside the train directory)."""
    d = cfg.data
    if d.batch_size % (1 + d.negatives):
        raise ValueError(f"data.batch_size={d.batch_size} must be a multiple of 1 + "
                         f"data.negatives = {1 + d.negatives} (each positive brings its negatives)")
    return ResampledNegatives(base, NegativeSampler.load(
        d.negatives_path or default_sampler_path(d.train_path)), d.negatives)


def default_sampler_path(train_path: str) -> str:
    """negatives.npz in train_path's directory (train_path itself when a directory)."""
    base = train_path if os.path.isdir(train_path) else os.path.dirname(train_path)
    return os.path.join(base, "negatives.npz")
