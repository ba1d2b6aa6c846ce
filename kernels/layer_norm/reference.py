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


def add_layer_norm_reference(x, r, scale, bias, *, row_mask=None, eps=1e-6, out_dtype=None):
    """(s, y): s = x + r in x.dtype (x when r is None; zero on the rows where row_mask [T]
    is 0), y = layer_norm_reference(s) (zero on those rows too)."""
    s = x if r is None else (x.astype(jnp.float32) + r.astype(jnp.float32)).astype(x.dtype)
    keep = None if row_mask is None else (row_mask != 0)[:, None]
    if keep is not None:
        s = jnp.where(keep, s, 0).astype(x.dtype)
    y = layer_norm_reference(s, scale, bias, eps=eps, out_dtype=out_dtype)
    if keep is not None:
        y = jnp.where(keep, y, 0).astype(y.dtype)
    return s, y
