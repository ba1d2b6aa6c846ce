"""GDPA reference: out = (act(Q K^T) * scale) @ V over jagged samples, plain jnp."""

import jax
import jax.numpy as jnp

from kernels.common import pair_mask

ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
    "identity": lambda x: x,
}


def gdpa_reference(q, k, v, q_offsets, kv_offsets, *, activation="silu", scale=1.0,
                   causal=False, window=None):
    """q [Tq,H,D], k/v [Tk,H,D] -> [Tq,H,D] in q.dtype; computed in float32."""
    act = ACTIVATIONS[activation]
    m = pair_mask(q_offsets, kv_offsets, q.shape[0], k.shape[0], causal, window)
    s = jnp.einsum("qhd,khd->hqk", q.astype(jnp.float32), k.astype(jnp.float32))
    p = jnp.where(m[None], act(s) * scale, 0.0)
    return jnp.einsum("hqk,khd->qhd", p, v.astype(jnp.float32)).astype(q.dtype)
