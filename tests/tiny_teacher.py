"""The small GEM teacher the block tests build, its batch and looked-up activations, and
several jitted functions traced and compiled as one program.

    cfg = teacher_config(batch_size=16, num_experts=2, sequences=1)
    batch, acts = teacher_inputs(cfg)     # the tiny stream's first batch, random activations
    traced, inner = one_program([f, g], params, acts)    # inner: f's and g's own jaxprs

The teacher: the tiny preset's with one InterFormer layer and one pyramid level (16 tokens
to 2, 1 summary token); `sequences` keeps the first n of the stream's sequences (None: all).
"""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np

from gemjax.config import get_config, synthetic_schema
from gemjax.data.synthetic import SEQUENCE_FIELDS, SPARSE_FEATURES, SyntheticStream


def teacher_config(overrides: str = "", *, batch_size: int = 16, num_experts: int = 0,
                   sequences: int | None = None, **teacher_fields) -> types.SimpleNamespace:
    """(data, model, train, features) of the small teacher on get_config("tiny", overrides)."""
    base = get_config("tiny", overrides)
    model = dataclasses.replace(base.model, kind="teacher", teacher=dataclasses.replace(
        base.model.teacher, interformer_layers=1, pyramid_levels=((16, 2, 1),),
        num_experts=num_experts, **teacher_fields))
    data = dataclasses.replace(base.data, batch_size=batch_size)
    schema = synthetic_schema(data)
    if sequences is not None:
        schema = dataclasses.replace(schema, sequences=schema.sequences[:sequences])
    return types.SimpleNamespace(data=data, model=model, train=base.train, features=schema)


def teacher_inputs(cfg, seed: int = 1):
    """(batch, acts): the stream's first batch and standard-normal float32 activations of
    every sparse feature [B, dim] and sequence field [capacity, dim] of cfg.features."""
    out = SyntheticStream(cfg.data, seed=0).shard_batch(0)
    batch = out[0] if isinstance(out, tuple) else out
    rng = np.random.default_rng(seed)
    b, dim = batch.dense.shape[0], cfg.model.dim
    acts = {f: jnp.asarray(rng.normal(size=(b, dim)), jnp.float32) for f in SPARSE_FEATURES}
    for s in cfg.features.sequences:
        t = batch.sequences[s.name].capacity
        for f in SEQUENCE_FIELDS:
            acts[f"{s.name}.{f}"] = jnp.asarray(rng.normal(size=(t, dim)), jnp.float32)
    return batch, acts


def one_program(fns, *args):
    """(traced, inner jaxprs): the jitted fns called on args inside one jit, traced once
    (compile with traced.lower().compile(); it returns their outputs as a list), and each
    fn's own jaxpr, in the order of fns."""
    traced = jax.jit(lambda *a: [f(*a) for f in fns]).trace(*args)
    inner = [e.params["jaxpr"] for e in traced.jaxpr.eqns if "jaxpr" in e.params]
    assert len(inner) == len(fns), "each fn must be a jitted function"
    return traced, inner
