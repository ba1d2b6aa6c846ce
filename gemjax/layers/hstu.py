"""HSTU blocks over packed jagged tokens: pointwise-SiLU attention with gated outputs.

    HSTUEncoder(dim, num_layers=, num_heads=)   x [T, dim], Jagged, dropout key -> [T, dim]

One block (pre-norm, residual; H heads, per-head widths dqk for Q / K and dv for U / V):

    U, V, Q, K = split(SiLU(LN(x) W_1 + b_1))        [T, H*dv] x 2, [T, H*dqk] x 2
    A(X)V      = kernels.gdpa(Q, K, V, activation="silu", causal)   per sample:
                 sum_{j <= i} SiLU(q_i . k_j) * scale * v_j
    y          = x + dropout(LN(A(X)V) * U) W_2 + b_2

Position enters through RoPE on Q and K (the token's index in its sample; with an odd
dqk the last channel is left unrotated), so the attention stays the jagged GDPA kernel
(no additive bias). `scale` is a constant (HSTU divides by the maximum sequence length):
a token's output never depends on how many tokens follow it. Padding rows (past
offsets[-1]) are 0 after every block; samples never see each other; empty samples hold
no rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from gemjax.data.jagged import Jagged
from gemjax.layers.attention import rope
from gemjax.layers.axes import layer_norm, linear
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


class HSTUBlock(nnx.Module):
    """One HSTU block (module docstring): x [T, dim], Jagged -> [T, dim].

    Args: dim (token width), num_heads, qk_dim / v_dim (per-head widths; None:
    dim // num_heads), scale (the GDPA output scale), dropout (rate on the gated
    attention output, applied when a key is given), rope, dtype (compute; params float32).
    """

    def __init__(self, dim: int, *, num_heads: int, qk_dim: int | None = None,
                 v_dim: int | None = None, scale: float = 1.0, dropout: float = 0.0,
                 rope: bool = True, dtype=jnp.float32, rngs: nnx.Rngs):
        if num_heads <= 0:
            raise ValueError(f"HSTUBlock: num_heads must be > 0, got {num_heads}")
        qk_dim = dim // num_heads if qk_dim is None else qk_dim
        v_dim = dim // num_heads if v_dim is None else v_dim
        if qk_dim <= 0 or v_dim <= 0:
            raise ValueError(f"HSTUBlock: per-head widths must be > 0, got qk_dim={qk_dim}, "
                             f"v_dim={v_dim} (dim={dim}, num_heads={num_heads})")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"HSTUBlock: dropout must be in [0, 1), got {dropout}")
        self.dim, self.num_heads, self.qk_dim, self.v_dim = dim, num_heads, qk_dim, v_dim
        self.scale, self.dropout, self.rope, self.dtype = scale, dropout, rope, dtype
        self.norm = layer_norm(dim, dtype=dtype, rngs=rngs)
        self.uvqk = linear(dim, num_heads * (2 * v_dim + 2 * qk_dim), names=("embed", "mlp"),
                           dtype=dtype, rngs=rngs)
        self.attn_norm = layer_norm(num_heads * v_dim, dtype=dtype, rngs=rngs)
        self.out_proj = linear(num_heads * v_dim, dim, names=("mlp", "embed"), dtype=dtype,
                               rngs=rngs)

    def __call__(self, x: jax.Array, jagged: Jagged, key: jax.Array | None = None) -> jax.Array:
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
        q, k, v = (tag(a, "attn.qkv") for a in (q, k, v))
        off = jnp.asarray(jagged.offsets, jnp.int32)
        if self.qk_dim != self.v_dim:      # the kernel takes one head width: pad the narrower
            d = max(self.qk_dim, self.v_dim)
            pad = lambda a: jnp.pad(a, ((0, 0), (0, 0), (0, d - a.shape[-1])))
            o = gdpa(pad(q), pad(k), pad(v), off, off, activation="silu", scale=self.scale,
                     causal=True)[..., :self.v_dim]
        else:
            o = gdpa(q, k, v, off, off, activation="silu", scale=self.scale, causal=True)
        o = tag(o, "attn.out").reshape(t, hv).astype(self.dtype)
        g = self.attn_norm(o) * u
        if key is not None and self.dropout > 0:
            keep = jax.random.bernoulli(key, 1.0 - self.dropout, g.shape)
            g = jnp.where(keep, g / (1.0 - self.dropout), 0).astype(g.dtype)
        y = x + self.out_proj(g)
        return jnp.where(jagged.mask[:, None], y, 0).astype(self.dtype)


class HSTUEncoder(nnx.Module):
    """num_layers HSTUBlocks, then (final_norm) a LayerNorm: x [T, dim] -> [T, dim].

    key: dropout key (block i uses fold_in(key, i)); None: no dropout (eval). Other
    arguments as HSTUBlock. Padding rows of the output are 0.
    """

    def __init__(self, dim: int, *, num_layers: int, num_heads: int, qk_dim: int | None = None,
                 v_dim: int | None = None, scale: float = 1.0, dropout: float = 0.0,
                 rope: bool = True, final_norm: bool = False, dtype=jnp.float32,
                 rngs: nnx.Rngs):
        if num_layers < 1:
            raise ValueError(f"HSTUEncoder: num_layers must be >= 1, got {num_layers}")
        self.dim, self.dtype = dim, dtype
        self.blocks = nnx.List([
            HSTUBlock(dim, num_heads=num_heads, qk_dim=qk_dim, v_dim=v_dim, scale=scale,
                      dropout=dropout, rope=rope, dtype=dtype, rngs=rngs)
            for _ in range(num_layers)])
        self.out_norm = layer_norm(dim, dtype=dtype, rngs=rngs) if final_norm else None

    def __call__(self, x: jax.Array, jagged: Jagged, key: jax.Array | None = None) -> jax.Array:
        if x.ndim != 2 or x.shape != (jagged.capacity, self.dim):
            raise ValueError(f"HSTUEncoder: x must be [T={jagged.capacity}, dim={self.dim}], "
                             f"got {x.shape}")
        mask = jagged.mask[:, None]
        x = jnp.where(mask, x.astype(self.dtype), 0)
        for i, blk in enumerate(self.blocks):
            x = blk(x, jagged, None if key is None else jax.random.fold_in(key, i))
        if self.out_norm is not None:
            x = jnp.where(mask, self.out_norm(x), 0)
        return x.astype(self.dtype)
