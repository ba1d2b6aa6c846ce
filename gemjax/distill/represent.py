"""Teacher features for representation transfer: a model's logits and its sequence
(user-history) embedding in one forward.

    logits [B, K], repr [B, E] = represent(model, acts, batch)

E (`repr_dim(cfg)`) per model kind:
  "gem"      per sequence, the SequenceEncoder output pooled over the whole history
             and over the data.recent newest events: E = 2 * sequences * dim; without
             sequences (e.g. Frappe), the teacher's looked-up row of the sample's
             USER_FEATURE: E = dim (a per-user embedding, like the sequence ones; a
             per-sample interaction output such as the Wukong tokens would carry the
             teacher's fit to the very rows the student trains on);
  "teacher"  the mean of the pyramid's output tokens (the InterFormer's sequence
             input): E = dim;
  "student"  its sequence summary (whole-history and recent means of the event
             embeddings): E = 2 * sequences * dim (a domain model teaching further).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gemjax.config import Config, schema_of
from gemjax.data.batch import Batch
from gemjax.layers.sequence import mean_pool

KINDS = ("gem", "teacher", "student")
USER_FEATURE = "user"    # the sparse feature whose teacher row is a sequence-less teacher's repr


def repr_dim(cfg: Config) -> int:
    """E, the width of `represent`'s features for this config's model."""
    m = cfg.model
    if m.kind not in KINDS:
        raise ValueError(f"representation transfer reads a teacher of model.kind in {KINDS}, "
                         f"got {m.kind!r}")
    if m.kind == "teacher":
        return m.dim
    n_seq = len(schema_of(cfg).sequence_names) if m.use_sequences else 0
    if m.kind == "gem" and n_seq == 0:
        _check_user_feature(cfg)
        return m.dim
    return 2 * n_seq * m.dim


def _check_user_feature(cfg: Config) -> None:
    names = schema_of(cfg).sparse_names
    if USER_FEATURE not in names:
        raise ValueError(f"representation transfer from a model.kind=gem teacher without "
                         f"sequences reads its {USER_FEATURE!r} rows; the schema's sparse "
                         f"features are {list(names)}")


def represent(model, acts: dict[str, jax.Array], batch: Batch) -> tuple[jax.Array, jax.Array]:
    """(logits [B, K] float32, repr [B, E] float32) of `model` (module docstring)."""
    cfg = model.cfg
    kind = cfg.model.kind
    if kind == "teacher":
        taps: dict = {}
        logits = model(acts, batch, taps=taps)
        rep = mean_pool(taps["seq"], taps["jagged"])
        return logits, rep.astype(jnp.float32)
    logits = model(acts, batch)
    b = batch.dense.shape[0]
    if kind in ("student", "gem"):
        parts = model.sequence_summary(acts, batch)
        if not parts and kind == "gem":
            _check_user_feature(cfg)
            parts = [acts[USER_FEATURE]]
    else:
        raise ValueError(f"representation transfer reads a teacher of model.kind in {KINDS}, "
                         f"got {kind!r}")
    rep = (jnp.concatenate([p.astype(jnp.float32) for p in parts], axis=1) if parts
           else jnp.zeros((b, 0), jnp.float32))
    return logits, rep
