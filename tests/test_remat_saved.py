"""FP8-kept block inputs (gemjax.precision.saved): the forward is exact, the gradients stay
within the bound E4M3's rounding gives, fewer bytes are kept, NaN is never hidden."""

import jax
import jax.numpy as jnp
import numpy as np

from gemjax.precision.saved import ABS_BOUND, REL_BOUND, quantized_residuals


def _data(rows=64, cols=160, out=32):
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    # rows of very different magnitudes: the scales must be per block, not global
    x = jax.random.normal(k1, (rows, cols)) * jnp.exp(jax.random.normal(k3, (rows, 1)) * 3)
    w = jax.random.normal(k2, (cols, out))
    g = jax.random.normal(jax.random.fold_in(k3, 1), (rows, out))
    return x, w, g


def test_linear_block_gradient_within_e4m3_bound_and_forward_exact():
    x, w, g = _data()
    idx = jnp.arange(x.shape[0])           # an integer input: kept as it is

    def block(w, x, i):
        return (x @ w) * (i[:, None] >= 0)

    def loss(w, x, quant):
        f = quantized_residuals(block, exact=1) if quant else block
        return jnp.sum(f(w, x, idx) * g)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)
    gw, gx = grad(w, x, False)
    qw, qx = grad(w, x, True)
    # dw = x_kept^T g: off by at most |x_kept - x|^T |g|, |x_kept - x| <= REL|x| + ABS amax
    # (the amax of x's 128-wide block; bounded here by its row's amax)
    err = REL_BOUND * jnp.abs(x) + ABS_BOUND * jnp.abs(x).max(-1, keepdims=True)
    bound = err.T @ jnp.abs(g)
    slack = 1e-5 * (jnp.abs(x).T @ jnp.abs(g))            # float32 accumulation
    assert bool(jnp.all(jnp.abs(qw - gw) <= bound + slack))
    assert float(jnp.max(jnp.abs(qw - gw))) > 0           # it did keep 8 bits
    # dx = g w^T reads no kept input: exact; the forward is unchanged
    np.testing.assert_array_equal(np.asarray(qx), np.asarray(gx))
    fwd = quantized_residuals(block, exact=1)(w, x, idx)
    np.testing.assert_array_equal(np.asarray(fwd), np.asarray(block(w, x, idx)))


def test_kept_bytes_one_per_element_and_compiled_temp_below_saved():
    """Kept for the backward (the residuals jax.vjp holds, weights aside): autodiff keeps
    the block's activations, recompute its float32 input, quantize one byte per element of
    it plus a float32 scale per 128. Compiled, six such blocks in a chain need fewer temp
    bytes than autodiff's (memory_analysis)."""
    k = jax.random.split(jax.random.key(1), 13)
    x0 = jax.random.normal(k[0], (1024, 256))
    ws = [(jax.random.normal(k[2 * i + 1], (256, 1024)) * 0.05,
           jax.random.normal(k[2 * i + 2], (1024, 256)) * 0.05) for i in range(6)]

    def block(w, x):
        return jnp.tanh(jnp.tanh(x @ w[0]) @ w[1])

    def kept_bytes(f):
        x = jnp.sin(x0)
        _, vjp = jax.vjp(f, ws[0], x)
        weights = {id(a) for a in ws[0]}
        return sum(a.nbytes for a in jax.tree.leaves(vjp) if id(a) not in weights
                   and hasattr(a, "nbytes") and a.size > 1)

    recompute = jax.checkpoint(block, policy=jax.checkpoint_policies.nothing_saveable)
    rows, cols = x0.shape
    assert kept_bytes(quantized_residuals(block, exact=1)) == rows * cols + 4 * rows * (cols // 128)
    assert kept_bytes(recompute) == 4 * rows * cols
    assert kept_bytes(block) >= 4 * rows * (cols + 2 * 1024)

    def temp_bytes(wrap):
        def loss(ws, x0):
            x = jnp.sin(x0) * 3.0
            for w in ws:
                x = wrap(block)(w, x)
            return jnp.sum(x ** 2)
        c = jax.jit(jax.grad(loss)).lower(ws, x0).compile()
        return c.memory_analysis().temp_size_in_bytes

    assert temp_bytes(lambda f: quantized_residuals(f, exact=1)) < 0.5 * temp_bytes(lambda f: f)


def test_nonfinite_input_gives_nan_gradient():
    x, w, g = _data(rows=8, cols=128, out=4)
    x = x.at[3, 5].set(jnp.inf)

    def loss(w):
        return jnp.sum(quantized_residuals(lambda w, x: x @ w, exact=1)(w, x) * g)
    gw = np.asarray(jax.jit(jax.grad(loss))(w))
    assert np.isnan(gw[5]).all()                 # the inf's column is NaN, not a finite value
    assert np.isfinite(np.delete(gw, 5, axis=0)).all()
