"""Logical sharding names on parameters (see gemjax.parallel.rules).

Every parameter a layer creates carries `out_sharding` metadata: a tuple of
logical axis names, one per dim ("embed", "mlp", "norm", None = replicated),
which gemjax.parallel.rules maps to mesh axes. nnx.vmap over experts prepends
"expert". Eager sharding is off: parameters are placed by shard_params, so
modules build the same with or without a mesh.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from kernels.layer_norm import MAX_DIM as _NORM_MAX_DIM
from kernels.layer_norm import layer_norm as _layer_norm_op


def axes(*names: str | None) -> dict:
    """Variable metadata naming each dim of a parameter."""
    return {"out_sharding": tuple(names), "eager_sharding": False}


def param(value: jax.Array, *names: str | None) -> nnx.Param:
    """A float32 nnx.Param with logical names (one per dim of value)."""
    if len(names) != value.ndim:
        raise ValueError(f"param: {len(names)} names {names} for a value of shape {value.shape}")
    return nnx.Param(jnp.asarray(value, jnp.float32), **axes(*names))


def linear(in_features: int, out_features: int, *, names=("embed", "mlp"), use_bias=True,
           dtype=jnp.float32, dot_general=jax.lax.dot_general, rngs: nnx.Rngs) -> nnx.Linear:
    """nnx.Linear [in, out] with float32 params named `names` (bias: names[1]).

    dot_general: its GEMM (gemjax.precision.policy sets an FP8 one on the linears of FP8
    regions after the model is built)."""
    return nnx.Linear(in_features, out_features, use_bias=use_bias, dtype=dtype,
                      param_dtype=jnp.float32, kernel_metadata=axes(*names),
                      bias_metadata=axes(names[1]), dot_general=dot_general, rngs=rngs)


NORM_IMPLS = ("xla", "pallas", "auto")


def layer_norm(dim: int, *, dtype=jnp.float32, impl: str = "xla", rngs: nnx.Rngs) -> nnx.Module:
    """LayerNorm over the last axis (eps 1e-6), float32 params scale / bias [dim] named ("norm",).

    impl: "xla" (nnx.LayerNorm), "pallas" (PallasLayerNorm: the same parameters, the
    Triton kernels of kernels.layer_norm), "auto" ("pallas" when the default backend is a
    GPU and dim <= kernels.layer_norm.MAX_DIM, else "xla"). Every choice holds the same
    parameter tree, so a checkpoint restores into any.
    """
    if impl not in NORM_IMPLS:
        raise ValueError(f"layer_norm: impl must be one of {NORM_IMPLS}, got {impl!r}")
    if impl == "auto":
        impl = "pallas" if jax.default_backend() == "gpu" and dim <= _NORM_MAX_DIM else "xla"
    if impl == "pallas":
        return PallasLayerNorm(dim, dtype=dtype, rngs=rngs)
    return nnx.LayerNorm(dim, dtype=dtype, param_dtype=jnp.float32, scale_metadata=axes("norm"),
                         bias_metadata=axes("norm"), rngs=rngs)


class PallasLayerNorm(nnx.Module):
    """x [..., dim] -> [..., dim] dtype: nnx.LayerNorm(dim, dtype, eps 1e-6) on kernels.layer_norm.

    Parameters as nnx.LayerNorm's (scale ones, bias zeros, float32 [dim] named ("norm",),
    drawing the same two keys from rngs.params), so checkpoints, parameter counts and
    the other layers' initial values do not change. Like nnx.LayerNorm, x, scale and
    bias are cast to dtype first; the leading axes are flattened into the kernel's T.
    The variance is the two-pass form (kernels.layer_norm: equal to float32 rounding
    where nnx.LayerNorm's E[x^2] - E[x]^2 does not lose it). Runs the Pallas kernels
    (interpret mode off GPU): dim <= kernels.layer_norm.MAX_DIM.
    """

    def __init__(self, dim: int, *, dtype=jnp.float32, rngs: nnx.Rngs):
        if not 1 <= dim <= _NORM_MAX_DIM:
            raise ValueError(f"layer_norm(impl='pallas'): dim must be in [1, {_NORM_MAX_DIM}] "
                             f"(one kernel tile per row), got {dim}")
        self.scale = nnx.Param(nnx.initializers.ones_init()(rngs.params(), (dim,), jnp.float32),
                               **axes("norm"))
        self.bias = nnx.Param(nnx.initializers.zeros_init()(rngs.params(), (dim,), jnp.float32),
                              **axes("norm"))
        self.dim, self.dtype, self.epsilon = dim, dtype, 1e-6

    def __call__(self, x: jax.Array) -> jax.Array:
        if x.shape[-1] != self.dim:
            raise ValueError(f"PallasLayerNorm: x must be [..., {self.dim}], got shape {x.shape}")
        dtype = jnp.dtype(self.dtype)
        y = _layer_norm_op(x.astype(dtype).reshape(-1, self.dim), self.scale[...].astype(dtype),
                          self.bias[...].astype(dtype), eps=self.epsilon, impl="pallas")
        return y.reshape(x.shape)


def rms_norm(dim: int, *, dtype=jnp.float32, rngs: nnx.Rngs) -> nnx.RMSNorm:
    """nnx.RMSNorm over the last axis (eps 1e-6), float32 scale named ("norm",)."""
    return nnx.RMSNorm(dim, dtype=dtype, param_dtype=jnp.float32, scale_metadata=axes("norm"),
                       rngs=rngs)


class ConstantTokens(nnx.Module):
    """dense [B, 0] -> [B, out]: a learned bias broadcast over the batch (zero init).

    The dense projection of a schema with no dense feature: the same output (out float32
    params named ("mlp",)) without the zero-size kernel [0, out] that a checkpoint
    cannot hold.
    """

    def __init__(self, out_features: int, *, dtype=jnp.float32):
        self.bias = param(jnp.zeros((out_features,)), "mlp")
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.broadcast_to(self.bias[...].astype(self.dtype), (x.shape[0],) + self.bias.shape)


def dense_projection(in_features: int, out_features: int, *, dtype=jnp.float32,
                     rngs: nnx.Rngs) -> nnx.Module:
    """[B, in] -> [B, out]: `linear` when in_features > 0, else ConstantTokens."""
    if in_features == 0:
        return ConstantTokens(out_features, dtype=dtype)
    return linear(in_features, out_features, dtype=dtype, rngs=rngs)
