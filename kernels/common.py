"""Shared pieces of the jagged attention ops and both engines: layout, tile ranges, masks,
RoPE, input checks, the part of a config (`config_part`).

Layout (see gemjax/data/jagged.py): B samples packed end to end in a buffer of
static capacity T; offsets [B+1] int32, offsets[0] = 0, non-decreasing,
offsets[B] <= T; rows past offsets[B] are padding.

Mask semantics shared by every op (`pair_mask`): query i may attend key j iff
they belong to the same sample and, with pos = index within the sample,
  causal:          pos_k <= pos_q
  window w:        pos_q - pos_k < w (causal) or |pos_q - pos_k| < w (non-causal)
  block b:         pos_q // b == pos_k // b   (block_attention only)
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

# The first interpret-mode pallas_call lowering imports Pallas's interpreter modules; one
# of them imports Pallas's fuser, which defines a config option that is part of JAX's trace
# context (pallas_fuser_disable_nested_fuse): every jitted function traced before that
# lowering (a train step whose update runs a kernel in interpret mode, say) would be traced
# and lowered again at its next call. Importing the fuser with the kernels fixes the trace
# context before anything is traced (same programs); tests/test_kernels_common.py checks
# that running the interpret-mode kernels adds nothing to it.
try:
    from jax._src.pallas.fuser import jaxpr_fusion  # noqa: F401
except Exception:       # pragma: no cover  (JAX internals moved or fail to import here:
    pass                # the kernels work as before, only the retrace is back)

# Padding rows get this segment id on the key side so they never match a query
# (queries' padding rows get B).
KEY_PAD_SEGMENT = -1


def segment_layout(offsets, capacity):
    """(segment_ids [T] int32, positions [T] int32) from offsets [B+1].

    Padding rows get segment B and position 0.
    """
    t = jnp.arange(capacity, dtype=jnp.int32)
    b = offsets.shape[0] - 1
    # seg[t] = #{i >= 1 : offsets[i] <= t}: a scatter of B ones and a cumsum (cheaper
    # than searchsorted on GPU); offsets past the capacity land in the dropped slot.
    ends = jnp.minimum(offsets[1:].astype(jnp.int32), capacity)
    seg = jnp.cumsum(jnp.zeros((capacity + 1,), jnp.int32).at[ends].add(1))[:capacity]
    start = jnp.take(offsets, jnp.minimum(seg, max(b - 1, 0)), axis=0)
    pos = jnp.where(seg < b, t - start, 0)
    return seg, pos.astype(jnp.int32)


def layout_mask(qs, qp, ks, kp, *, causal=False, window=None, block=None):
    """[..., Tq, Tk] bool from query (qs, qp) [Tq] and key (ks, kp) [Tk] layouts.

    Key padding rows must carry KEY_PAD_SEGMENT (or any id no query has).
    """
    m = qs[:, None] == ks[None, :]
    d = qp[:, None] - kp[None, :]
    if causal:
        m &= d >= 0
    if window is not None:
        m &= (d < window) if causal else (jnp.abs(d) < window)
    if block is not None:
        m &= (qp[:, None] // block) == (kp[None, :] // block)
    return m


def key_layout(kv_offsets, tk):
    """Key-side (segment_ids, positions) with padding rows set to KEY_PAD_SEGMENT."""
    ks, kp = segment_layout(kv_offsets, tk)
    b = kv_offsets.shape[0] - 1
    return jnp.where(ks < b, ks, KEY_PAD_SEGMENT), kp


def tile_ranges(start, end, row_tile, col_tile):
    """Per row tile, the [first, last) column tiles covering its tokens' [start, end)."""
    n = start.shape[0] // row_tile
    lo = start.reshape(n, row_tile).min(axis=1)
    hi = end.reshape(n, row_tile).max(axis=1)
    first = lo // col_tile
    last = (hi + col_tile - 1) // col_tile
    empty = hi <= lo
    return jnp.where(empty, 0, first).astype(jnp.int32), jnp.where(empty, 0, last).astype(jnp.int32)


def interior_ranges(start, end, row_tile, col_tile, lo, hi):
    """Per row tile, the [first, last) column tiles whose every pair is valid.

    A pair is valid iff the column lies in its row's [start, end) (exact for the
    sample, causal, window and block masks, which give one interval per token), so
    the columns valid for the whole tile are the intersection [max start, min end);
    a padding row (start BIG, end 0) empties it. Clipped to [lo, hi) so that
    lo <= first <= last <= hi; empty -> first = last = hi (all tiles masked).
    """
    n = start.shape[0] // row_tile
    s = start.reshape(n, row_tile).max(axis=1)
    e = end.reshape(n, row_tile).min(axis=1)
    first = jnp.clip((s + col_tile - 1) // col_tile, lo, hi)
    last = jnp.clip(e // col_tile, first, hi)
    empty = last <= first
    return (jnp.where(empty, hi, first).astype(jnp.int32),
            jnp.where(empty, hi, last).astype(jnp.int32))


def pair_mask(q_offsets, kv_offsets, tq, tk, causal=False, window=None, block=None):
    """[Tq, Tk] bool: query i may attend key j (module docstring semantics)."""
    qs, qp = segment_layout(q_offsets, tq)
    ks, kp = key_layout(kv_offsets, tk)
    return layout_mask(qs, qp, ks, kp, causal=causal, window=window, block=block)


def map_query_chunks(fn, q_side, chunk):
    """Apply fn to query chunks of `q_side` (a tuple of arrays with leading dim Tq).

    fn(*chunk_arrays) -> [C, ...]. The body is rematerialised in the backward
    pass, so memory stays O(C * Tk) instead of O(Tq * Tk). Returns [Tq, ...].
    """
    tq = q_side[0].shape[0]
    n = -(-tq // chunk)
    pad = n * chunk - tq

    def split(x):
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
        return x.reshape((n, chunk) + x.shape[1:])

    out = jax.lax.map(lambda xs: jax.checkpoint(fn)(*xs), tuple(split(x) for x in q_side))
    return out.reshape((n * chunk,) + out.shape[2:])[:tq]


def chunked_reference(q, k, v, q_offsets, kv_offsets, combine, *, causal=False, window=None,
                      chunk=None):
    """Query-chunked jagged attention in float32: q [Tq,H,D], k/v [Tk,H,D] -> [Tq,H,D] f32.

    combine(s [H,C,Tk] f32 raw scores, m [C,Tk] bool mask, v [Tk,H,D] f32) -> [C,H,D]
    is the op (GDPA's activation, or a softmax); chunks are rematerialised in the
    backward pass, so memory stays O(C * Tk).
    """
    tq, h, _ = q.shape
    tk = k.shape[0]
    qs, qp = segment_layout(q_offsets, tq)
    ks, kp = key_layout(kv_offsets, tk)
    kf, vf = k.astype(jnp.float32), v.astype(jnp.float32)

    def block(qc, qsc, qpc):
        m = layout_mask(qsc, qpc, ks, kp, causal=causal, window=window)
        return combine(jnp.einsum("qhd,khd->hqk", qc.astype(jnp.float32), kf), m, vf)

    return map_query_chunks(block, (q, qs, qp), chunk or query_chunk_size(tq, tk, h))


def query_chunk_size(tq, tk, h, budget=1 << 21):
    """Query rows per chunk so one [H, C, Tk] f32 score block holds <= budget (2M) elements."""
    c = max(16, budget // max(1, tk * h))
    c = 1 << (c.bit_length() - 1)  # power of two: few distinct shapes
    return max(1, min(c, tq))


def rope(x, positions, theta):
    """Rotary embedding, rotate-half convention (GPT-NeoX / Llama).

    x [T,H,D] (D even), positions [T] int -> [T,H,D] float32:
      freq_i = theta ** (-2 i / D), i < D/2;  a = pos * freq_i
      out[:, :, :D/2] = x1 cos a - x2 sin a;  out[:, :, D/2:] = x2 cos a + x1 sin a
    with x1 = x[..., :D/2], x2 = x[..., D/2:].
    """
    cos, sin = rope_tables(positions, x.shape[-1], theta)
    x = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def _split(x, bits):
    """float64 numpy x -> (hi, lo) float32 with hi keeping `bits` significant bits."""
    x = np.asarray(x, np.float64)
    e = np.floor(np.log2(np.where(x == 0, 1.0, np.abs(x)))) + 1 - bits
    hi = np.round(x / 2.0 ** e) * 2.0 ** e
    return hi.astype(np.float32), (x - hi).astype(np.float32)


def rope_freq_parts(d, theta):
    """Split RoPE frequencies and 2*pi for `rope_angle`: ((f1, f2, f3) [D/2] f32, (c1, c2, c3)).

    freq_i = theta ** (-2 i / D) = f1 + f2 + f3 with f1, f2 of 8 significant bits, so
    products with integer positions < 2^16 are exact in float32; likewise
    2*pi = c1 + c2 + c3 (python floats holding float32 values).
    """
    half = d // 2
    freq = float(theta) ** (-np.arange(half) * 2.0 / d)
    f1, _ = _split(freq, 8)
    f2, f3 = _split(freq - f1.astype(np.float64), 8)
    c1, _ = _split(2 * np.pi, 8)
    c2, c3 = _split(2 * np.pi - np.float64(c1), 8)
    return (f1, f2, f3), (float(c1), float(c2), float(c3))


def rope_angle(p, f1, f2, f3, cs):
    """Angle pos * freq reduced to about [-pi, pi] (Cody-Waite), float32.

    p [..., 1] float32 integer-valued positions, f1/f2/f3 [1, D/2] from
    rope_freq_parts, cs = its (c1, c2, c3). Written with ops the Pallas Triton
    lowering has (floor, not round), so kernels share it.
    """
    c1, c2, c3 = (np.float32(c) for c in cs)
    a1, a2 = p * f1, p * f2                                 # exact for pos < 2^16
    n = jnp.floor((a1 + a2) * np.float32(1 / (2 * np.pi)) + np.float32(0.5))
    return (((a1 - n * c1) - n * c2) + a2) - n * c3 + p * f3


def rope_tables(positions, d, theta):
    """(cos, sin) [T, D/2] float32 for `rope`, accurate to ~1e-7 for positions < 2^16.

    angle = pos * freq is formed without float32 rounding blow-up: freq and 2*pi are
    split into short-mantissa parts (products with integer positions are exact) and
    the angle is reduced to [-pi, pi] before cos/sin (Cody-Waite).
    """
    (f1, f2, f3), cs = rope_freq_parts(d, theta)
    p = positions.astype(jnp.float32)[:, None]
    r = rope_angle(p, f1[None, :], f2[None, :], f3[None, :], cs)
    return jnp.cos(r), jnp.sin(r)


IMPLS = (None, "reference", "pallas")


def pow2_at_least(n, lo):
    """n is a power of two >= lo (Triton block shapes must be powers of two)."""
    return n >= lo and n & (n - 1) == 0


# Largest padded head dim (block_attention: per RoPE half) the kernels run at.
MAX_PADDED = {"gdpa": 128, "jagged_attention": 128, "block_attention": 64}
# Smallest padded size: the smallest run on a GPU so far (head dim 32 in the teacher
# ablation; block_attention halves of 16).
MIN_PADDED = {"gdpa": 32, "jagged_attention": 32, "block_attention": 16}


def padded_head_dim(op, head_dim):
    """Head dim the Pallas kernels run `op` at, or None when they cannot.

    A power of two >= 16 runs as is (block_attention: each RoPE half D/2); other
    sizes are zero-padded to the next power of two, at least MIN_PADDED[op] and at
    most MAX_PADDED[op] (block_attention pads each half: [x1 | 0 | x2 | 0]). Zero
    lanes change no dot product, so only the cost grows.
    """
    if op == "block_attention":
        if head_dim % 2:
            return None
        half = _padded(head_dim // 2, MIN_PADDED[op], MAX_PADDED[op])
        return None if half is None else 2 * half
    return _padded(head_dim, MIN_PADDED[op], MAX_PADDED[op])


def _padded(d, lo, hi):
    if pow2_at_least(d, 16):
        return d
    p = max(lo, 1 << max(d - 1, 0).bit_length())
    return p if p <= hi else None


def pad_head_dim(x, to):
    """[T, H, D] -> [T, H, to]: zero lanes appended."""
    return x if x.shape[-1] == to else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, to - x.shape[-1])])


def with_padded_head_dim(op, q, k, v, call):
    """call(q, k, v) at the head dim the kernels run `op` at (`padded_head_dim`; zero
    lanes appended), its [..., D] output sliced back to the real D."""
    d = q.shape[-1]
    dp = padded_head_dim(op, d)
    if dp is None or dp == d:
        return call(q, k, v)
    return call(*(pad_head_dim(x, dp) for x in (q, k, v)))[..., :d]


def pad_halves(x, to):
    """[T, H, D] -> [T, H, to] as [x1 | 0 | x2 | 0], x1 / x2 the RoPE halves of x."""
    d = x.shape[-1]
    if d == to:
        return x
    h, ht = d // 2, to // 2
    return jnp.concatenate([pad_head_dim(x[..., :h], ht), pad_head_dim(x[..., h:], ht)], axis=-1)


def default_impl(op, head_dim, backend=None):
    """impl=None's choice for `op`: "pallas" on GPU when the Triton kernels take the head
    dim, padded if need be (`padded_head_dim`), else "reference". backend: default
    jax.default_backend()."""
    gpu = (backend or jax.default_backend()) == "gpu"
    return "pallas" if gpu and padded_head_dim(op, head_dim) is not None else "reference"


def check_impl(op, impl, extra=()):
    """ValueError unless impl is one of IMPLS or of the op's own `extra` impls."""
    if impl not in IMPLS + tuple(extra):
        raise ValueError(f"{op}: impl must be one of {IMPLS + tuple(extra)}, got {impl!r}")


def check_attention_inputs(op, q, k, v, q_offsets, kv_offsets):
    """Shape/dtype checks at the public boundary; ValueError names the bad input."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if getattr(x, "ndim", None) != 3:
            raise ValueError(f"{op}: {name} must be [T,H,D], got shape {getattr(x, 'shape', None)}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{op}: {name} must be floating point, got {x.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"{op}: k {k.shape} and v {v.shape} must have the same shape [Tk,H,D]")
    if q.shape[1:] != k.shape[1:]:
        raise ValueError(f"{op}: q {q.shape} and k {k.shape} must agree on [H,D]")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{op}: q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    for name, o in (("q_offsets", q_offsets), ("kv_offsets", kv_offsets)):
        if getattr(o, "ndim", None) != 1 or o.shape[0] < 1:
            raise ValueError(f"{op}: {name} must be [B+1], got shape {getattr(o, 'shape', None)}")
        if not jnp.issubdtype(o.dtype, jnp.integer):
            raise ValueError(f"{op}: {name} must be integer (int32), got {o.dtype}")
    if q_offsets.shape != kv_offsets.shape:
        raise ValueError(f"{op}: q_offsets {q_offsets.shape} and kv_offsets {kv_offsets.shape} "
                         "must describe the same number of samples B")


def check_mask_args(op, causal, window):
    if not isinstance(causal, bool):
        raise ValueError(f"{op}: causal must be a bool, got {causal!r}")
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"{op}: window must be None or an int >= 1, got {window!r}")


def config_part(config, part):
    """The `part` dataclass (a spec or a tuning) of a config that holds its fields (an
    engine's config subclasses both): part(**those fields of config)."""
    return part(**{f.name: getattr(config, f.name) for f in dataclasses.fields(part)})


class SpecTuningParts:
    """Mixin of an engine's config, a dataclass subclassing an op's spec record (class
    attribute SPEC) and a tuning record (TUNING): cfg.spec and cfg.tuning give the two."""

    SPEC: type
    TUNING: type

    @property
    def spec(self):
        """The spec part (SPEC's fields)."""
        return config_part(self, type(self).SPEC)

    @property
    def tuning(self):
        """The tuning part (TUNING's fields)."""
        return config_part(self, type(self).TUNING)
