"""8-bit saved activations: a block whose backward keeps its inputs in FP8 E4M3 and
recomputes itself from them.

    f8 = quantized_residuals(fn)          # fn(*args) -> outputs, may read parameters
    y = f8(x, jagged)                     # forward: exactly fn(x, jagged)

Forward: y = fn(*args), unchanged. Kept for the backward: each floating input leaf of
args with at least one axis, quantized with `quantize` (E4M3, round to nearest even,
LAYOUT: one float32 scale per 128 elements along the last axis, the whole row when it
is narrower), every other leaf (integer index arrays, scalars) as it is, and the
values fn closes over (the parameters, alive for the optimizer anyway) as they are.
Backward: the kept inputs are dequantized to their dtype and fn's VJP is evaluated
there, so the block is recomputed (as under jax.checkpoint) from inputs within
E4M3's rounding of the true ones. A [R, C] bfloat16 input costs R*C bytes plus
4*R*ceil(C/128) of scales instead of 2*R*C (float32: 4*R*C).

Why a custom_vjp around the whole block rather than a checkpoint policy: a policy can
only keep or drop a tensor, it cannot change what the backward reads; and quantizing
inside the forward (q = quantize(x); y = fn(dequantize(q))) would change the forward's
values too. The block form keeps the forward exact, needs no change to the linears
inside it (attention kernels, experts' routing and Wukong run as written) and stores
one tensor per input instead of every intermediate.

Error: E4M3 keeps 3 mantissa bits, so an element in the normal range is kept within
2**-4 of its magnitude (half a unit in the last place); the scale maps a block's amax
to 448 (float32 scales, no power-of-two rounding), so elements below 2**-6 * s
(s = amax / 448) are subnormal and kept within 2**-10 * s. Per element:
    |x_kept - x| <= 2**-4 * |x| + 2**-10 * amax_block / 448          (ELEMENT_BOUND)
The gradients are those of fn at the kept inputs; for a block linear in a parameter
(y = x @ w) the parameter's gradient differs from the exact one by at most
|x_kept - x|^T |dy| element-wise.

Non-finite values: quantize keeps NaN as NaN and turns +-inf into NaN (E4M3 has no
infinity); a block's other elements are quantized as if the non-finite ones were
absent. So a non-finite saved input gives NaN gradients, never a finite stand-in (the
trainer's non-finite check sees it).

The block is traced once at the call (jax.closure_convert), with the module attributes
it reads then (the regions plan, the experts' mesh axes), and the
backward evaluates that trace.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from gemjax.precision.formats import E4M3, Layout
from gemjax.precision.quantize import BlockScaled, dequantize, quantize

LAYOUT = Layout(block=(1, 128), scale="f32")
# the per-element bound of the module docstring: |kept - x| <= REL * |x| + ABS * amax
REL_BOUND = 2.0 ** -(E4M3.mantissa_bits + 1)
ABS_BOUND = 2.0 ** (E4M3.min_normal_exp - E4M3.mantissa_bits - 1) / E4M3.max_finite


def _quantizable(x) -> bool:
    return (isinstance(x, jax.Array) or hasattr(x, "dtype")) and \
        jnp.issubdtype(x.dtype, jnp.floating) and x.ndim >= 1 and x.size > 0


def keep(x: jax.Array, layout: Layout = LAYOUT) -> BlockScaled | jax.Array:
    """What the backward keeps of one input leaf: a BlockScaled E4M3 tensor for a floating
    array with at least one axis, else the leaf itself."""
    return quantize(x, layout, E4M3) if _quantizable(x) else x


def restore(kept, dtype) -> jax.Array:
    """The leaf the backward reads: a BlockScaled dequantized to `dtype`, else `kept`."""
    return dequantize(kept, dtype) if isinstance(kept, BlockScaled) else kept


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _block(spec, exact, leaves):
    conv, tree, _ = spec
    return conv(*jax.tree.unflatten(tree, leaves), *exact)


def _block_fwd(spec, exact, leaves):
    _, _, layout = spec
    kept = [keep(x, layout) for x in leaves]
    dtypes = [jnp.zeros((0,), getattr(x, "dtype", jnp.float32)) for x in leaves]
    return _block(spec, exact, leaves), (exact, kept, dtypes)


def _block_bwd(spec, res, g):
    conv, tree, _ = spec
    exact, kept, dtypes = res
    # tie the kept inputs to the cotangent (as jax.checkpoint does), so XLA cannot move
    # the recomputation ahead into the forward pass and keep its activations after all
    kept, g = jax.lax.optimization_barrier((kept, g))
    leaves = [restore(k, d.dtype) for k, d in zip(kept, dtypes)]
    _, vjp = jax.vjp(lambda c, xs: conv(*jax.tree.unflatten(tree, xs), *c), exact, leaves)
    return vjp(g)


_block.defvjp(_block_fwd, _block_bwd)


def quantized_residuals(fn: Callable, exact: int = 0, layout: Layout = LAYOUT) -> Callable:
    """fn with its backward reading FP8-kept inputs (module docstring). fn(*args): args
    pytrees of arrays; the first `exact` of them (e.g. a module's parameters) and the
    traced values fn closes over are kept as they are, the leaves of the others as `keep`
    says."""
    def wrapped(*args):
        conv, consts = jax.closure_convert(fn, *args)
        head, tail = args[:exact], args[exact:]

        def body(*xs):                  # (*tail, *head, *consts) -> fn(*head, *tail)
            return conv(*xs[len(tail):len(tail) + exact], *xs[:len(tail)],
                        *xs[len(tail) + exact:])
        leaves, tree = jax.tree.flatten(tail)
        return _block((body, tree, layout), [*head, *consts], leaves)
    return wrapped
