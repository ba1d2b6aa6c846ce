"""Next-item retrieval: per-token targets, the sampled-softmax loss, the history mask.

Autoregressive training (SASRec-style): a row holds a user's history h_0..h_{n-1}
(jagged) and the item that followed it, c. Token i's target is h_{i+1}, the last
token's is c, so one row trains every position of its history once.

    src, last = next_item_sources(jag)                      # [T], [T]
    tgt_ids = next_item_targets(jag, hist_ids, cand_ids)    # [T] int32
    per_token = sampled_softmax(h, tgt_e, tgt_ids, neg_e, neg_ids, temperature)  # [T]
    exclude = history_mask(jag, hist_ids, V)                # [B, V] bool

The ranks and HR / NDCG / MRR of an evaluation: gemjax.train.ranking.

Negatives are shared by the tokens of one device ([N, d]); a negative equal to a
token's target, or the padding item 0, is left out of that token's softmax. With N =
the whole item table this is the full softmax over the catalogue.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gemjax.data.jagged import Jagged


def next_item_sources(jag: Jagged) -> tuple[jax.Array, jax.Array]:
    """(src [T] int32, last [T] bool): token i's target is token src[i] of the same
    buffer (i + 1, clamped to T - 1) unless last[i] (the sample's final token), whose
    target is its sample's candidate. Padding tokens: last False, src arbitrary."""
    t = jag.capacity
    seg = jag.segment_ids
    lengths = jnp.concatenate([jag.lengths, jnp.zeros((1,), jag.lengths.dtype)])
    last = jag.mask & (jag.positions + 1 >= jnp.take(lengths, seg))
    src = jnp.minimum(jnp.arange(t, dtype=jnp.int32) + 1, t - 1)
    return src, last


def next_item_targets(jag: Jagged, hist: jax.Array, cand: jax.Array) -> jax.Array:
    """hist [T, ...] per-token values, cand [B, ...] per-sample values -> [T, ...]: each
    token's next-item value (the next token's, the candidate's for the last token)."""
    src, last = next_item_sources(jag)
    seg = jnp.minimum(jag.segment_ids, jag.num_samples - 1)
    pick = last.reshape(last.shape + (1,) * (hist.ndim - 1))
    return jnp.where(pick, jnp.take(cand, seg, axis=0), jnp.take(hist, src, axis=0))


def sampled_softmax(h: jax.Array, target_e: jax.Array, target_ids: jax.Array,
                    neg_e: jax.Array, neg_ids: jax.Array, temperature: float = 1.0) -> jax.Array:
    """Per-token -log softmax([h.e_target, h.e_neg_1..N] / temperature)[0], float32 [T].

    h, target_e [T, d]; target_ids [T] int; neg_e [N, d] and neg_ids [N] int (shared
    by every token). A negative whose id is the token's target, or 0 (padding), is
    left out of its softmax.
    """
    q = h.astype(jnp.float32)
    pos = jnp.sum(q * target_e.astype(jnp.float32), axis=-1) / temperature       # [T]
    neg = (q @ neg_e.astype(jnp.float32).T) / temperature                        # [T, N]
    drop = (neg_ids[None, :] == target_ids[:, None]) | (neg_ids[None, :] == 0)
    neg = jnp.where(drop, -jnp.inf, neg)
    return jnp.logaddexp(pos, jax.nn.logsumexp(neg, axis=-1)) - pos


def history_mask(jag: Jagged, ids: jax.Array, vocab: int) -> jax.Array:
    """[B, vocab] bool: True at (b, i) when item i is among sample b's tokens (ids [T] int
    in [0, vocab)); padding tokens mark nothing."""
    b = jag.num_samples
    return jnp.zeros((b, vocab), bool).at[jag.segment_ids, ids].set(True, mode="drop")
