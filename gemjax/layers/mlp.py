"""Multi-layer perceptron: the dense building block of every GEM tower.

    MLP(in_features, hidden, out_features)  x [..., in_features] -> [..., out_features]

Hidden layers are `Linear -> (LayerNorm) -> activation`; the output layer is a
plain Linear (no norm, no activation), so the caller decides what the output
means (logits, tokens, gates). Parameters are float32; `dtype` is the compute
dtype (bf16 works).
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from gemjax.layers.axes import layer_norm as _layer_norm, linear
from gemjax.layers.regions import tag

ACTIVATIONS: dict[str, Callable] = {
    "relu": jax.nn.relu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "silu": jax.nn.silu,
    "tanh": jnp.tanh,
    "sigmoid": jax.nn.sigmoid,
    "identity": lambda x: x,
}


def activation_fn(name: str) -> Callable:
    """The element-wise activation called `name` (see ACTIVATIONS)."""
    if name not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {name!r}")
    return ACTIVATIONS[name]


class MLP(nnx.Module):
    """x [..., in_features] -> [..., out_features] through `hidden` widths.

    Args:
      in_features: input width.
      hidden: widths of the hidden layers (may be empty: one Linear).
      out_features: output width.
      activation: name from ACTIVATIONS, applied after each hidden layer.
      layer_norm: LayerNorm on each hidden layer's pre-activation.
      use_bias: biases on the Linears.
      dtype: compute dtype (float32 params are cast to it).
    """

    def __init__(self, in_features: int, hidden: Sequence[int], out_features: int, *,
                 activation: str = "relu", layer_norm: bool = False, use_bias: bool = True,
                 dtype=jnp.float32, rngs: nnx.Rngs):
        hidden = tuple(int(h) for h in hidden)
        for name, v in (("in_features", in_features), ("out_features", out_features)):
            if int(v) <= 0:
                raise ValueError(f"MLP: {name} must be > 0, got {v}")
        if any(h <= 0 for h in hidden):
            raise ValueError(f"MLP: hidden widths must be > 0, got {hidden}")
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        self.activation = activation
        self._act = activation_fn(activation)
        self.dtype = dtype
        self.offload_tags = False       # True inside an offloaded block (layers.regions)
        dims = (self.in_features,) + hidden + (self.out_features,)
        # FSDP-friendly names: in -> hidden is ("embed", "mlp"), hidden -> out ("mlp", "embed").
        names = [("embed", "mlp") if i == 0 else ("mlp", "embed") if i == len(dims) - 2
                 else ("mlp", None) for i in range(len(dims) - 1)]
        self.linears = nnx.List([
            linear(a, b, names=nm, use_bias=use_bias, dtype=dtype, rngs=rngs)
            for a, b, nm in zip(dims[:-1], dims[1:], names)])
        self.norms = nnx.List([_layer_norm(h, dtype=dtype, rngs=rngs) for h in hidden]
                              if layer_norm else [])

    def __call__(self, x: jax.Array) -> jax.Array:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"MLP: x last dim {x.shape[-1]} != in_features {self.in_features} "
                             f"(x shape {x.shape})")
        x = x.astype(self.dtype)
        n = len(self.linears)
        for i, lin in enumerate(self.linears):
            x = lin(x)
            if i < n - 1:
                x = tag(x, "mlp.hidden", self.offload_tags)
                if len(self.norms):
                    x = self.norms[i](x)
                x = self._act(x)
        return x
