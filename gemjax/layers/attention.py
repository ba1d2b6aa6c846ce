"""Multi-head self-attention over packed jagged tokens, through the kernels/ ops.

    JaggedSelfAttention(dim, num_heads, attention=...)  x [T, dim], Jagged -> [T, dim]

Kinds:
  "softmax"  kernels.jagged_attention (optionally causal / sliding `window`)
  "gdpa"     kernels.gdpa: out = act(Q K^T) * scale @ V (HSTU-style, no softmax)
  "block"    kernels.block_attention: softmax attention inside independent
             `block`-token blocks of each sample (GEM's BlockAttention), RoPE
             fused in the op.

Options: RoPE on Q and K from the token positions within their sample
(`rope=True`; always on for "block"), QK-norm (RMSNorm of each head's q and k,
`qk_norm=True`). Tokens never see another sample's tokens; rows past
offsets[-1] come out as 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from gemjax.data.jagged import Jagged
from gemjax.layers.axes import linear, rms_norm
from gemjax.layers.regions import tag
from kernels import block_attention, gdpa, jagged_attention
from kernels.common import rope as _kernels_rope, segment_layout

ATTENTION_KINDS = ("softmax", "gdpa", "block")


def rope(x: jax.Array, positions: jax.Array, theta: float = 10_000.0) -> jax.Array:
    """Rotary position embedding (rotate-half, as kernels/ uses it).

    x [T, H, D] (D even), positions [T] int -> [T, H, D] in x.dtype.
    """
    if x.shape[-1] % 2:
        raise ValueError(f"rope: head dim must be even, got {x.shape[-1]}")
    return _kernels_rope(x, positions, theta).astype(x.dtype)


class JaggedSelfAttention(nnx.Module):
    """x [T, dim] packed tokens of `jagged` -> [T, dim]; padding rows -> 0.

    Args:
      dim: model width; num_heads must divide it.
      attention: one of ATTENTION_KINDS.
      gdpa_activation: element-wise activation for "gdpa".
      gdpa_scale: GDPA output scale; None = 1 / (length of the query's sample),
        a per-sample version of HSTU's 1 / max_len that is invariant to capacity.
      causal, window: masking for "softmax" and "gdpa".
      block: block size for "block".
      rope, rope_theta: rotary embedding of q, k by position in the sample.
      qk_norm: RMSNorm on each head's q and k (bounds GDPA inputs).
      dtype: compute dtype; params float32.
    """

    def __init__(self, dim: int, num_heads: int, *, attention: str = "softmax",
                 gdpa_activation: str = "silu", gdpa_scale: float | None = None,
                 causal: bool = False, window: int | None = None, block: int = 64,
                 rope: bool = False, rope_theta: float = 10_000.0, qk_norm: bool = False,
                 use_bias: bool = True, dtype=jnp.float32, rngs: nnx.Rngs):
        if attention not in ATTENTION_KINDS:
            raise ValueError(f"attention must be one of {ATTENTION_KINDS}, got {attention!r}")
        if num_heads <= 0 or dim % num_heads:
            raise ValueError(f"num_heads={num_heads} must divide dim={dim}")
        if window is not None and window <= 0:
            raise ValueError(f"window must be > 0 or None, got {window}")
        if attention == "block" and (causal or window is not None):
            raise ValueError("attention='block' takes neither causal nor window")
        self.dim, self.num_heads, self.head_dim = dim, num_heads, dim // num_heads
        self.attention, self.gdpa_activation, self.gdpa_scale = attention, gdpa_activation, gdpa_scale
        self.causal, self.window, self.block = causal, window, block
        self.rope, self.rope_theta = rope or attention == "block", rope_theta
        self.dtype = dtype
        self.offload_tags = False       # True inside an offloaded block (layers.regions)
        lin = lambda names: linear(dim, dim, names=names, use_bias=use_bias, dtype=dtype, rngs=rngs)
        self.q_proj, self.k_proj, self.v_proj = (lin(("embed", "mlp")) for _ in range(3))
        self.out_proj = lin(("mlp", "embed"))
        if qk_norm:
            self.q_norm = rms_norm(self.head_dim, dtype=dtype, rngs=rngs)
            self.k_norm = rms_norm(self.head_dim, dtype=dtype, rngs=rngs)
        else:
            self.q_norm = self.k_norm = None

    def __call__(self, x: jax.Array, jagged: Jagged) -> jax.Array:
        t = jagged.capacity
        if x.ndim != 2 or x.shape != (t, self.dim):
            raise ValueError(f"JaggedSelfAttention: x must be [T={t}, dim={self.dim}], got {x.shape}")
        x = x.astype(self.dtype)
        shape = (t, self.num_heads, self.head_dim)
        q, k, v = (p(x).reshape(shape) for p in (self.q_proj, self.k_proj, self.v_proj))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope and self.attention != "block":      # block_attention rotates itself
            q = rope(q, jagged.positions, self.rope_theta)
            k = rope(k, jagged.positions, self.rope_theta)
        q, k, v = (tag(a, "attn.qkv", self.offload_tags) for a in (q, k, v))
        off = jnp.asarray(jagged.offsets, jnp.int32)
        if self.attention == "softmax":
            o = jagged_attention(q, k, v, off, off, causal=self.causal, window=self.window)
        elif self.attention == "gdpa":
            scale = 1.0 if self.gdpa_scale is None else self.gdpa_scale
            o = gdpa(q, k, v, off, off, activation=self.gdpa_activation, scale=scale,
                     causal=self.causal, window=self.window)
            if self.gdpa_scale is None:
                seg = jnp.asarray(jagged.segment_ids)
                lens = jnp.concatenate([jagged.lengths, jnp.ones((1,), jnp.int32)])
                o = o * (1.0 / jnp.maximum(lens[seg], 1)).astype(o.dtype)[:, None, None]
        else:
            o = block_attention(q, k, v, off, block=self.block,
                                positions=jnp.asarray(jagged.positions, jnp.int32),
                                rope_theta=self.rope_theta)
        o = tag(o, "attn.out", self.offload_tags)
        out = self.out_proj(o.reshape(t, self.dim).astype(self.dtype))
        return jnp.where(jagged.mask[:, None], out, 0).astype(self.dtype)


class TokenCrossAttention(nnx.Module):
    """Dense multi-head softmax attention between fixed-size token sets.

    x [B, n, dim] queries, memory [B, m, dim] keys/values -> [B, n, dim] (the
    attention output after the out projection; the caller adds any residual).
    Used on short non-sequence token sets (Wukong cross-layer attention), where
    there is nothing jagged: jax.nn.dot_product_attention (cuDNN on GPU).
    """

    def __init__(self, dim: int, num_heads: int, *, dtype=jnp.float32, rngs: nnx.Rngs):
        if num_heads <= 0 or dim % num_heads:
            raise ValueError(f"TokenCrossAttention: num_heads={num_heads} must divide dim={dim}")
        self.dim, self.num_heads, self.head_dim, self.dtype = dim, num_heads, dim // num_heads, dtype
        lin = lambda names: linear(dim, dim, names=names, dtype=dtype, rngs=rngs)
        self.q_proj, self.k_proj, self.v_proj = (lin(("embed", "mlp")) for _ in range(3))
        self.out_proj = lin(("mlp", "embed"))

    def __call__(self, x: jax.Array, memory: jax.Array) -> jax.Array:
        if x.ndim != 3 or memory.ndim != 3 or x.shape[0] != memory.shape[0] or \
                x.shape[2] != self.dim or memory.shape[2] != self.dim:
            raise ValueError(f"TokenCrossAttention: x [B, n, {self.dim}] and memory "
                             f"[B, m, {self.dim}] expected, got {x.shape} and {memory.shape}")
        b, n, _ = x.shape
        m = memory.shape[1]
        x, memory = x.astype(self.dtype), memory.astype(self.dtype)
        q = self.q_proj(x).reshape(b, n, self.num_heads, self.head_dim)
        k = self.k_proj(memory).reshape(b, m, self.num_heads, self.head_dim)
        v = self.v_proj(memory).reshape(b, m, self.num_heads, self.head_dim)
        o = jax.nn.dot_product_attention(q, k, v)                       # [B, n, H, Dh]
        return self.out_proj(o.reshape(b, n, self.dim))


def uniform_offsets(batch: int, n: int) -> jax.Array:
    """Offsets [B+1] of B samples of exactly n tokens each (packed [B*n, ...])."""
    return jnp.arange(batch + 1, dtype=jnp.int32) * n


class JaggedCrossAttention(nnx.Module):
    """Multi-head attention from one jagged token set to another, through kernels/ ops.

    q_tokens [Tq, dim] (sample b's queries at q_offsets[b]:q_offsets[b+1]) attend to
    kv_tokens [Tk, kv_dim] of the same sample b -> [Tq, dim]; padding query rows
    and the queries of a sample with no keys give 0 (no bias leaks in).

    attention="gdpa": out = act(Q K^T) * scale @ V with scale = gdpa_scale, or
    (None) 1 / (number of keys in the sample); "softmax": jagged softmax attention.
    Used for PMA (learned queries over a sequence), CLS tokens over a sequence,
    and InterFormer's personalized FFN (sequence tokens over summary tokens).
    """

    def __init__(self, dim: int, num_heads: int, *, kv_dim: int | None = None,
                 attention: str = "gdpa", gdpa_activation: str = "silu",
                 gdpa_scale: float | None = None, qk_norm: bool = False, use_bias: bool = True,
                 dtype=jnp.float32, rngs: nnx.Rngs):
        if attention not in ("gdpa", "softmax"):
            raise ValueError(f"JaggedCrossAttention: attention must be 'gdpa' or 'softmax', "
                             f"got {attention!r}")
        if num_heads <= 0 or dim % num_heads:
            raise ValueError(f"JaggedCrossAttention: num_heads={num_heads} must divide dim={dim}")
        kv_dim = dim if kv_dim is None else kv_dim
        self.dim, self.kv_dim, self.num_heads, self.head_dim = dim, kv_dim, num_heads, dim // num_heads
        self.attention, self.gdpa_activation, self.gdpa_scale = attention, gdpa_activation, gdpa_scale
        self.dtype = dtype
        self.offload_tags = False       # True inside an offloaded block (layers.regions)
        b = dict(use_bias=use_bias, dtype=dtype, rngs=rngs)
        self.q_proj = linear(dim, dim, names=("embed", "mlp"), **b)
        self.k_proj = linear(kv_dim, dim, names=("embed", "mlp"), **b)
        self.v_proj = linear(kv_dim, dim, names=("embed", "mlp"), **b)
        self.out_proj = linear(dim, dim, names=("mlp", "embed"), **b)
        if qk_norm:
            self.q_norm = rms_norm(self.head_dim, dtype=dtype, rngs=rngs)
            self.k_norm = rms_norm(self.head_dim, dtype=dtype, rngs=rngs)
        else:
            self.q_norm = self.k_norm = None

    def __call__(self, q_tokens: jax.Array, q_offsets: jax.Array, kv_tokens: jax.Array,
                 kv_offsets: jax.Array) -> jax.Array:
        tq, tk = q_tokens.shape[0], kv_tokens.shape[0]
        if q_tokens.shape != (tq, self.dim) or kv_tokens.shape != (tk, self.kv_dim):
            raise ValueError(f"JaggedCrossAttention: q_tokens [Tq, {self.dim}] and kv_tokens "
                             f"[Tk, {self.kv_dim}] expected, got {q_tokens.shape}, {kv_tokens.shape}")
        if q_offsets.shape != kv_offsets.shape:
            raise ValueError(f"JaggedCrossAttention: q_offsets {q_offsets.shape} and kv_offsets "
                             f"{kv_offsets.shape} must both be [B+1]")
        q_offsets = jnp.asarray(q_offsets, jnp.int32)
        kv_offsets = jnp.asarray(kv_offsets, jnp.int32)
        h, dh = self.num_heads, self.head_dim
        q = self.q_proj(q_tokens.astype(self.dtype)).reshape(tq, h, dh)
        k = self.k_proj(kv_tokens.astype(self.dtype)).reshape(tk, h, dh)
        v = self.v_proj(kv_tokens.astype(self.dtype)).reshape(tk, h, dh)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (tag(a, "attn.qkv", self.offload_tags) for a in (q, k, v))
        seg, _ = segment_layout(q_offsets, tq)                        # padding -> B
        kv_len = jnp.concatenate([kv_offsets[1:] - kv_offsets[:-1], jnp.zeros((1,), jnp.int32)])
        n_keys = kv_len[seg]                                             # [Tq], 0 on padding
        if self.attention == "softmax":
            o = jagged_attention(q, k, v, q_offsets, kv_offsets)
        else:
            scale = 1.0 if self.gdpa_scale is None else self.gdpa_scale
            o = gdpa(q, k, v, q_offsets, kv_offsets, activation=self.gdpa_activation, scale=scale)
            if self.gdpa_scale is None:
                o = o * (1.0 / jnp.maximum(n_keys, 1)).astype(o.dtype)[:, None, None]
        o = tag(o, "attn.out", self.offload_tags)
        out = self.out_proj(o.reshape(tq, self.dim).astype(self.dtype))
        return jnp.where((n_keys > 0)[:, None], out, 0).astype(self.dtype)
