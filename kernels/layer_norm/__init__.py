"""layer_norm: LayerNorm over the last axis of [T, D] tokens, forward and backward in one pass each.

The token norms of the sequence encoders (gemjax.layers.sequence) over the pyramid's
packed tokens. XLA runs a LayerNorm as several passes over [T, D] (the stats reduce,
the normalisation, and in the backward further reductions); the Pallas Triton kernels
(kernel.py) read x once and write y once forward, read x and dy once and write dx
once backward.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kernels.common import check_impl
from kernels.layer_norm.kernel import (KNOBS, MAX_DIM, check_knobs, layer_norm_bwd,
                                       layer_norm_fwd)
from kernels.layer_norm.reference import layer_norm_reference

__all__ = ["KNOBS", "MAX_DIM", "default_impl", "layer_norm", "layer_norm_reference"]

MAX_ELEMENTS = 2 ** 31 - 1      # the kernels index x with int32 offsets
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def default_impl(d: int, dtype, backend=None, rows: int = 0) -> str:
    """impl=None's choice: "pallas" on GPU when the kernels take the shape and dtype
    (D <= MAX_DIM, rows * D < 2^31; bfloat16, float16, float32), else "reference"."""
    gpu = (backend or jax.default_backend()) == "gpu"
    fits = 1 <= d <= MAX_DIM and rows * d <= MAX_ELEMENTS
    return "pallas" if gpu and fits and jnp.dtype(dtype) in _DTYPES else "reference"


def layer_norm(x, scale, bias=None, *, eps=1e-6, impl=None, out_dtype=None, **knobs):
    """y = (x - mean) * (rsqrt(var + eps) * scale) + bias over each row of x.

    x [T, D] float, scale [D], bias [D] or None (float; used in float32, their
    gradients come back in their own dtypes) -> [T, D] out_dtype (default x.dtype).
    mean and var are float32 over the row, var = mean((x - mean)^2) (two passes over
    the row, which the kernel holds in registers: no cancellation for rows far from
    0, where flax's nnx.LayerNorm default, E[x^2] - E[x]^2, loses the variance; the
    two agree to float32 rounding elsewhere). nnx.LayerNorm(dtype=c) also rounds
    scale and bias to c first: pass them as scale.astype(c) for the same numbers.
    An all-zero row gives y = bias (var 0: rsqrt(eps)). A NaN / Inf makes its own
    row NaN (and dscale NaN, as any sum over rows would), no other row.
    Differentiable in x, scale and bias.
    impl: None (`default_impl`), "reference" (jnp, JAX's autodiff), "pallas" (the
    Triton kernels, custom VJP; interpret mode off GPU). knobs: kernel.KNOBS
    overrides (block_rows, bwd_rows, bwd_tiles, num_warps, bwd_warps, bwd_stages). The
    kernels' results may differ from the reference's in float32 rounding (summation
    order); they are the same bits on every run.
    """
    check_impl("layer_norm", impl)
    _check_inputs(x, scale, bias, eps)
    impl, out_dtype, static = _setup(x, out_dtype, impl, knobs, eps)
    if impl == "reference" or x.shape[0] == 0:
        return layer_norm_reference(x, scale, bias, eps=eps, out_dtype=out_dtype)
    return _kernel(x, scale, bias, static)


def _setup(x, out_dtype, impl, knobs, eps):
    """(impl, out_dtype, static) checked, with impl None resolved; static = the kernels'
    (eps, out_dtype, interpret, knobs) (None for "reference"). ValueError names the bad
    input (the Pallas limits on D, T * D and x's dtype)."""
    out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
    if not jnp.issubdtype(out_dtype, jnp.floating):
        raise ValueError(f"layer_norm: out_dtype must be floating point, got {out_dtype}")
    knobs = check_knobs(knobs)
    t, d = x.shape
    if impl is None:
        impl = default_impl(d, x.dtype, rows=t)
    if impl == "reference":
        return impl, out_dtype, None
    if d > MAX_DIM:
        raise ValueError(f"layer_norm(impl='pallas'): x's width D={d} is over MAX_DIM={MAX_DIM} "
                         "(one tile per row); use impl=None or 'reference'")
    if t * d > MAX_ELEMENTS:
        raise ValueError(f"layer_norm(impl='pallas'): x [{t}, {d}] has over 2^31 - 1 elements "
                         "(the kernels' int32 offsets); use impl=None or 'reference'")
    if jnp.dtype(x.dtype) not in _DTYPES:
        raise ValueError(f"layer_norm(impl='pallas'): x must be bfloat16, float16 or float32, "
                         f"got {x.dtype}")
    interpret = jax.default_backend() != "gpu"
    return impl, out_dtype, (float(eps), out_dtype, interpret, tuple(sorted(knobs.items())))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _kernel(x, scale, bias, static):
    return _fwd(x, scale, bias, static)[0]


def _fwd(x, scale, bias, static):
    eps, out_dtype, interpret, knobs = static
    y, mean, rstd = layer_norm_fwd(x, scale, bias, eps=eps, out_dtype=out_dtype,
                                   interpret=interpret, knobs=dict(knobs))
    return y, (x, scale, bias, mean, rstd)


def _bwd(static, res, dy):
    _, _, interpret, knobs = static
    x, scale, bias, mean, rstd = res
    dx, ds, db = layer_norm_bwd(x, dy, mean, rstd, scale, interpret=interpret, knobs=dict(knobs))
    return dx, ds.astype(scale.dtype), None if bias is None else db.astype(bias.dtype)


_kernel.defvjp(_fwd, _bwd)


def _check_inputs(x, scale, bias, eps):
    """ValueError naming the bad input."""
    if getattr(x, "ndim", None) != 2:
        raise ValueError(f"layer_norm: x must be [T, D], got shape {getattr(x, 'shape', None)}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"layer_norm: x must be floating point, got {x.dtype}")
    d = x.shape[1]
    for name, p in (("scale", scale), ("bias", bias)):
        if p is None and name == "bias":
            continue
        if getattr(p, "shape", None) != (d,):
            raise ValueError(f"layer_norm: {name} must be [D={d}], got shape "
                             f"{getattr(p, 'shape', None)}")
        if not jnp.issubdtype(p.dtype, jnp.floating):
            raise ValueError(f"layer_norm: {name} must be floating point, got {p.dtype}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"layer_norm: eps must be a float > 0, got {eps!r}")
