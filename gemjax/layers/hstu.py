"""HSTU blocks over packed jagged tokens: pointwise-SiLU attention with gated outputs.

    HSTUEncoder(dim, num_layers=, num_heads=)   x [T, dim], Jagged, dropout key -> [T, dim]

One block (pre-norm, residual; H heads, per-head widths dqk for Q / K and dv for U / V):

    U, V, Q, K = split(SiLU(LN(x) W_1 + b_1))        [T, H*dv] x 2, [T, H*dqk] x 2
    A(X)V      = per sample: sum_{j <= i} SiLU(q_i . k_j + b_h(i, j)) * scale * v_j
    y          = x + dropout(LN(A(X)V) * U) W_2 + b_2

Position enters through RoPE on Q and K (rope=True: the token's index in its sample;
with an odd dqk the last channel is left unrotated) and / or a relative attention bias
b_h(i, j) (rel_bias, RelativeBias): a learned logit per head and distance i - j
("position"), plus one per head and log-bucketed time gap t_i - t_j ("position+time",
per-token timestamps given to the call). Without a bias (rel_bias="none", b = 0) the
attention is the jagged GDPA kernel (kernels.gdpa, which takes no additive bias); with
one it is computed densely over the samples padded to [B, max_len] (dense_hstu_attention;
cheap for short histories, ~200 events). `scale` is a constant (HSTU divides by the
maximum sequence length): a token's output never depends on how many tokens follow it.
Padding rows (past offsets[-1]) are 0 after every block; samples never see each other;
empty samples hold no rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from gemjax.data.jagged import Jagged
from gemjax.layers.attention import rope
from gemjax.layers.axes import layer_norm, linear, param
from gemjax.layers.regions import tag
from kernels import gdpa


def rope_even(x: jax.Array, positions: jax.Array, theta: float = 10_000.0) -> jax.Array:
    """RoPE on the first 2 * (D // 2) channels of x [T, H, D]; an odd last channel is
    passed through. positions [T] int -> [T, H, D] in x.dtype."""
    d = x.shape[-1] - x.shape[-1] % 2
    if d == 0:
        return x
    rot = rope(x[..., :d], positions, theta)
    return rot if d == x.shape[-1] else jnp.concatenate([rot, x[..., d:]], axis=-1)


REL_BIAS = ("none", "position", "position+time")
TIME_BUCKET_WIDTH = 0.301     # log-bucket width: bucket = floor(ln(max(|dt|, 1)) / 0.301)


def time_bucket(dt: jax.Array, num_buckets: int) -> jax.Array:
    """Log bucket of a time gap: floor(ln(max(|dt|, 1)) / TIME_BUCKET_WIDTH) clipped to
    [0, num_buckets - 1]; dt any shape, int or float -> int32 of its shape (gaps of 0
    and 1 share bucket 0; about 3.3 buckets per factor e)."""
    g = jnp.maximum(jnp.abs(dt.astype(jnp.float32)), 1.0)
    b = jnp.floor(jnp.log(g) / TIME_BUCKET_WIDTH).astype(jnp.int32)
    return jnp.clip(b, 0, num_buckets - 1)


class RelativeBias(nnx.Module):
    """Learned additive attention-logit bias per head: b_h(i, j) = w_pos[h, min(i - j,
    max_len - 1)] (+ w_time[h, time_bucket(t_i - t_j)] when time_buckets > 0) for a query
    at position i and a key at j <= i of one sample (i - j < 0 uses distance 0; the causal
    mask drops those pairs). Parameters: w_pos [H, max_len], w_time [H, time_buckets],
    initialised N(0, 0.02^2).

    __call__(length L, times [B, L] or None) -> [1 or B, H, L, L] float32, indexed by the
    samples padded to L positions (row i: query position i, column j: key position j).
    """

    def __init__(self, num_heads: int, max_len: int, *, time_buckets: int = 0,
                 rngs: nnx.Rngs):
        if max_len < 1:
            raise ValueError(f"RelativeBias: max_len must be >= 1, got {max_len}")
        if time_buckets < 0:
            raise ValueError(f"RelativeBias: time_buckets must be >= 0, got {time_buckets}")
        self.num_heads, self.max_len, self.time_buckets = num_heads, max_len, time_buckets
        self.w_pos = param(0.02 * jax.random.normal(rngs.params(), (num_heads, max_len)),
                           None, None)
        self.w_time = (param(0.02 * jax.random.normal(rngs.params(), (num_heads, time_buckets)),
                             None, None) if time_buckets else None)

    def __call__(self, length: int, times: jax.Array | None = None) -> jax.Array:
        i = jnp.arange(length)
        dist = jnp.clip(i[:, None] - i[None, :], 0, self.max_len - 1)           # [L, L]
        bias = jnp.take(self.w_pos[...], dist, axis=1)[None]                    # [1, H, L, L]
        if self.w_time is None:
            if times is not None:
                raise ValueError("RelativeBias: times given but time_buckets is 0")
            return bias
        if times is None or times.shape[-1] != length or times.ndim != 2:
            raise ValueError(f"RelativeBias: time_buckets > 0 needs times [B, L={length}], got "
                             f"{None if times is None else times.shape}")
        bucket = time_bucket(times[:, :, None] - times[:, None, :], self.time_buckets)  # [B, L, L]
        return bias + jnp.moveaxis(jnp.take(self.w_time[...], bucket, axis=1), 1, 0)


def padded_rows(jagged: Jagged, length: int) -> jax.Array:
    """[B, length] int32: token row of position p of sample b, or T (one past the last
    row) where p >= the sample's length; samples longer than `length` keep their first
    `length` tokens."""
    off = jnp.asarray(jagged.offsets, jnp.int32)
    p = jnp.arange(length, dtype=jnp.int32)[None, :]
    return jnp.where(p < (off[1:] - off[:-1])[:, None], off[:-1, None] + p, jagged.capacity)


def dense_hstu_attention(q: jax.Array, k: jax.Array, v: jax.Array, jagged: Jagged, *,
                         length: int, scale: float, bias: jax.Array | None = None) -> jax.Array:
    """Causal pointwise-SiLU attention of each sample's tokens, computed on the samples
    padded to `length` positions: q, k [T, H, dqk], v [T, H, dv], bias broadcastable to
    [B, H, length, length] (or None) -> [T, H, dv] in v.dtype, row i of sample b =
    sum_{j <= i} SiLU(q_i . k_j + bias[b, :, i, j]) * scale * v_j (logits in float32).
    Every sample must hold at most `length` tokens (later tokens get 0); padding rows 0.
    """
    t = jagged.capacity
    rows = padded_rows(jagged, length)                                        # [B, L]
    valid = rows < t
    pad = lambda a: jnp.concatenate([a, jnp.zeros((1,) + a.shape[1:], a.dtype)])[rows]
    qp, kp, vp = pad(q), pad(k), pad(v)                                       # [B, L, H, d]
    s = jnp.einsum("bihd,bjhd->bhij", qp, kp, preferred_element_type=jnp.float32)
    if bias is not None:
        s = s + bias
    keep = jnp.tril(jnp.ones((length, length), bool))[None, None] & valid[:, None, None, :]
    w = jnp.where(keep, jax.nn.silu(s) * scale, 0.0).astype(v.dtype)
    o = jnp.einsum("bhij,bjhd->bihd", w, vp, preferred_element_type=jnp.float32)
    b = jagged.num_samples
    seg = jnp.asarray(jagged.segment_ids, jnp.int32)
    pos = jnp.asarray(jagged.positions, jnp.int32)
    flat = jnp.clip(seg, 0, b - 1) * length + jnp.clip(pos, 0, length - 1)
    out = jnp.take(o.reshape(b * length, *o.shape[2:]), flat, axis=0)         # [T, H, dv]
    ok = (seg < b) & (pos < length)
    return jnp.where(ok[:, None, None], out, 0).astype(v.dtype)


class HSTUBlock(nnx.Module):
    """One HSTU block (module docstring): x [T, dim], Jagged -> [T, dim].

    Args: dim (token width), num_heads, qk_dim / v_dim (per-head widths; None:
    dim // num_heads), scale (the GDPA output scale), dropout (rate on the gated
    attention output, applied when a key is given), rope, rel_bias (one of REL_BIAS: the
    relative attention bias, a RelativeBias, with max_len >= every sample's length and
    time_buckets log-time buckets for "position+time"), dtype (compute; params float32).
    __call__(x, jagged, key=None, times=None): times [T] per-token timestamps (int or
    float, one unit throughout), needed with rel_bias="position+time" and refused otherwise.
    """

    def __init__(self, dim: int, *, num_heads: int, qk_dim: int | None = None,
                 v_dim: int | None = None, scale: float = 1.0, dropout: float = 0.0,
                 rope: bool = True, rel_bias: str = "none", max_len: int = 0,
                 time_buckets: int = 128, dtype=jnp.float32, rngs: nnx.Rngs):
        if num_heads <= 0:
            raise ValueError(f"HSTUBlock: num_heads must be > 0, got {num_heads}")
        qk_dim = dim // num_heads if qk_dim is None else qk_dim
        v_dim = dim // num_heads if v_dim is None else v_dim
        if qk_dim <= 0 or v_dim <= 0:
            raise ValueError(f"HSTUBlock: per-head widths must be > 0, got qk_dim={qk_dim}, "
                             f"v_dim={v_dim} (dim={dim}, num_heads={num_heads})")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"HSTUBlock: dropout must be in [0, 1), got {dropout}")
        if rel_bias not in REL_BIAS:
            raise ValueError(f"HSTUBlock: rel_bias must be one of {REL_BIAS}, got {rel_bias!r}")
        if rel_bias != "none" and max_len < 1:
            raise ValueError(f"HSTUBlock: rel_bias={rel_bias!r} needs max_len >= 1 (the longest "
                             f"sample), got {max_len}")
        self.dim, self.num_heads, self.qk_dim, self.v_dim = dim, num_heads, qk_dim, v_dim
        self.scale, self.dropout, self.rope, self.dtype = scale, dropout, rope, dtype
        self.max_len = max_len
        self.offload_tags = False       # True inside an offloaded block (layers.regions)
        self.rel_bias = (None if rel_bias == "none" else RelativeBias(
            num_heads, max_len, time_buckets=time_buckets if rel_bias == "position+time" else 0,
            rngs=rngs))
        self.norm = layer_norm(dim, dtype=dtype, rngs=rngs)
        self.uvqk = linear(dim, num_heads * (2 * v_dim + 2 * qk_dim), names=("embed", "mlp"),
                           dtype=dtype, rngs=rngs)
        self.attn_norm = layer_norm(num_heads * v_dim, dtype=dtype, rngs=rngs)
        self.out_proj = linear(num_heads * v_dim, dim, names=("mlp", "embed"), dtype=dtype,
                               rngs=rngs)

    def __call__(self, x: jax.Array, jagged: Jagged, key: jax.Array | None = None,
                 times: jax.Array | None = None) -> jax.Array:
        t, h = jagged.capacity, self.num_heads
        if x.shape != (t, self.dim):
            raise ValueError(f"HSTUBlock: x must be [T={t}, dim={self.dim}], got {x.shape}")
        x = x.astype(self.dtype)
        hv, hq = h * self.v_dim, h * self.qk_dim
        uvqk = jax.nn.silu(self.uvqk(self.norm(x)))
        u, v, q, k = jnp.split(uvqk, [hv, 2 * hv, 2 * hv + hq], axis=-1)
        q, k = q.reshape(t, h, self.qk_dim), k.reshape(t, h, self.qk_dim)
        v = v.reshape(t, h, self.v_dim)
        if self.rope:
            pos = jnp.asarray(jagged.positions, jnp.int32)
            q, k = rope_even(q, pos), rope_even(k, pos)
        q, k, v = (tag(a, "attn.qkv", self.offload_tags) for a in (q, k, v))
        off = jnp.asarray(jagged.offsets, jnp.int32)
        if times is not None and (self.rel_bias is None or self.rel_bias.w_time is None):
            raise ValueError("HSTUBlock: times given but rel_bias is not 'position+time'")
        if self.rel_bias is not None:
            tp = None
            if self.rel_bias.w_time is not None:
                if times is None or times.shape != (t,):
                    raise ValueError(f"HSTUBlock: rel_bias='position+time' needs times [T={t}], "
                                     f"got {None if times is None else times.shape}")
                tp = jnp.concatenate([times, jnp.zeros((1,), times.dtype)])[
                    padded_rows(jagged, self.max_len)]                        # [B, L]
            bias = self.rel_bias(self.max_len, tp)
            o = dense_hstu_attention(q, k, v, jagged, length=self.max_len, scale=self.scale,
                                     bias=bias)
        elif self.qk_dim != self.v_dim:      # the kernel takes one head width: pad the narrower
            d = max(self.qk_dim, self.v_dim)
            pad = lambda a: jnp.pad(a, ((0, 0), (0, 0), (0, d - a.shape[-1])))
            o = gdpa(pad(q), pad(k), pad(v), off, off, activation="silu", scale=self.scale,
                     causal=True)[..., :self.v_dim]
        else:
            o = gdpa(q, k, v, off, off, activation="silu", scale=self.scale, causal=True)
        o = tag(o, "attn.out", self.offload_tags).reshape(t, hv).astype(self.dtype)
        g = self.attn_norm(o) * u
        if key is not None and self.dropout > 0:
            keep = jax.random.bernoulli(key, 1.0 - self.dropout, g.shape)
            g = jnp.where(keep, g / (1.0 - self.dropout), 0).astype(g.dtype)
        y = x + self.out_proj(g)
        return jnp.where(jagged.mask[:, None], y, 0).astype(self.dtype)


class HSTUEncoder(nnx.Module):
    """num_layers HSTUBlocks, then (final_norm) a LayerNorm: x [T, dim] -> [T, dim].

    key: dropout key (block i uses fold_in(key, i)); None: no dropout (eval); times [T]
    or None: per-token timestamps for rel_bias="position+time". Other arguments as
    HSTUBlock (each block learns its own relative bias). Padding rows of the output are 0.
    """

    def __init__(self, dim: int, *, num_layers: int, num_heads: int, qk_dim: int | None = None,
                 v_dim: int | None = None, scale: float = 1.0, dropout: float = 0.0,
                 rope: bool = True, rel_bias: str = "none", max_len: int = 0,
                 time_buckets: int = 128, final_norm: bool = False, dtype=jnp.float32,
                 rngs: nnx.Rngs):
        if num_layers < 1:
            raise ValueError(f"HSTUEncoder: num_layers must be >= 1, got {num_layers}")
        self.dim, self.dtype = dim, dtype
        self.blocks = nnx.List([
            HSTUBlock(dim, num_heads=num_heads, qk_dim=qk_dim, v_dim=v_dim, scale=scale,
                      dropout=dropout, rope=rope, rel_bias=rel_bias, max_len=max_len,
                      time_buckets=time_buckets, dtype=dtype, rngs=rngs)
            for _ in range(num_layers)])
        self.out_norm = layer_norm(dim, dtype=dtype, rngs=rngs) if final_norm else None

    def __call__(self, x: jax.Array, jagged: Jagged, key: jax.Array | None = None,
                 times: jax.Array | None = None) -> jax.Array:
        if x.ndim != 2 or x.shape != (jagged.capacity, self.dim):
            raise ValueError(f"HSTUEncoder: x must be [T={jagged.capacity}, dim={self.dim}], "
                             f"got {x.shape}")
        mask = jagged.mask[:, None]
        x = jnp.where(mask, x.astype(self.dtype), 0)
        for i, blk in enumerate(self.blocks):
            x = blk(x, jagged, None if key is None else jax.random.fold_in(key, i), times)
        if self.out_norm is not None:
            x = jnp.where(mask, self.out_norm(x), 0)
        return x.astype(self.dtype)
