"""Block-local pyramid pooling (PyramidLevel._pool_blocks) against the former packed
JaggedCrossAttention path (_pool_packed): same parameters, same function, forward and
every gradient (params and input tokens), on jagged inputs with empty samples, length
1, lengths around the block size and all-padding tails."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gemjax.data.jagged import pack
from gemjax.layers.pyramid import PyramidLevel, num_blocks

D, H = 16, 2


def level_and_batch(lengths, block, pooled, capacity, num_layers=0, seed=0):
    level = PyramidLevel(D, block=block, pooled=pooled, num_layers=num_layers, num_heads=H,
                         rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    j = pack([rng.normal(size=(n, D)).astype(np.float32) for n in lengths], capacity=capacity)
    return level, jnp.asarray(j.values), j


def loss_and_grads(path, level, x, j, cot):
    """sum(path(x) * cot) and its gradients w.r.t. every param and x."""
    graph, params = nnx.split(level)

    def loss(params, x):
        lvl = nnx.merge(graph, params)
        return jnp.sum(getattr(lvl, path)(x, j) * cot)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, x)


CASES = [  # (lengths, block, pooled, capacity): 0, 1, block-1, block, block+1, padding tails
    ([0, 1, 3, 4, 5, 0, 9], 4, 2, 40),
    ([7, 8, 9, 1, 0, 16, 2], 8, 3, 64),
    ([0, 0, 0], 4, 2, 8),           # no tokens at all: every block empty
]


@pytest.mark.parametrize("lengths,block,pooled,capacity", CASES)
def test_block_pooling_matches_packed_path(lengths, block, pooled, capacity):
    level, x, j = level_and_batch(lengths, block, pooled, capacity)
    nb = num_blocks(capacity, block, len(lengths), pooled)
    # the static bound, rounded up so the pooled buffer is a whole number of 128-row tiles
    assert nb >= -(-capacity // block) + len(lengths) and (nb * pooled) % 128 == 0
    cot = jnp.asarray(np.random.default_rng(1).normal(size=(nb * pooled, D)), jnp.float32)
    (l_new, (gp_new, gx_new)) = loss_and_grads("_pool_blocks", level, x, j, cot)
    (l_old, (gp_old, gx_old)) = loss_and_grads("_pool_packed", level, x, j, cot)
    y_new = np.asarray(jax.jit(lambda x: level._pool_blocks(x, j))(x))
    y_old = np.asarray(jax.jit(lambda x: level._pool_packed(x, j))(x))
    assert y_new.shape == y_old.shape == (nb * pooled, D)
    np.testing.assert_allclose(y_new, y_old, rtol=1e-5, atol=1e-5)
    # rows past the nonempty blocks are exactly 0, as before
    n_rows = sum(-(-n // block) for n in lengths) * pooled
    assert np.all(y_new[n_rows:] == 0) and np.all(y_old[n_rows:] == 0)
    if n_rows:
        assert np.abs(y_new[:n_rows]).max() > 0
    np.testing.assert_allclose(float(l_new), float(l_old), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(gx_new), np.asarray(gx_old), rtol=1e-5, atol=1e-5)
    flat_new = dict(nnx.to_flat_state(gp_new))
    flat_old = dict(nnx.to_flat_state(gp_old))
    assert set(flat_new) == set(flat_old) and flat_new
    for path in flat_old:
        np.testing.assert_allclose(np.asarray(flat_new[path][...]), np.asarray(flat_old[path][...]),
                                   rtol=1e-5, atol=1e-5, err_msg=str(path))
    if n_rows:  # the queries and K/V projections do get gradient
        assert np.abs(np.asarray(flat_new[("queries",)][...])).max() > 0
        assert np.abs(np.asarray(gx_new)).max() > 0
    assert np.all(np.asarray(gx_new)[int(np.asarray(j.offsets)[-1]):] == 0)


def test_level_call_uses_block_pooling_with_encoder():
    """The level's output (encoder + pooling) equals encoder + the packed path."""
    level, x, j = level_and_batch([5, 0, 4, 1, 3], 4, 2, 24, num_layers=1, seed=3)
    y, nj = jax.jit(lambda x: level(x, j))(x)
    enc = jax.jit(lambda x: level.encoder(x, j))(x)
    want = jax.jit(lambda e: level._pool_packed(e, j))(enc)
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(nj.lengths), [4, 0, 2, 2, 2])


def test_block_pooling_bfloat16_close_to_packed_path():
    lengths = [3, 4, 5, 0, 1]
    rng = np.random.default_rng(2)
    level = PyramidLevel(D, block=4, pooled=2, num_layers=0, num_heads=H, dtype=jnp.bfloat16,
                         rngs=nnx.Rngs(2))
    j = pack([rng.normal(size=(n, D)).astype(np.float32) for n in lengths], capacity=16)
    x = jnp.asarray(j.values)
    y_new = jax.jit(lambda x: level._pool_blocks(x, j))(x)
    y_old = jax.jit(lambda x: level._pool_packed(x, j))(x)
    assert y_new.dtype == y_old.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y_new, np.float32), np.asarray(y_old, np.float32),
                               rtol=2e-2, atol=2e-2)
