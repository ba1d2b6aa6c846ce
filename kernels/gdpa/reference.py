"""GDPA reference: out = (act(Q K^T) * scale) @ V over jagged samples, plain jnp.

No implicit 1/sqrt(D): `scale` multiplies after the activation (HSTU convention).
Two versions computed in float32:
  gdpa_reference        query-chunked, O(C * Tk) memory (the default CPU path)
  gdpa_reference_dense  one dense [H, Tq, Tk] score matrix (small tests)
"""

import jax
import jax.numpy as jnp

from kernels.common import chunked_reference, pair_mask

ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
    "identity": lambda x: x,
}


def gdpa_reference(q, k, v, q_offsets, kv_offsets, *, activation="silu", scale=1.0,
                   causal=False, window=None, chunk=None):
    """q [Tq,H,D], k/v [Tk,H,D], offsets [B+1] int32 -> [Tq,H,D] in q.dtype.

    Processes `chunk` query rows at a time (default: a [H, C, Tk] f32 block of at
    most 2M elements), rematerialised in the backward pass.
    """
    act = ACTIVATIONS[activation]

    def combine(s, m, vf):
        return jnp.einsum("hqk,khd->qhd", jnp.where(m[None], act(s) * scale, 0.0), vf)

    return chunked_reference(q, k, v, q_offsets, kv_offsets, combine, causal=causal,
                             window=window, chunk=chunk).astype(q.dtype)


def gdpa_reference_dense(q, k, v, q_offsets, kv_offsets, *, activation="silu", scale=1.0,
                         causal=False, window=None):
    """Same contract as gdpa_reference, one dense [H, Tq, Tk] score matrix."""
    act = ACTIVATIONS[activation]
    m = pair_mask(q_offsets, kv_offsets, q.shape[0], k.shape[0], causal, window)
    s = jnp.einsum("qhd,khd->hqk", q.astype(jnp.float32), k.astype(jnp.float32))
    p = jnp.where(m[None], act(s) * scale, 0.0)
    return jnp.einsum("hqk,khd->qhd", p, v.astype(jnp.float32)).astype(q.dtype)
