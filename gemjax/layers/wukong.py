"""Wukong: stacked factorization machines over non-sequence feature tokens.

One layer (Wukong paper, Zhang et al. 2024), X_i [B, n, d]:

    X_{i+1} = LN(concat(FMB(X_i), LCB(X_i)) + residual(X_i))        [B, f + l, d]
    FMB(X)  = reshape(MLP(LN(flatten(X @ (X^T @ Y)))))              [B, f, d]
    LCB(X)  = W_L @ X                                               [B, l, d]

with learnable Y [n, k] (the optimized FM: X^T Y is [d, k], so the cost is
O(n d k) instead of the O(n^2 d) pairwise dot products X X^T), W_L [l, n]
mixing along the token axis, LN over each token's d features, and the residual
the identity when n == f + l, else a learned projection W_R [f + l, n] along the
token axis. Either block may be switched off with f = 0 or l = 0 (ablations).

`Wukong` stacks `num_layers` layers: the first maps n -> f + l tokens, the rest
keep f + l.

Cross-layer attention (GEM's "cross-layer attention connections"; Meta did not
publish the details, this is our reading): before layer i >= 1, its input
attends over the outputs of all earlier layers, the input embeddings X_0
included, and the result is added as a residual:

    X_i <- X_i + MHA(Q = X_i, K = V = concat_tokens(X_0, X_1, ..., X_{i-1}))

so deep layers can reuse low-order interactions directly (a DenseNet-style
shortcut with learned, input-dependent weights).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from gemjax.layers.attention import TokenCrossAttention
from gemjax.layers.axes import layer_norm, param
from gemjax.layers.mlp import MLP


def _check_tokens(x, num_tokens: int, dim: int, who: str) -> None:
    if x.ndim != 3 or x.shape[1] != num_tokens or x.shape[2] != dim:
        raise ValueError(f"{who}: x must be [B, num_tokens={num_tokens}, dim={dim}], "
                         f"got shape {x.shape}")


class WukongLayer(nnx.Module):
    """x [B, num_tokens, dim] -> [B, fmb_tokens + lcb_tokens, dim].

    Args:
      num_tokens: n, input tokens.
      dim: d, token width (kept).
      fmb_tokens: f, tokens out of the factorization machine block (>= 0).
      lcb_tokens: l, tokens out of the linear compression block (>= 0).
      rank: k, columns of the FM projection Y [n, k].
      mlp_hidden: hidden widths of the FMB's MLP (n k -> ... -> f d).
      dtype: compute dtype; parameters are float32.
    """

    def __init__(self, num_tokens: int, dim: int, *, fmb_tokens: int, lcb_tokens: int,
                 rank: int, mlp_hidden: Sequence[int] = (), dtype=jnp.float32,
                 rngs: nnx.Rngs):
        if num_tokens <= 0 or dim <= 0:
            raise ValueError(f"WukongLayer: num_tokens={num_tokens} and dim={dim} must be > 0")
        if fmb_tokens < 0 or lcb_tokens < 0 or fmb_tokens + lcb_tokens == 0:
            raise ValueError(f"WukongLayer: fmb_tokens={fmb_tokens}, lcb_tokens={lcb_tokens} "
                             f"must be >= 0 with a positive sum")
        if fmb_tokens and rank <= 0:
            raise ValueError(f"WukongLayer: rank must be > 0, got {rank}")
        self.num_tokens, self.dim = int(num_tokens), int(dim)
        self.fmb_tokens, self.lcb_tokens, self.rank = int(fmb_tokens), int(lcb_tokens), int(rank)
        self.out_tokens = self.fmb_tokens + self.lcb_tokens
        self.dtype = dtype
        n, d, k = self.num_tokens, self.dim, self.rank
        if self.fmb_tokens:
            self.fm_proj = param(jax.random.normal(rngs.params(), (n, k)) * n ** -0.5, None, None)
            self.fmb_norm = layer_norm(n * k, dtype=dtype, rngs=rngs)
            self.fmb_mlp = MLP(n * k, tuple(mlp_hidden), self.fmb_tokens * d,
                               activation="relu", dtype=dtype, rngs=rngs)
        else:
            self.fm_proj = self.fmb_norm = self.fmb_mlp = None
        if self.lcb_tokens:
            self.lcb_weight = param(
                jax.random.normal(rngs.params(), (self.lcb_tokens, n)) * n ** -0.5, None, None)
        else:
            self.lcb_weight = None
        if self.out_tokens != n:
            self.residual_proj = param(
                jax.random.normal(rngs.params(), (self.out_tokens, n)) * n ** -0.5, None, None)
        else:
            self.residual_proj = None
        self.out_norm = layer_norm(d, dtype=dtype, rngs=rngs)

    def fmb(self, x: jax.Array) -> jax.Array:
        """Factorization machine block: x [B, n, d] -> [B, f, d]."""
        b = x.shape[0]
        y = self.fm_proj[...].astype(self.dtype)
        xty = jnp.einsum("bnd,nk->bdk", x, y)                   # X^T Y   [B, d, k]
        inter = jnp.einsum("bnd,bdk->bnk", x, xty)              # X X^T Y [B, n, k]
        h = self.fmb_norm(inter.reshape(b, self.num_tokens * self.rank))
        return self.fmb_mlp(h).reshape(b, self.fmb_tokens, self.dim)

    def lcb(self, x: jax.Array) -> jax.Array:
        """Linear compression block: x [B, n, d] -> [B, l, d]."""
        return jnp.einsum("ln,bnd->bld", self.lcb_weight[...].astype(self.dtype), x)

    def residual(self, x: jax.Array) -> jax.Array:
        """x [B, n, d] -> [B, f + l, d]: identity, or W_R along the token axis."""
        if self.residual_proj is None:
            return x
        return jnp.einsum("mn,bnd->bmd", self.residual_proj[...].astype(self.dtype), x)

    def __call__(self, x: jax.Array) -> jax.Array:
        _check_tokens(x, self.num_tokens, self.dim, "WukongLayer")
        x = x.astype(self.dtype)
        parts = []
        if self.fmb_tokens:
            parts.append(self.fmb(x))
        if self.lcb_tokens:
            parts.append(self.lcb(x))
        h = jnp.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]
        return self.out_norm(h + self.residual(x))


class Wukong(nnx.Module):
    """A stack of WukongLayers: x [B, num_tokens, dim] -> [B, out_tokens, dim].

    out_tokens = fmb_tokens + lcb_tokens. Arguments as WukongLayer, plus
    num_layers (>= 1), cross_layer_attention (see the module docstring) with
    cross_layer_heads heads (dividing dim).
    """

    def __init__(self, num_tokens: int, dim: int, *, num_layers: int, fmb_tokens: int,
                 lcb_tokens: int, rank: int, mlp_hidden: Sequence[int] = (),
                 cross_layer_attention: bool = False, cross_layer_heads: int = 1,
                 dtype=jnp.float32, rngs: nnx.Rngs):
        if num_layers < 1:
            raise ValueError(f"Wukong: num_layers must be >= 1, got {num_layers}")
        self.num_tokens, self.dim = int(num_tokens), int(dim)
        self.out_tokens = int(fmb_tokens) + int(lcb_tokens)
        self.dtype = dtype
        layers = []
        n = self.num_tokens
        for _ in range(num_layers):
            layers.append(WukongLayer(n, dim, fmb_tokens=fmb_tokens, lcb_tokens=lcb_tokens,
                                      rank=rank, mlp_hidden=mlp_hidden, dtype=dtype, rngs=rngs))
            n = self.out_tokens
        self.layers = nnx.List(layers)
        self.cross_layer = nnx.List(
            [TokenCrossAttention(dim, cross_layer_heads, dtype=dtype, rngs=rngs)
             for _ in range(num_layers - 1)] if cross_layer_attention else [])

    def __call__(self, x: jax.Array) -> jax.Array:
        _check_tokens(x, self.num_tokens, self.dim, "Wukong")
        x = x.astype(self.dtype)
        history = [x]
        for i, layer in enumerate(self.layers):
            if i and len(self.cross_layer):
                x = x + self.cross_layer[i - 1](x, jnp.concatenate(history, axis=1))
            x = layer(x)
            history.append(x)
        return x
