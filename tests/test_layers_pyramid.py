"""Pyramid-parallel sequence encoding: block pooling vs float64 numpy, jagged concat,
isolation, padding invariance, gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gemjax.data.jagged import pack
from gemjax.layers.pyramid import (ParallelPyramid, PyramidLevel, block_offsets,
                                   concat_jagged)

D, H = 16, 2


def np64(p):
    return np.asarray(p[...], np.float64)


def seqs(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=(n, D)).astype(np.float32) for n in lengths]


def test_block_offsets():
    j = pack(seqs([5, 0, 9, 4]), capacity=32)
    got = np.asarray(block_offsets(jnp.asarray(j.offsets), 32, 4))
    want = [0, 4, 5, 9, 13, 14, 18]
    assert got.shape == (4 + 8 + 1,)
    np.testing.assert_array_equal(got[:len(want)], want)
    assert np.all(got[len(want):] == 18)
    # no XLA while loop (a binary search's default lowering, stepped from the host on GPU)
    hlo = jax.jit(lambda o: block_offsets(o, 32, 4)).lower(jnp.asarray(j.offsets)).as_text()
    assert "while" not in hlo


def test_block_pooling_matches_numpy():
    level = PyramidLevel(D, block=4, pooled=2, num_layers=0, num_heads=H, rngs=nnx.Rngs(0))
    xs = seqs([5, 0, 9, 1])
    j = pack(xs, capacity=32)
    y, nj = nnx.jit(lambda m, x, j: m(x, j))(level, jnp.asarray(j.values), j)
    y = np.asarray(y)
    np.testing.assert_array_equal(np.asarray(nj.lengths), [4, 0, 6, 2])
    lin = lambda p, v: v @ np64(p.kernel) + np64(p.bias)
    pool = level.pool
    q = lin(pool.q_proj, np64(level.queries)).reshape(2, H, D // H)
    off = np.asarray(nj.offsets)
    for i, s in enumerate(xs):
        blocks = [s[a:a + 4].astype(np.float64) for a in range(0, len(s), 4)]
        want = []
        for blk in blocks:
            k = lin(pool.k_proj, blk).reshape(len(blk), H, D // H)
            v = lin(pool.v_proj, blk).reshape(len(blk), H, D // H)
            sc = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(D // H)
            p = np.exp(sc - sc.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            want.append(lin(pool.out_proj, np.einsum("hqk,khd->qhd", p, v).reshape(2, D)))
        got = y[off[i]:off[i + 1]]
        if want:
            np.testing.assert_allclose(got, np.concatenate(want), rtol=1e-4, atol=1e-4)
    assert np.all(y[off[-1]:] == 0)


def test_concat_jagged_matches_numpy():
    a, b = seqs([2, 0, 3], 1), seqs([1, 4, 0], 2)
    ja, jb = pack(a, capacity=8), pack(b, capacity=16)
    x, j = concat_jagged([(jnp.asarray(ja.values), ja), (jnp.asarray(jb.values), jb)])
    assert x.shape == (24, D)
    for i in range(3):
        np.testing.assert_array_equal(np.asarray(x)[j.offsets[i]:j.offsets[i + 1]],
                                      np.concatenate([a[i], b[i]]))
    np.testing.assert_array_equal(np.asarray(j.positions)[:5], [0, 1, 2, 0, 1])
    assert np.all(np.asarray(x)[int(j.offsets[-1]):] == 0)


def test_parallel_pyramid_isolation_padding_invariance_and_gradients():
    m = ParallelPyramid(["clicks", "views"], D, levels=[(4, 2, 1), (4, None, 0)], num_heads=H,
                        rngs=nnx.Rngs(0))    # the top level passes tokens through (cheap compile)
    run = nnx.jit(lambda m, s: m(s))
    c, v = seqs([9, 0, 3, 17], 3), seqs([2, 5, 0, 0], 4)

    def inputs(c, v, cap):
        jc, jv = pack(c, capacity=cap), pack(v, capacity=cap)
        return {"clicks": (jnp.asarray(jc.values), jc), "views": (jnp.asarray(jv.values), jv)}

    y1, j1 = run(m, inputs(c, v, 32))
    y2, j2 = run(m, inputs(c, v, 64))
    np.testing.assert_array_equal(np.asarray(j1.lengths), np.asarray(j2.lengths))
    # clicks 9 -> 3 blocks -> 6 tokens; views 2 -> 1 block -> 2: top level keeps them.
    np.testing.assert_array_equal(np.asarray(j1.lengths), [6 + 2, 0 + 4, 2 + 0, 10 + 0])
    n = int(j1.offsets[-1])
    np.testing.assert_allclose(np.asarray(y1)[:n], np.asarray(y2)[:n], rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(y1)[n:] == 0) and np.isfinite(np.asarray(y1)).all()

    c2 = list(c)
    c2[3] = c[3] * 0.5 + 1.0
    y3, _ = run(m, inputs(c2, v, 32))
    off = np.asarray(j1.offsets)
    for i in range(4):
        sl = slice(off[i], off[i + 1])
        if i == 3:
            assert np.abs(np.asarray(y3)[sl] - np.asarray(y1)[sl]).max() > 1e-3
        else:
            np.testing.assert_array_equal(np.asarray(y3)[sl], np.asarray(y1)[sl])

    r = jnp.asarray(np.random.default_rng(5).normal(size=y1.shape), jnp.float32)
    grads = nnx.jit(nnx.grad(lambda m: jnp.sum(m(inputs(c, v, 32))[0] * r)))(m)
    for path, g in jax.tree_util.tree_leaves_with_path(nnx.state(grads, nnx.Param)):
        assert float(jnp.abs(g).max()) > 0, f"no gradient reaches {jax.tree_util.keystr(path)}"


def test_bad_levels():
    with pytest.raises(ValueError, match="last level"):
        ParallelPyramid(["a"], D, levels=[(4, None, 1), (4, 2, 1)], num_heads=H, rngs=nnx.Rngs(0))
