"""Pyramid-parallel sequence encoding (our reading of GEM's one-line description).

Meta describes a "pyramid-parallel" stack of parallel interaction modules over
sequences of thousands of events without details. Our reading:

  level l:  tokens [T_l, d] of a jagged layout
            -> SequenceEncoder with block attention (each `block`-token run of a
               sample attends only within itself, RoPE)
            -> pool every block into `pooled` tokens: `pooled` learned queries
               attend (softmax) over the block's tokens (PMA per block). Where the
               attention kernels run in Pallas (GPU), one jagged_attention call over
               the packed buffer whose tile ranges skip other blocks' pairs; else
               block-locally in a padded [NB, block] layout: O(NB * pooled * block * d)
            -> tokens [T_{l+1}, d]: sample b now has ceil(L_b / block) * pooled
               tokens, in time order of its blocks
  the top level may skip pooling (pooled=None): encode only.

so attention cost per level is O(T_l * block) and T shrinks by block/pooled per
level. "Parallel": several behaviour sequences (clicks, views, ...) each get their
own pyramid, run side by side (independent, XLA may overlap them), and their top
tokens are concatenated per sample (with a learned per-sequence type embedding)
into one jagged sequence for the InterFormer sequence side.

Capacities stay static: T_{l+1} = NB * pooled with NB = ceil(T_l / block) + B
(each sample's last block may be partial) rounded up so that T_{l+1} is a multiple of
the attention kernels' row multiple (kernels.triton.PAD_MULTIPLE, 128): the kernels
then take every level's buffer, and the InterFormer's concatenation of the top
levels, as it is, with no padded copy in and sliced copy out around each call.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from gemjax.data.jagged import Jagged
from gemjax.layers.attention import JaggedCrossAttention
from gemjax.layers.axes import param
from gemjax.layers.sequence import SequenceEncoder
from kernels.common import default_impl, segment_layout
from kernels.jagged_attention.reference import masked_softmax_av
from kernels.triton.tuning import PAD_MULTIPLE


def jagged_from_offsets(values: jax.Array, offsets: jax.Array) -> Jagged:
    """A Jagged over values [T, ...] whose layout is given by offsets [B+1]; works under jit."""
    offsets = jnp.asarray(offsets, jnp.int32)
    seg, pos = segment_layout(offsets, values.shape[0])
    return Jagged(values, offsets, seg, pos)


def num_blocks(capacity: int, block: int, batch: int, pooled: int | None = None) -> int:
    """Static bound NB on the `block`-token runs of `batch` samples packed in `capacity`
    rows: ceil(capacity / block) + batch, rounded up (pooled given) so that NB * pooled
    is a multiple of PAD_MULTIPLE."""
    nb = -(-capacity // block) + batch
    if pooled is not None:
        step = PAD_MULTIPLE // math.gcd(pooled, PAD_MULTIPLE)
        nb += -nb % step
    return nb


def block_offsets(offsets: jax.Array, capacity: int, block: int,
                  pooled: int | None = None) -> jax.Array:
    """Offsets of the `block`-token runs of every sample; works under jit.

    offsets [B+1] -> [NB+1] int32, NB = num_blocks(capacity, block, B, pooled): each
    sample cut into runs of `block` tokens (its last run may be shorter), sample after
    sample; unused trailing entries repeat offsets[-1] (empty runs).
    """
    offsets = jnp.asarray(offsets, jnp.int32)
    b = offsets.shape[0] - 1
    nb = num_blocks(capacity, block, b, pooled)
    nblk = -(-(offsets[1:] - offsets[:-1]) // block)                       # [B]
    first = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(nblk).astype(jnp.int32)])
    j = jnp.arange(nb, dtype=jnp.int32)
    # unrolled: the default binary search lowers to a while loop stepped from the host
    owner = jnp.clip(jnp.searchsorted(first[1:], j, side="right", method="scan_unrolled"),
                     0, max(b - 1, 0))
    start = jnp.where(j < first[-1], offsets[owner] + (j - first[owner]) * block, offsets[-1])
    return jnp.concatenate([start, offsets[-1:]]).astype(jnp.int32)


def concat_jagged(parts: Sequence[tuple[jax.Array, Jagged]]) -> tuple[jax.Array, Jagged]:
    """Concatenate several jagged sequences of the same B samples, per sample.

    parts: [(x_i [T_i, d], jagged_i)] -> (x [sum T_i, d], jagged): sample b holds
    part 0's tokens of b, then part 1's, ...; padding rows 0. Works under jit.
    """
    if not parts:
        raise ValueError("concat_jagged: no parts")
    b = parts[0][1].num_samples
    for i, (x, j) in enumerate(parts):
        if j.num_samples != b or x.shape[0] != j.capacity:
            raise ValueError(f"concat_jagged: part {i} has {j.num_samples} samples (want {b}) and "
                             f"x {x.shape} for capacity {j.capacity}")
    cap = sum(j.capacity for _, j in parts)
    lengths = [j.lengths for _, j in parts]
    total = sum(lengths)
    offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(total).astype(jnp.int32)])
    out = jnp.zeros((cap,) + parts[0][0].shape[1:], parts[0][0].dtype)
    before = jnp.zeros((b,), jnp.int32)
    for (x, j), n in zip(parts, lengths):
        seg = jnp.asarray(j.segment_ids)
        valid = seg < b
        segc = jnp.where(valid, seg, 0)
        dest = jnp.where(valid, offsets[segc] + before[segc] + jnp.asarray(j.positions), cap)
        out = out.at[dest].set(x.astype(out.dtype), mode="drop")   # padding rows: dest cap
        before = before + n
    return out, jagged_from_offsets(out, offsets)


class PyramidLevel(nnx.Module):
    """One pyramid level: x [T, d], jagged -> (y [T', d], jagged').

    num_layers block-attention blocks (0 = none), then (pooled is not None) each
    `block`-token run pooled into `pooled` tokens by learned softmax queries.
    """

    def __init__(self, dim: int, *, block: int, pooled: int | None, num_layers: int,
                 num_heads: int, ffn_mult: int = 2, ffn_activation: str = "gelu",
                 use_bias: bool = True, dtype=jnp.float32, norm_impl: str = "xla",
                 rngs: nnx.Rngs):
        if block < 1 or (pooled is not None and pooled < 1) or num_layers < 0:
            raise ValueError(f"PyramidLevel: block={block} >= 1, pooled={pooled} >= 1 or None, "
                             f"num_layers={num_layers} >= 0 required")
        self.dim, self.block, self.pooled, self.dtype = dim, block, pooled, dtype
        self.encoder = (SequenceEncoder(dim, num_layers=num_layers, num_heads=num_heads,
                                        attention="block", block=block, ffn_mult=ffn_mult,
                                        ffn_activation=ffn_activation, use_bias=use_bias,
                                        dtype=dtype, norm_impl=norm_impl, rngs=rngs)
                        if num_layers else None)
        if pooled is not None:
            self.queries = param(jax.random.normal(rngs.params(), (pooled, dim)), None, "embed")
            self.pool = JaggedCrossAttention(dim, num_heads, attention="softmax", use_bias=use_bias,
                                             dtype=dtype, rngs=rngs)
        else:
            self.queries = self.pool = None

    def __call__(self, x: jax.Array, jagged: Jagged) -> tuple[jax.Array, Jagged]:
        if self.encoder is not None:
            x = self.encoder(x, jagged)
        if self.pool is None:
            return x.astype(self.dtype), jagged.with_values(None)
        y = self._pool(x, jagged)
        off = jnp.asarray(jagged.offsets, jnp.int32)
        nxt = -(-(off[1:] - off[:-1]) // self.block) * self.pooled
        nxt_off = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(nxt).astype(jnp.int32)])
        return y, jagged_from_offsets(y, nxt_off).with_values(None)

    def pools_in_kernel(self) -> bool:
        """Whether pooling runs the jagged_attention kernel over the packed buffer
        (_pool_packed: where kernels/ picks Pallas, whose precomputed tile ranges skip
        the pairs of other blocks) rather than the block-local einsum (_pool_blocks:
        where the op would run its jnp reference, which visits every pair)."""
        return default_impl("jagged_attention", self.pool.head_dim) == "pallas"

    def _pool(self, x: jax.Array, jagged: Jagged) -> jax.Array:
        return (self._pool_packed if self.pools_in_kernel() else self._pool_blocks)(x, jagged)

    def _pool_blocks(self, x: jax.Array, jagged: Jagged) -> jax.Array:
        """Block-local pooling: x [T, d] -> [NB * pooled, d] in self.dtype.

        Same function and parameters as _pool_packed, in O(NB * pooled * block * d):
        the `pooled` learned queries are projected once ([k, H, dh]); K/V are projected
        on the packed tokens and gathered into a per-block padded [NB, block, H, dh]
        layout; scores, masked softmax and P V run in float32 (the jagged_attention
        reference's masked_softmax_av, per block). Row j * pooled + i is block j's
        query i (nonempty blocks come first, sample after sample); rows of empty
        trailing blocks are 0.
        """
        pool, blk, k_q = self.pool, self.block, self.pooled
        h, dh = pool.num_heads, pool.head_dim
        t = x.shape[0]
        kv_off = block_offsets(jagged.offsets, jagged.capacity, blk, k_q)       # [NB+1]
        nb = kv_off.shape[0] - 1
        q = pool.q_proj(self.queries[...].astype(self.dtype)).reshape(k_q, h, dh)
        xs = x.astype(pool.dtype)
        k = pool.k_proj(xs).reshape(t, h, dh)
        v = pool.v_proj(xs).reshape(t, h, dh)
        idx = kv_off[:-1, None] + jnp.arange(blk, dtype=jnp.int32)[None, :]      # [NB, block]
        filled = idx < kv_off[1:, None]                                          # [NB, block]
        idx = jnp.clip(jnp.where(filled, idx, 0), 0, max(t - 1, 0))
        kb = jnp.take(k, idx, axis=0).astype(jnp.float32)                        # [NB, block, H, dh]
        vb = jnp.take(v, idx, axis=0).astype(jnp.float32)
        s = jnp.einsum("phd,nkhd->nhpk", q.astype(jnp.float32), kb) * (dh ** -0.5)
        o = jax.vmap(lambda sn, fn, vn: masked_softmax_av(sn, jnp.broadcast_to(fn, (k_q, blk)), vn))(
            s, filled, vb).astype(q.dtype)                                       # [NB, k, H, dh]
        out = pool.out_proj(o.reshape(nb * k_q, self.dim).astype(pool.dtype))
        nonempty = jnp.repeat(kv_off[1:] > kv_off[:-1], k_q)                      # [NB * k]
        return jnp.where(nonempty[:, None], out, 0).astype(pool.dtype)

    def _pool_packed(self, x: jax.Array, jagged: Jagged) -> jax.Array:
        """A second pooling path, for the tests: x [T, d] -> [NB * pooled, d].

        Tiles the learned queries over all NB blocks and runs JaggedCrossAttention over
        the whole packed buffer (O(NB * pooled * T) masked work on the CPU reference).
        """
        kv_off = block_offsets(jagged.offsets, jagged.capacity, self.block, self.pooled)  # [NB+1]
        nb = kv_off.shape[0] - 1
        nonempty = (kv_off[1:] > kv_off[:-1]).astype(jnp.int32)
        q_off = jnp.concatenate([jnp.zeros((1,), jnp.int32),
                                 jnp.cumsum(nonempty * self.pooled)]).astype(jnp.int32)
        q = jnp.tile(self.queries[...].astype(self.dtype), (nb, 1))                # [NB*k, d]
        return self.pool(q, q_off, x, kv_off)


class PyramidEncoder(nnx.Module):
    """Levels applied in turn: x [T, d], jagged -> (top tokens [T_top, d], top jagged).

    levels: sequence of (block, pooled, num_layers); pooled None only on the last.
    """

    def __init__(self, dim: int, *, levels: Sequence[tuple[int, int | None, int]],
                 num_heads: int, ffn_mult: int = 2, ffn_activation: str = "gelu",
                 use_bias: bool = True, dtype=jnp.float32, norm_impl: str = "xla",
                 rngs: nnx.Rngs):
        if not levels:
            raise ValueError("PyramidEncoder: levels is empty")
        if any(p is None for _, p, _ in levels[:-1]):
            raise ValueError(f"PyramidEncoder: only the last level may skip pooling, got {levels}")
        self.levels = nnx.List([PyramidLevel(dim, block=b, pooled=p, num_layers=n,
                                             num_heads=num_heads, ffn_mult=ffn_mult,
                                             ffn_activation=ffn_activation, use_bias=use_bias,
                                             dtype=dtype, norm_impl=norm_impl, rngs=rngs)
                                  for b, p, n in levels])

    def __call__(self, x: jax.Array, jagged: Jagged) -> tuple[jax.Array, Jagged]:
        if x.ndim != 2 or x.shape[0] != jagged.capacity:
            raise ValueError(f"PyramidEncoder: x must be [T={jagged.capacity}, d], got {x.shape}")
        x = jnp.where(jagged.mask[:, None], x, 0)
        for level in self.levels:
            x, jagged = level(x, jagged)
        return x, jagged


class ParallelPyramid(nnx.Module):
    """One PyramidEncoder per named sequence, side by side, merged per sample.

    __call__({name: (x [T_name, d], jagged_name)}) -> (tokens [T_out, d], jagged_out)
    with each sequence's top tokens plus its learned type embedding, concatenated
    per sample in the order of `names`.
    """

    def __init__(self, names: Sequence[str], dim: int, *,
                 levels: Sequence[tuple[int, int | None, int]], num_heads: int,
                 ffn_mult: int = 2, ffn_activation: str = "gelu", use_bias: bool = True,
                 dtype=jnp.float32, norm_impl: str = "xla", rngs: nnx.Rngs):
        self.names = tuple(names)
        if not self.names or len(set(self.names)) != len(self.names):
            raise ValueError(f"ParallelPyramid: names must be distinct and non-empty, got {names}")
        self.pyramids = nnx.Dict({n: PyramidEncoder(dim, levels=levels, num_heads=num_heads,
                                                    ffn_mult=ffn_mult, ffn_activation=ffn_activation,
                                                    use_bias=use_bias, dtype=dtype,
                                                    norm_impl=norm_impl, rngs=rngs)
                                  for n in self.names})
        self.type_embedding = param(0.02 * jax.random.normal(rngs.params(), (len(self.names), dim)),
                                    None, "embed")

    def __call__(self, sequences: Mapping[str, tuple[jax.Array, Jagged]]):
        if set(sequences) != set(self.names):
            raise ValueError(f"ParallelPyramid: sequences {sorted(sequences)} != {sorted(self.names)}")
        parts = []
        for i, name in enumerate(self.names):
            y, j = self.pyramids[name](*sequences[name])
            y = jnp.where(j.mask[:, None], y + self.type_embedding[i].astype(y.dtype), 0)
            parts.append((y, j))
        x, j = concat_jagged(parts)
        return x, j.with_values(None)
