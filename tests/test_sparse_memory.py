"""The compiled sparse train step holds no dense [vocab, dim] gradient or optimizer copy.

Compiled (never run) for a 2^22 x 64 fp32 table with row-wise Adagrad on 8
simulated devices and on one device: the step's scratch memory stays far below
one table shard, and the donated table + state alias the outputs (updated in
place). The naive path (jnp.take + jax.grad + dense Adagrad) compiled the same
way needs at least a full [V, D] scratch buffer, which shows the measurement
would catch a dense gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from gemjax.data.jagged import Jagged
from gemjax.sparse import EmbeddingCollection, RowWiseAdagrad, TableSpec

VOCAB, DIM, B, T = 1 << 22, 64, 256, 1024


def abstract(tree, shardings):
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)


def compiled_step(coll, n_dev):
    axes = coll.batch_axes
    bsh = NamedSharding(coll.mesh, P(axes))
    state = jax.eval_shape(lambda: {n: {"weights": jnp.zeros((coll.layouts[n].padded_vocab, s.dim), s.dtype),
                                        **s.optimizer.init_state(coll.layouts[n].padded_vocab, s.dim)}
                                    for n, s in coll.specs.items()})
    state = abstract(state, coll.state_sharding())
    i32 = lambda shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=bsh)
    feats = {"item": i32((n_dev * B,)),
             "bag": Jagged(i32((n_dev * T,)), i32((n_dev * (B + 1),)), i32((n_dev * T,)), i32((n_dev * T,)))}

    def step(state, feats):
        acts, res = coll.lookup(state, feats)
        g_acts = jax.grad(lambda a: sum(jnp.sum(x * x) for x in a.values()))(acts)
        return coll.apply_gradients(state, res, g_acts), res["stats"]

    return jax.jit(step, donate_argnums=0).lower(state, feats).compile()


@pytest.mark.parametrize("n_dev", [1, 8])
def test_step_has_no_dense_table_sized_buffer(n_dev):
    specs = [TableSpec("t", VOCAB, DIM, features=("item",), optimizer=RowWiseAdagrad()),
             TableSpec("b", VOCAB, DIM, features=("bag",), pooling="sum", optimizer=RowWiseAdagrad())]
    mesh = Mesh(np.array(jax.devices()[:n_dev]), ("x",))
    coll = EmbeddingCollection(specs, "row_wise" if n_dev > 1 else None, mesh)
    mem = compiled_step(coll, n_dev).memory_analysis()
    shard_bytes = VOCAB // n_dev * DIM * 4
    state_bytes = 2 * (shard_bytes + VOCAB // n_dev * 4)
    assert mem.temp_size_in_bytes < shard_bytes / 8, mem
    assert mem.alias_size_in_bytes >= state_bytes, mem   # table + accumulators updated in place


def test_naive_dense_step_is_caught_by_the_same_measurement():
    w = jax.ShapeDtypeStruct((VOCAB, DIM), jnp.float32)
    a = jax.ShapeDtypeStruct((VOCAB, DIM), jnp.float32)
    ids = jax.ShapeDtypeStruct((B,), jnp.int32)

    def naive(w, a, ids):
        g = jax.grad(lambda w: jnp.sum(jnp.take(w, ids, axis=0) ** 2))(w)
        a = a + g * g
        return w - 0.05 * g / (jnp.sqrt(a) + 1e-8), a

    mem = jax.jit(naive, donate_argnums=(0, 1)).lower(w, a, ids).compile().memory_analysis()
    assert mem.temp_size_in_bytes >= VOCAB * DIM * 4, mem
