"""Jagged (packed, padding-free) sequences.

A device-local batch of B variable-length sequences is stored end to end in a
buffer of static capacity T (a multiple of the kernel block, so jit sees few
shapes):

    values       [T, ...]  tokens of sample 0, then sample 1, ...; rows past
                           offsets[B] are padding (zeros)
    offsets      [B+1]     int32, offsets[0] = 0, non-decreasing, offsets[B] <= T
    segment_ids  [T]       int32 sample index of each token; B (the sentinel)
                           on padding rows
    positions    [T]       int32 index of the token within its sample; 0 on
                           padding rows

`values` may be a single array or a dict of arrays sharing the leading T (the
fields of one event sequence: item ids, event types, timestamps...).

Host-side builders (`pack`, `from_padded`) run in numpy; `to_padded` and the
derived quantities work under jit as well.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

Array = Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Jagged:
    """Packed jagged tokens. See the module docstring for the layout."""

    values: Array | dict[str, Array]
    offsets: Array
    segment_ids: Array
    positions: Array

    @property
    def capacity(self) -> int:
        """T, the static token capacity."""
        return self.segment_ids.shape[0]

    @property
    def num_samples(self) -> int:
        """B."""
        return self.offsets.shape[0] - 1

    @property
    def lengths(self) -> Array:
        """[B] int32 tokens per sample."""
        return self.offsets[1:] - self.offsets[:-1]

    @property
    def mask(self) -> Array:
        """[T] bool, True on real tokens."""
        return self.segment_ids < self.num_samples

    def replace(self, **kw) -> "Jagged":
        return dataclasses.replace(self, **kw)

    def with_values(self, values: Array | dict[str, Array]) -> "Jagged":
        """Same layout, new values (leading dim T)."""
        return dataclasses.replace(self, values=values)


def bucket_capacity(num_tokens: int, multiple: int = 128) -> int:
    """Smallest capacity >= num_tokens from the geometric ladder multiple * 2^k.

    Few distinct capacities means few jit recompilations.
    """
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    cap = multiple
    while cap < num_tokens:
        cap *= 2
    return cap


def fit_to_capacity(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """Lengths [B] cut to min(length, c) with the largest common cap c whose total fits
    `capacity` (the longest sequences lose their oldest events first); unchanged when
    they already fit. int64 [B]."""
    lengths = np.asarray(lengths, np.int64)
    if lengths.sum() <= capacity:
        return lengths
    lo, hi = 0, int(lengths.max())
    while lo < hi:                                # binary search on the common cap
        mid = (lo + hi + 1) // 2
        if np.minimum(lengths, mid).sum() <= capacity:
            lo = mid
        else:
            hi = mid - 1
    return np.minimum(lengths, lo)


def layout_from_lengths(lengths: Sequence[int] | np.ndarray, capacity: int):
    """(offsets [B+1], segment_ids [T], positions [T]) as int32 numpy arrays."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.ndim != 1:
        raise ValueError(f"lengths must be 1-D [B], got shape {lengths.shape}")
    if (lengths < 0).any():
        raise ValueError(f"lengths must be >= 0, got min {lengths.min()}")
    total = int(lengths.sum())
    if total > capacity:
        raise ValueError(
            f"jagged batch holds {total} tokens but capacity is {capacity}: raise the "
            f"capacity (bucket_capacity({total}) = {bucket_capacity(total)}) or truncate")
    b = lengths.shape[0]
    offsets = np.zeros(b + 1, np.int32)
    np.cumsum(lengths, out=offsets[1:])
    segment_ids = np.empty(capacity, np.int32)
    segment_ids[:total] = np.repeat(np.arange(b, dtype=np.int32), lengths)
    segment_ids[total:] = b
    positions = np.zeros(capacity, np.int32)            # arange minus each sample's start
    positions[:total] = np.repeat(offsets[:-1], lengths)
    np.subtract(np.arange(total, dtype=np.int32), positions[:total], out=positions[:total])
    return offsets, segment_ids, positions


def _pack_field(seqs: Sequence[np.ndarray], capacity: int) -> np.ndarray:
    first = np.asarray(seqs[0]) if seqs else np.zeros((0,), np.float32)
    out = np.zeros((capacity,) + first.shape[1:], first.dtype)
    if seqs:
        total = sum(len(s) for s in seqs)
        if total:
            out[:total] = np.concatenate([np.asarray(s, first.dtype) for s in seqs])
    return out


def pack(seqs: Sequence[np.ndarray] | Mapping[str, Sequence[np.ndarray]],
         capacity: int | None = None, multiple: int = 128) -> Jagged:
    """Pack B host sequences (each [L_i, ...]) into a Jagged of capacity T.

    `seqs` is a list of arrays, or a dict field -> list of arrays (equal lengths
    per sample across fields). capacity=None picks bucket_capacity(sum L_i).
    """
    if isinstance(seqs, Mapping):
        fields = dict(seqs)
        if not fields:
            raise ValueError("pack: empty dict of fields")
        lens = {k: [len(s) for s in v] for k, v in fields.items()}
        ref_name, ref = next(iter(lens.items()))
        for k, v in lens.items():
            if v != ref:
                raise ValueError(f"pack: field {k!r} lengths differ from field {ref_name!r}")
        lengths = ref
    else:
        lengths = [len(s) for s in seqs]
    total = int(sum(lengths))
    if capacity is None:
        capacity = bucket_capacity(total, multiple)
    offsets, segment_ids, positions = layout_from_lengths(lengths, capacity)
    if isinstance(seqs, Mapping):
        values = {k: _pack_field(v, capacity) for k, v in seqs.items()}
    else:
        values = _pack_field(seqs, capacity)
    return Jagged(values, offsets, segment_ids, positions)


def from_padded(padded: np.ndarray, lengths: Sequence[int] | np.ndarray,
                capacity: int | None = None, multiple: int = 128) -> Jagged:
    """Padded [B, L, ...] with per-sample lengths -> Jagged (host side)."""
    padded = np.asarray(padded)
    lengths = np.asarray(lengths)
    if padded.ndim < 2 or padded.shape[0] != lengths.shape[0]:
        raise ValueError(f"from_padded: padded {padded.shape} must be [B, L, ...] with B = "
                         f"len(lengths) = {lengths.shape[0]}")
    if (lengths > padded.shape[1]).any():
        raise ValueError(f"from_padded: a length exceeds the padded length {padded.shape[1]}")
    return pack([padded[i, :n] for i, n in enumerate(lengths)], capacity, multiple)


def to_padded(j: Jagged, max_len: int, values: Array | None = None):
    """Jagged -> (padded [B, max_len, ...], mask [B, max_len]); works under jit.

    Tokens past max_len in a sample are dropped. `values` overrides j.values
    (a single array [T, ...]).
    """
    v = j.values if values is None else values
    if isinstance(v, dict):
        raise TypeError("to_padded takes one array; pass values=j.values[field]")
    b = j.num_samples
    pos = jnp.arange(max_len)[None, :]
    idx = j.offsets[:-1, None] + pos                       # [B, L]
    mask = pos < j.lengths[:, None]
    idx = jnp.where(mask, idx, 0)
    out = jnp.take(v, idx.reshape(-1), axis=0).reshape((b, max_len) + v.shape[1:])
    out = jnp.where(mask.reshape(mask.shape + (1,) * (v.ndim - 1)), out, 0)
    return out, mask


def validate(j: Jagged, name: str = "jagged") -> None:
    """Host-side check of the layout invariants; raises ValueError naming `name`."""
    off = np.asarray(j.offsets)
    seg = np.asarray(j.segment_ids)
    posn = np.asarray(j.positions)
    t = seg.shape[0]
    if off.ndim != 1 or off.shape[0] < 1:
        raise ValueError(f"{name}.offsets must be [B+1], got shape {off.shape}")
    if off[0] != 0:
        raise ValueError(f"{name}.offsets[0] must be 0, got {off[0]}")
    if (np.diff(off) < 0).any():
        i = int(np.argmax(np.diff(off) < 0))
        raise ValueError(f"{name}.offsets must be non-decreasing (sample {i} has negative length)")
    if off[-1] > t:
        raise ValueError(f"{name} holds {off[-1]} tokens but its capacity is {t}")
    leaves = [j.values] if not isinstance(j.values, dict) else list(j.values.values())
    for leaf in leaves:
        if np.shape(leaf)[0] != t:
            raise ValueError(f"{name}.values leading dim {np.shape(leaf)[0]} != capacity {t}")
    exp_off, exp_seg, exp_pos = layout_from_lengths(np.diff(off), t)
    if not np.array_equal(seg, exp_seg):
        raise ValueError(f"{name}.segment_ids disagree with offsets")
    if not np.array_equal(posn, exp_pos):
        raise ValueError(f"{name}.positions disagree with offsets")


def truncate_recent(seqs: Sequence[np.ndarray], max_len: int):
    """Keep the most recent max_len events of each sequence (the end of it).

    Returns (truncated list, number of sequences truncated) so callers can count
    the fallback in their metrics.
    """
    out, n = [], 0
    for s in seqs:
        if len(s) > max_len:
            out.append(s[len(s) - max_len:])
            n += 1
        else:
            out.append(s)
    return out, n

