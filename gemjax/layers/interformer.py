"""InterFormer layers: cross-feature learning between non-sequence tokens and a
jagged event sequence (InterFormer, Zeng et al. 2024).

State carried from layer to layer, per device-local batch of B samples:
    x    [B, n, d]      non-sequence feature tokens
    seq  [T, d]         packed sequence tokens of `jagged` (padding rows 0)
    cls  [B, c, d]      CLS tokens (learned init), the sequence's running summary

One layer:
  Cross Arch      x_sum = Gating(MLP(flatten x))                      [B, m, d]
                  pma   = GDPA(Q = p learned queries, K/V = seq)       [B, p, d]
                  s_sum = Gating([cls | pma | r most recent seq tokens]) [B, c+p+r, d]
                  Gating(z) = z * sigmoid(Linear(z)), per token.
  then, in parallel (neither reads the other's output):
  Interaction     x'   = Wukong([x | s_sum]) -> n tokens (or a mixture of Wukong
                  experts, whose router losses come back in aux)
  Sequence Arch   seq' = seq + PFFN(LN seq), PFFN = GDPA cross-attention with
                         Q = sequence tokens, K/V = per-head projections of x_sum,
                         scale 1/m (the personalized FFN as attention)
                  seq' = seq' + SelfAttn(LN seq')   (full / sliding window /
                         64-token block with RoPE, via kernels/)
                  seq' = seq' + FFN(LN seq')
                  cls' = cls + SoftmaxAttn(Q = LN cls, K/V = seq)   (our reading of
                         CLS tokens: they summarise the sequence without being packed
                         into it, so the jagged layout never changes)

`InterFormer` stacks layers; its output is the final [x_sum | s_sum] tokens
([B, m + c + p + r, d]) for the task head, plus aux. Samples never see each
other; nothing depends on the capacity T.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from gemjax.data.jagged import Jagged
from gemjax.layers import regions
from gemjax.layers.attention import JaggedCrossAttention, JaggedSelfAttention, uniform_offsets
from gemjax.layers.axes import layer_norm, param
from gemjax.layers.experts import WukongExperts
from gemjax.layers.mlp import MLP
from gemjax.layers.sequence import last_tokens
from gemjax.layers.wukong import Wukong


class Gating(nnx.Module):
    """z [..., d] -> z * sigmoid(Linear(z)), the gate computed per token."""

    def __init__(self, dim: int, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.gate = MLP(dim, (), dim, dtype=dtype, rngs=rngs)

    def __call__(self, z: jax.Array) -> jax.Array:
        return z * jax.nn.sigmoid(self.gate(z))


def _pack_tokens(t: jax.Array) -> jax.Array:
    """[B, k, d] -> [B*k, d] packed jagged tokens (offsets uniform_offsets(B, k))."""
    return t.reshape(t.shape[0] * t.shape[1], t.shape[2])


class CrossArch(nnx.Module):
    """InterFormer's Cross Arch: the x_sum and s_sum summaries (module docstring)."""

    def __init__(self, num_tokens: int, dim: int, *, num_heads: int, summary_tokens: int,
                 cls_tokens: int, pma_tokens: int, recent_tokens: int,
                 mlp_hidden: Sequence[int] = (), qk_norm: bool = False,
                 gdpa_activation: str = "silu", dtype=jnp.float32, rngs: nnx.Rngs):
        n, d = int(num_tokens), int(dim)
        self.dim, self.dtype = d, dtype
        self.summary_tokens, self.cls_tokens = summary_tokens, cls_tokens
        self.pma_tokens, self.recent_tokens = pma_tokens, recent_tokens
        self.x_summary = MLP(n * d, tuple(mlp_hidden), summary_tokens * d, dtype=dtype, rngs=rngs)
        self.x_gate = Gating(d, dtype=dtype, rngs=rngs)
        if pma_tokens:
            self.seq_norm = layer_norm(d, dtype=dtype, rngs=rngs)
            self.pma_queries = param(jax.random.normal(rngs.params(), (pma_tokens, d)), None, "embed")
            self.pma = JaggedCrossAttention(d, num_heads, attention="gdpa", qk_norm=qk_norm,
                                            gdpa_activation=gdpa_activation, dtype=dtype, rngs=rngs)
        else:
            self.seq_norm = self.pma_queries = self.pma = None
        self.s_gate = Gating(d, dtype=dtype, rngs=rngs)

    def __call__(self, x, seq, cls, jagged: Jagged):
        """x [B, n, d], seq [T, d], cls [B, c, d] -> (x_sum [B, m, d], s_sum [B, c+p+r, d])."""
        b, d = x.shape[0], self.dim
        x_sum = self.x_gate(self.x_summary(x.reshape(b, -1)).reshape(b, self.summary_tokens, d))
        parts = []
        if self.cls_tokens:
            parts.append(cls)
        if self.pma_tokens:
            q = jnp.broadcast_to(self.pma_queries[...].astype(self.dtype), (b, self.pma_tokens, d))
            pma = self.pma(_pack_tokens(q), uniform_offsets(b, self.pma_tokens),
                           self.seq_norm(seq), jagged.offsets)
            parts.append(pma.reshape(b, self.pma_tokens, d))
        if self.recent_tokens:
            parts.append(last_tokens(seq, jagged, self.recent_tokens))
        s_sum = self.s_gate(jnp.concatenate(parts, axis=1).astype(self.dtype))
        return x_sum, s_sum

class InterFormerLayer(nnx.Module):
    """One InterFormer layer; see the module docstring.

    __call__(x [B, n, d], seq [T, d], cls [B, c, d], jagged) ->
        (x' [B, n, d], seq' [T, d], cls' [B, c, d], x_sum [B, m, d], s_sum [B, c+p+r, d], aux)

    Args:
      num_tokens: n; dim: d; num_heads: attention heads (divide d).
      summary_tokens: m, tokens in x_sum.
      cls_tokens, pma_tokens, recent_tokens: c, p, r (paper: 4, 2, 2; any may be 0
        except that c + p + r > 0).
      mlp_hidden: hidden widths of the x_sum MLP and Wukong's FMB MLP.
      wukong_layers, fmb_tokens, rank, cross_layer_attention: Interaction Arch
        Wukong (lcb_tokens = n - fmb_tokens so x keeps n tokens).
      num_experts, top_k, capacity_factor: > 0 experts makes the Interaction Arch
        a mixture of Wukong experts.
      seq_attention: "softmax" | "gdpa" | "block"; causal, window, block, rope,
        qk_norm, gdpa_activation: the sequence self-attention.
      dtype: compute dtype; params float32.
    """

    def __init__(self, num_tokens: int, dim: int, *, num_heads: int, summary_tokens: int = 4,
                 cls_tokens: int = 4, pma_tokens: int = 2, recent_tokens: int = 2,
                 mlp_hidden: Sequence[int] = (), wukong_layers: int = 1, fmb_tokens: int | None = None,
                 rank: int = 8, cross_layer_attention: bool = False, num_experts: int = 0,
                 top_k: int = 1, capacity_factor: float | None = None,
                 seq_attention: str = "softmax", causal: bool = False, window: int | None = None,
                 block: int = 64, rope: bool = False, qk_norm: bool = False,
                 gdpa_activation: str = "silu", ffn_mult: int = 2, ffn_activation: str = "gelu",
                 dtype=jnp.float32, rngs: nnx.Rngs):
        if min(cls_tokens, pma_tokens, recent_tokens) < 0 or \
                cls_tokens + pma_tokens + recent_tokens == 0:
            raise ValueError(f"InterFormerLayer: cls_tokens={cls_tokens}, pma_tokens={pma_tokens}, "
                             f"recent_tokens={recent_tokens} must be >= 0 with a positive sum")
        if summary_tokens <= 0:
            raise ValueError(f"InterFormerLayer: summary_tokens must be > 0, got {summary_tokens}")
        n, d = int(num_tokens), int(dim)
        self.num_tokens, self.dim, self.dtype = n, d, dtype
        self.remat_plan: tuple[tuple[str, str], ...] = ()   # regions.set_plan
        self.summary_tokens, self.cls_tokens = summary_tokens, cls_tokens
        self.pma_tokens, self.recent_tokens = pma_tokens, recent_tokens
        self.seq_summary_tokens = cls_tokens + pma_tokens + recent_tokens
        self.cross = CrossArch(n, d, num_heads=num_heads, summary_tokens=summary_tokens,
                               cls_tokens=cls_tokens, pma_tokens=pma_tokens,
                               recent_tokens=recent_tokens, mlp_hidden=mlp_hidden, qk_norm=qk_norm,
                               gdpa_activation=gdpa_activation, dtype=dtype, rngs=rngs)
        # Interaction Arch
        fmb = n // 2 if fmb_tokens is None else fmb_tokens
        wk = dict(num_layers=wukong_layers, fmb_tokens=fmb, lcb_tokens=n - fmb, rank=rank,
                  mlp_hidden=mlp_hidden, cross_layer_attention=cross_layer_attention,
                  cross_layer_heads=num_heads, dtype=dtype, rngs=rngs)
        n_in = n + self.seq_summary_tokens
        if num_experts:
            self.interaction = WukongExperts(n_in, d, num_experts=num_experts, top_k=top_k,
                                             capacity_factor=capacity_factor, **wk)
        else:
            self.interaction = Wukong(n_in, d, **wk)
        self.use_experts = bool(num_experts)
        # Sequence Arch
        self.pffn_norm = layer_norm(d, dtype=dtype, rngs=rngs)
        self.pffn = JaggedCrossAttention(d, num_heads, attention="gdpa", gdpa_scale=1.0 / summary_tokens,
                                         gdpa_activation=gdpa_activation, qk_norm=qk_norm,
                                         dtype=dtype, rngs=rngs)
        self.attn_norm = layer_norm(d, dtype=dtype, rngs=rngs)
        self.self_attn = JaggedSelfAttention(d, num_heads, attention=seq_attention, causal=causal,
                                             window=window, block=block, rope=rope, qk_norm=qk_norm,
                                             gdpa_activation=gdpa_activation, dtype=dtype, rngs=rngs)
        self.ffn_norm = layer_norm(d, dtype=dtype, rngs=rngs)
        self.ffn = MLP(d, (ffn_mult * d,), d, activation=ffn_activation, dtype=dtype, rngs=rngs)
        if cls_tokens:
            self.cls_norm = layer_norm(d, dtype=dtype, rngs=rngs)
            self.cls_attn = JaggedCrossAttention(d, num_heads, attention="softmax", qk_norm=qk_norm,
                                                 dtype=dtype, rngs=rngs)
        else:
            self.cls_norm = self.cls_attn = None

    def sequence_arch(self, seq, cls, x_sum, jagged: Jagged):
        """-> (seq' [T, d], cls' [B, c, d]). Checkpointing regions (layers.regions): the
        self-attention block is "attention", the blocks before and after it "seq"."""
        mask = jagged.mask[:, None]
        seq = regions.run(self.remat_plan, "seq", self._personalized_ffn, seq, x_sum, jagged.offsets)
        seq = regions.run(self.remat_plan, "attention", self._self_attention, seq, jagged)
        return regions.run(self.remat_plan, "seq", self._ffn_cls, seq, cls, mask, jagged.offsets)

    def _personalized_ffn(self, seq, x_sum, offsets):
        """seq [T, d] + PFFN(LN seq) with K/V from x_sum [B, m, d]."""
        b = x_sum.shape[0]
        return seq + self.pffn(self.pffn_norm(seq), offsets, _pack_tokens(x_sum),
                               uniform_offsets(b, self.summary_tokens))

    def _self_attention(self, seq, jagged: Jagged):
        """seq [T, d] + SelfAttn(LN seq)."""
        return seq + self.self_attn(self.attn_norm(seq), jagged)

    def _ffn_cls(self, seq, cls, mask, offsets):
        """seq [T, d] + FFN(LN seq) (0 on padding, mask [T, 1]) and the CLS update of cls
        [B, c, d] from it -> (seq' [T, d] in the layer dtype, cls')."""
        b = cls.shape[0]
        seq = jnp.where(mask, seq + self.ffn(self.ffn_norm(seq)), 0)
        if self.cls_tokens:
            upd = self.cls_attn(_pack_tokens(self.cls_norm(cls)), uniform_offsets(b, self.cls_tokens),
                                seq, offsets)
            cls = cls + upd.reshape(cls.shape)
        return seq.astype(self.dtype), cls

    def __call__(self, x: jax.Array, seq: jax.Array, cls: jax.Array, jagged: Jagged,
                 taps: dict | None = None):
        """-> (x' [B, n, d], seq' [T, d], cls' [B, c, d], x_sum [B, m, d], s_sum [B, c+p+r, d], aux).

        taps: None, or a dict this call fills with its arches' inputs (cast to the layer
        dtype): "x", "seq", "cls", "x_sum" (Sequence Arch input) and "tokens" [B, n_in, d]
        (Interaction Arch input).
        """
        b, n, d = x.shape
        if (n, d) != (self.num_tokens, self.dim):
            raise ValueError(f"InterFormerLayer: x must be [B, {self.num_tokens}, {self.dim}], got {x.shape}")
        if seq.shape != (jagged.capacity, d):
            raise ValueError(f"InterFormerLayer: seq must be [T={jagged.capacity}, {d}], got {seq.shape}")
        if jagged.num_samples != b or cls.shape != (b, self.cls_tokens, d):
            raise ValueError(f"InterFormerLayer: jagged has {jagged.num_samples} samples and cls is "
                             f"{cls.shape}; expected B={b} and cls [B, {self.cls_tokens}, {d}]")
        x, seq, cls = x.astype(self.dtype), seq.astype(self.dtype), cls.astype(self.dtype)
        x_sum, s_sum = regions.run(self.remat_plan, "cross", self.cross, x, seq, cls, jagged)
        tokens = jnp.concatenate([x, s_sum], axis=1)
        if taps is not None:
            taps.update(x=x, seq=seq, cls=cls, x_sum=x_sum, tokens=tokens)
        if self.use_experts:
            x_new, aux = regions.run(self.remat_plan, "interaction", self.interaction, tokens)
        else:
            x_new, aux = regions.run(self.remat_plan, "interaction", self.interaction, tokens), {}
        seq_new, cls_new = self.sequence_arch(seq, cls, x_sum, jagged)
        return x_new, seq_new, cls_new, x_sum, s_sum, aux


class InterFormer(nnx.Module):
    """A stack of InterFormerLayers.

    __call__(x [B, n, d], seq [T, d], jagged) -> (summary [B, m + c + p + r, d], aux)
    where summary = [x_sum | s_sum] recomputed by a final Cross Arch on the last
    layer's outputs (the input of InterFormer's task head), and aux holds the
    experts' router statistics (experts.py), each averaged over layers (empty
    without experts).
    Arguments: num_layers plus InterFormerLayer's.
    """

    def __init__(self, num_tokens: int, dim: int, *, num_layers: int, rngs: nnx.Rngs, **kw):
        if num_layers < 1:
            raise ValueError(f"InterFormer: num_layers must be >= 1, got {num_layers}")
        self.layers = nnx.List([InterFormerLayer(num_tokens, dim, rngs=rngs, **kw)
                                for _ in range(num_layers)])
        first = self.layers[0]
        cross_kw = {k: kw[k] for k in ("mlp_hidden", "qk_norm", "gdpa_activation", "dtype")
                    if k in kw}
        self.final_cross = CrossArch(num_tokens, dim, num_heads=kw["num_heads"],
                                     summary_tokens=first.summary_tokens,
                                     cls_tokens=first.cls_tokens, pma_tokens=first.pma_tokens,
                                     recent_tokens=first.recent_tokens, rngs=rngs, **cross_kw)
        self.cls_tokens, self.dim, self.dtype = first.cls_tokens, dim, first.dtype
        self.remat_plan: tuple[tuple[str, str], ...] = ()   # regions.set_plan
        self.out_tokens = first.summary_tokens + first.seq_summary_tokens
        self.cls_init = (param(0.02 * jax.random.normal(rngs.params(), (self.cls_tokens, dim)),
                               None, "embed") if self.cls_tokens else None)

    def __call__(self, x: jax.Array, seq: jax.Array, jagged: Jagged, taps: dict | None = None):
        """taps: None, or a dict this call fills with "layers" (one InterFormerLayer taps
        dict per layer) and "final" {"x", "seq", "cls"} (the final Cross Arch's inputs)."""
        b = x.shape[0]
        if self.cls_tokens:
            cls = jnp.broadcast_to(self.cls_init[...].astype(self.dtype), (b, self.cls_tokens, self.dim))
        else:
            cls = jnp.zeros((b, 0, self.dim), self.dtype)
        seq = jnp.where(jagged.mask[:, None], seq, 0)
        auxes = []
        layer_taps = None if taps is None else taps.setdefault("layers", [])
        for layer in self.layers:
            t = None if layer_taps is None else {}
            x, seq, cls, _, _, aux = layer(x, seq, cls, jagged, taps=t)
            auxes.append(aux)
            if t is not None:
                layer_taps.append(t)
        if taps is not None:
            taps["final"] = {"x": x, "seq": seq, "cls": cls}
        x_sum, s_sum = regions.run(self.remat_plan, "cross", self.final_cross, x, seq, cls, jagged)
        mean_aux = jax.tree.map(lambda *v: sum(v) / len(v), *auxes) if auxes[0] else {}
        return jnp.concatenate([x_sum, s_sum], axis=1), mean_aux
