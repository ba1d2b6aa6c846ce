"""SequenceEncoder(dropout=...): block dropout on attention and FFN outputs.

Default 0 adds nothing to the module; in eval mode the encoder equals the same
parameters without dropout; in train mode it differs, keeps padding rows at 0,
keeps samples isolated, and matches a hand-written block with explicit masks.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gemjax.data.jagged import pack
from gemjax.layers import SequenceEncoder

DIM = 16


def _enc(dropout, seed=0):
    return SequenceEncoder(DIM, num_layers=2, num_heads=2, causal=True, rope=True,
                           dropout=dropout, rngs=nnx.Rngs(seed))


def _inputs(second=(2, 4)):
    seqs = [np.arange(3), np.asarray(second), np.arange(5)]
    jag = pack([np.zeros((len(s), 1)) for s in seqs], capacity=16)
    rng = np.random.default_rng(0)
    x = np.zeros((16, DIM), np.float32)
    x[:10] = rng.normal(size=(10, DIM))
    return jnp.asarray(x), jag


def test_default_builds_no_dropout_and_same_params():
    plain, zero = _enc(0.0), SequenceEncoder(DIM, num_layers=2, num_heads=2, causal=True,
                                              rope=True, rngs=nnx.Rngs(0))
    assert all(b.dropout is None for b in zero.blocks)
    s0, s1 = nnx.state(plain), nnx.state(zero)
    assert jax.tree.structure(s0) == jax.tree.structure(s1)
    for a, b in zip(jax.tree.leaves(s0), jax.tree.leaves(s1)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="dropout"):
        _enc(1.0)


def test_eval_mode_equals_no_dropout_train_mode_differs():
    x, jag = _inputs()
    ref, drop = _enc(0.0), _enc(0.3)
    nnx.update(drop, nnx.state(ref, nnx.Param))          # same weights
    drop.eval()
    np.testing.assert_allclose(np.asarray(drop(x, jag)), np.asarray(ref(x, jag)), rtol=1e-6)
    drop.train()
    y = np.asarray(drop(x, jag))
    assert not np.allclose(y[:10], np.asarray(ref(x, jag))[:10])
    assert np.all(y[10:] == 0)                            # padding rows stay 0


def test_train_mode_keeps_samples_isolated():
    """Same rng state, only sample 1's tokens changed: samples 0 and 2 are unchanged."""
    x, jag = _inputs()
    enc = _enc(0.5, seed=1)
    enc.train()
    x2 = x.at[3:5].set(x[3:5] * -2.0 + 1.0)
    y1 = np.asarray(nnx.clone(enc)(x, jag))
    y2 = np.asarray(nnx.clone(enc)(x2, jag))
    np.testing.assert_allclose(y2[:3], y1[:3], rtol=1e-6)
    np.testing.assert_allclose(y2[5:], y1[5:], rtol=1e-6)
    assert not np.allclose(y2[3:5], y1[3:5])


def test_train_mode_matches_block_with_explicit_masks():
    """One block in train mode = x + m1 * Attn(LN x) / keep, then + m2 * FFN(LN h) / keep,
    with the masks m1, m2 that nnx.Dropout draws from the same rng stream."""
    x, jag = _inputs()
    rate = 0.4
    enc = SequenceEncoder(DIM, num_layers=1, num_heads=2, causal=True, final_norm=False,
                          dropout=rate, rngs=nnx.Rngs(3))
    enc.train()
    blk = enc.blocks[0]
    probe = nnx.clone(blk.dropout)                        # same stream -> the same two masks
    ones = jnp.ones((16, DIM))
    m1 = np.asarray(probe(ones)) * (1 - rate)
    m2 = np.asarray(probe(ones)) * (1 - rate)
    assert set(np.unique(m1)) <= {0.0, 1.0} and 0 < m1.mean() < 1
    mask = np.asarray(jag.mask)[:, None]
    a = np.asarray(blk.attn(blk.attn_norm(x), jag), np.float64)
    h = np.asarray(x, np.float64) + m1 * a / (1 - rate)
    f = np.asarray(blk.ffn(blk.ffn_norm(jnp.asarray(h, jnp.float32))), np.float64)
    want = np.where(mask, h + m2 * f / (1 - rate), 0)
    np.testing.assert_allclose(np.asarray(enc(x, jag)), want, rtol=1e-5, atol=1e-5)
