"""LayerNorm reference in plain jnp (differentiated by JAX's autodiff)."""

import jax
import jax.numpy as jnp


def layer_norm_reference(x, scale, bias, *, eps=1e-6, out_dtype=None):
    """y = (x - mean) * (rsqrt(var + eps) * scale) + bias per row, in float32.

    x [T, D] float, scale [D], bias [D] or None (any float dtype, used in float32) ->
    [T, D] out_dtype (default x.dtype). mean and var are float32 over the row's D
    values, var = mean((x - mean)^2) (two passes over the row).
    """
    out_dtype = x.dtype if out_dtype is None else out_dtype
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    mul = jax.lax.rsqrt(var + eps) * scale.astype(jnp.float32)
    y = (xf - mean) * mul
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(out_dtype)

