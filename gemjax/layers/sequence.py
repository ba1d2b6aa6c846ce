"""Sequence encoder over packed jagged event tokens, and pooling helpers.

    SequenceEncoder(dim, num_layers, num_heads)   x [T, dim], Jagged -> [T, dim]
    last_tokens(x [T, d], jagged, k)              -> [B, k, d]
    mean_pool(x [T, d], jagged)                   -> [B, d]

Each block is pre-LN: h = x + Attn(LN(x)); h = h + FFN(LN(h)) (optionally
with dropout on the Attn and FFN outputs before each residual add), with the
attention from gemjax.layers.attention (kernels/ ops, never padded), and the
padding rows (past offsets[-1]) held at 0 after every block, so nothing a layer
does depends on the capacity T.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from gemjax.data.jagged import Jagged
from gemjax.layers.attention import JaggedSelfAttention
from gemjax.layers.axes import layer_norm
from gemjax.layers.mlp import MLP


def _check_x(x, jagged: Jagged, who: str) -> None:
    if x.ndim != 2 or x.shape[0] != jagged.capacity:
        raise ValueError(f"{who}: x must be [T={jagged.capacity}, d] (the jagged capacity), "
                         f"got shape {x.shape}")


def last_tokens(x: jax.Array, jagged: Jagged, k: int) -> jax.Array:
    """The k most recent tokens of each sample: x [T, d] -> [B, k, d].

    out[b, j] is the j-th most recent token of sample b (j = 0 is its last
    token); slots beyond a sample's length are 0.
    """
    _check_x(x, jagged, "last_tokens")
    if k <= 0:
        raise ValueError(f"last_tokens: k must be > 0, got {k}")
    off = jnp.asarray(jagged.offsets, jnp.int32)
    idx = off[1:, None] - 1 - jnp.arange(k, dtype=jnp.int32)[None, :]    # [B, k]
    valid = idx >= off[:-1, None]
    out = jnp.take(x, jnp.where(valid, idx, 0), axis=0)                # [B, k, d]
    return jnp.where(valid[..., None], out, 0).astype(x.dtype)


def mean_pool(x: jax.Array, jagged: Jagged) -> jax.Array:
    """Mean of each sample's tokens: x [T, d] -> [B, d] (0 for empty samples).

    Accumulates in float32, returns x.dtype.
    """
    _check_x(x, jagged, "mean_pool")
    b = jagged.num_samples
    seg = jnp.asarray(jagged.segment_ids)
    xm = jnp.where(jagged.mask[:, None], x.astype(jnp.float32), 0.0)
    s = jax.ops.segment_sum(xm, seg, num_segments=b + 1)[:b]
    n = jnp.maximum(jagged.lengths, 1).astype(jnp.float32)[:, None]
    return (s / n).astype(x.dtype)


class SequenceBlock(nnx.Module):
    """One pre-LN transformer block over jagged tokens: [T, dim] -> [T, dim]."""

    def __init__(self, dim: int, *, num_heads: int, ffn_mult: int = 2, dropout: float = 0.0,
                 ffn_activation: str = "gelu", use_bias: bool = True, dtype=jnp.float32,
                 norm_impl: str = "xla", rngs: nnx.Rngs, **attention_kw):
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"SequenceBlock: dropout must be in [0, 1), got {dropout}")
        self.attn_norm = layer_norm(dim, dtype=dtype, impl=norm_impl, rngs=rngs)
        self.attn = JaggedSelfAttention(dim, num_heads, use_bias=use_bias, dtype=dtype, rngs=rngs,
                                        **attention_kw)
        self.ffn_norm = layer_norm(dim, dtype=dtype, impl=norm_impl, rngs=rngs)
        self.ffn = MLP(dim, (ffn_mult * dim,), dim, activation=ffn_activation, use_bias=use_bias,
                       dtype=dtype, rngs=rngs)
        # Built only when used, so dropout=0 leaves the parameter tree and rng stream unchanged.
        self.dropout = nnx.Dropout(dropout, rngs=rngs) if dropout > 0 else None

    def _drop(self, y: jax.Array) -> jax.Array:
        return y if self.dropout is None else self.dropout(y)

    def __call__(self, x: jax.Array, jagged: Jagged) -> jax.Array:
        mask = jagged.mask[:, None]
        x = x + self._drop(self.attn(self.attn_norm(x), jagged))
        x = x + self._drop(self.ffn(self.ffn_norm(x)))
        return jnp.where(mask, x, 0).astype(x.dtype)


class SequenceEncoder(nnx.Module):
    """Stack of pre-LN attention blocks: x [T, dim] packed tokens -> [T, dim].

    Args:
      dim: token width.
      num_layers: blocks (>= 1).
      num_heads: attention heads (divides dim).
      attention: "softmax" | "gdpa" | "block" (see gemjax.layers.attention).
      gdpa_activation: GDPA's element-wise activation.
      causal, window: attention masking (not with "block").
      ffn_mult: FFN hidden width = ffn_mult * dim.
      ffn_activation: the FFN's activation (gemjax.layers.mlp.ACTIVATIONS).
      use_bias: biases on the attention projections and the FFN's Linears.
      rope, qk_norm, gdpa_scale, block: passed to JaggedSelfAttention.
      final_norm: LayerNorm on the output tokens.
      dropout: rate of the dropout on each block's attention and FFN outputs
        (before the residual adds); active only in train mode (model.train()).
        0 (default) builds no dropout module.
      dtype: compute dtype; params float32.
      norm_impl: the LayerNorms' implementation (gemjax.layers.axes.layer_norm: "xla",
        "pallas", "auto").

    Padding rows of the output are 0; samples never see each other.
    """

    def __init__(self, dim: int, *, num_layers: int, num_heads: int,
                 attention: str = "softmax", gdpa_activation: str = "silu",
                 causal: bool = False, window: int | None = None, ffn_mult: int = 2,
                 rope: bool = False, qk_norm: bool = False, gdpa_scale: float | None = None,
                 block: int = 64, final_norm: bool = True, dropout: float = 0.0,
                 ffn_activation: str = "gelu", use_bias: bool = True, dtype=jnp.float32,
                 norm_impl: str = "xla", rngs: nnx.Rngs):
        if num_layers < 1:
            raise ValueError(f"SequenceEncoder: num_layers must be >= 1, got {num_layers}")
        self.dim, self.dtype = dim, dtype
        self.blocks = nnx.List([
            SequenceBlock(dim, num_heads=num_heads, ffn_mult=ffn_mult, dropout=dropout,
                          ffn_activation=ffn_activation, use_bias=use_bias, dtype=dtype,
                          norm_impl=norm_impl, rngs=rngs, attention=attention,
                          gdpa_activation=gdpa_activation, gdpa_scale=gdpa_scale,
                          causal=causal, window=window, block=block,
                          rope=rope, qk_norm=qk_norm)
            for _ in range(num_layers)])
        self.out_norm = (layer_norm(dim, dtype=dtype, impl=norm_impl, rngs=rngs)
                         if final_norm else None)

    def __call__(self, x: jax.Array, jagged: Jagged) -> jax.Array:
        _check_x(x, jagged, "SequenceEncoder")
        if x.shape[1] != self.dim:
            raise ValueError(f"SequenceEncoder: x width {x.shape[1]} != dim {self.dim}")
        mask = jagged.mask[:, None]
        x = jnp.where(mask, x.astype(self.dtype), 0)
        for blk in self.blocks:
            x = blk(x, jagged)
        if self.out_norm is not None:
            x = jnp.where(mask, self.out_norm(x), 0)
        return x.astype(self.dtype)
