"""Analytic forward FLOPs of the next-item retrieval tower (model.kind="retrieval").

gemjax.perf.mfu's conventions: matmuls only ([m, k] x [k, n] = 2 m k n); embedding
lookups, norms, activations, gates, RoPE, dropout and masks 0; attention 4 H D x the
valid causal (query, key) pairs of each sample (n (n + 1) / 2 for a history of n
tokens); per-token work over the valid tokens (the sum of the history lengths), never
the packed capacity. With d = model.dim, L = model.seq_layers, t tokens, P pairs:

  encoder "softmax"   gemjax.layers.sequence.SequenceEncoder (FFN d -> 2d -> d):
                      L x (q, k, v, out projections 8 t d^2 + FFN 8 t d^2 + 4 d P)
  encoder "hstu"      gemjax.layers.hstu.HSTUBlock (per-head widths d / H):
                      L x (W_1 d -> 4d 8 t d^2 + W_2 d -> d 2 t d^2 + 4 d P)
  scoring             every token's vector against the candidate rows of the item table
                      (gemjax.train.retrieval): the full softmax [t, d] x [d, V] = 2 t d V
                      (V the item table's rows); N sampled negatives 2 t d N plus the
                      target dot 2 t d

The encoder is the tower's dense work (what grows with width and depth); the scoring
is a product with the embedding table, reported apart.

    enc, score = retrieval_forward_flops(cfg, lengths)     # whole batch, lengths [B]
"""

from __future__ import annotations

import numpy as np

from gemjax.config import Config, schema_of

FFN_MULT = 2            # SequenceEncoder's FFN width multiple in the retrieval tower
HSTU_UVQK = 4           # HSTUBlock's W_1 output width multiple (U, V, Q, K)


def encoder_kind(cfg: Config) -> str:
    """The tower's encoder: model.retrieval.encoder where the config has it, else "softmax"."""
    return getattr(getattr(cfg.model, "retrieval", None), "encoder", "softmax")


def causal_pairs(lengths: np.ndarray) -> int:
    """Valid (query, key) pairs of causal self-attention over samples of these lengths."""
    n = np.asarray(lengths, np.int64)
    return int(np.sum(n * (n + 1) // 2))


def retrieval_forward_flops(cfg: Config, lengths) -> tuple[int, int]:
    """(encoder, scoring) forward FLOPs of the retrieval tower on a batch whose samples
    have these history lengths [B] (module docstring); ValueError for another model.kind."""
    m = cfg.model
    if m.kind != "retrieval":
        raise ValueError(f"retrieval_forward_flops: model.kind must be retrieval, got {m.kind!r}")
    lengths = np.asarray(lengths, np.int64)
    t, d = int(lengths.sum()), m.dim
    kind = encoder_kind(cfg)
    if kind == "softmax":
        per_token = 2 * 4 * d * d + 2 * 2 * d * FFN_MULT * d
    elif kind == "hstu":
        per_token = 2 * d * HSTU_UVQK * d + 2 * d * d
    else:
        raise ValueError(f"retrieval_forward_flops: unknown model.retrieval.encoder {kind!r}")
    encoder = m.seq_layers * (per_token * t + 4 * d * causal_pairs(lengths))
    if m.retrieval.negatives > 0:
        scoring = 2 * t * d * (m.retrieval.negatives + 1)
    else:
        from gemjax.models.retrieval import item_table
        scoring = 2 * t * d * schema_of(cfg).table(item_table(cfg)).vocab
    return encoder, scoring
