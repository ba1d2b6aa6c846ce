"""Multi-domain heads: a shared trunk's features -> per-surface, per-task logits.

    MultiDomainHead(in_features, num_surfaces=S, num_tasks=K)
        h [B, F], surface [B] int -> logits [B, K]   (each sample's own surface)
        .all_logits(h) -> [B, S, K]

Per-surface specialisation, two optional pieces:
  gates   h_s = h * 2 sigmoid(g_s), g_s [F] learned per surface (init 0, so the
          gate starts as the identity): each surface re-weights trunk features.
  towers  "per_surface": one MLP per surface (F -> hidden -> K);
          "shared": one MLP for all surfaces (F -> hidden -> S K).
Every sample's logits come from its own surface's gate and tower; a batch may mix
surfaces freely. Loss and metrics per (surface, task) are the trainer's job:
select with `surface`, mask with label_mask.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from gemjax.layers.axes import param
from gemjax.layers.mlp import MLP

TOWERS = ("per_surface", "shared")


class MultiDomainHead(nnx.Module):
    """See the module docstring. Logits are float32."""

    def __init__(self, in_features: int, *, num_surfaces: int, num_tasks: int,
                 hidden: Sequence[int] = (), towers: str = "per_surface", gates: bool = True,
                 activation: str = "relu", dtype=jnp.float32, rngs: nnx.Rngs):
        if towers not in TOWERS:
            raise ValueError(f"MultiDomainHead: towers must be one of {TOWERS}, got {towers!r}")
        if num_surfaces < 1 or num_tasks < 1:
            raise ValueError(f"MultiDomainHead: num_surfaces={num_surfaces} and "
                             f"num_tasks={num_tasks} must be >= 1")
        self.in_features, self.num_surfaces, self.num_tasks = in_features, num_surfaces, num_tasks
        self.towers, self.dtype = towers, dtype
        self.gate_logits = (param(jnp.zeros((num_surfaces, in_features)), None, "embed")
                            if gates else None)
        if towers == "per_surface":
            self.tower = nnx.List([MLP(in_features, hidden, num_tasks, activation=activation,
                                       dtype=dtype, rngs=rngs) for _ in range(num_surfaces)])
        else:
            self.tower = MLP(in_features, hidden, num_surfaces * num_tasks,
                             activation=activation, dtype=dtype, rngs=rngs)

    def all_logits(self, h: jax.Array) -> jax.Array:
        """h [B, F] -> [B, S, K] float32: every surface's logits for every sample."""
        if h.ndim != 2 or h.shape[1] != self.in_features:
            raise ValueError(f"MultiDomainHead: h must be [B, {self.in_features}], got {h.shape}")
        b, s = h.shape[0], self.num_surfaces
        h = h.astype(self.dtype)
        if self.gate_logits is not None:
            gates = 2.0 * jax.nn.sigmoid(self.gate_logits[...]).astype(self.dtype)   # [S, F]
            hs = h[:, None, :] * gates[None]                                          # [B, S, F]
        else:
            hs = jnp.broadcast_to(h[:, None, :], (b, s, h.shape[1]))
        if self.towers == "per_surface":
            out = jnp.stack([self.tower[i](hs[:, i]) for i in range(s)], axis=1)
        else:
            flat = self.tower(hs.reshape(b * s, -1)).reshape(b, s, s, self.num_tasks)
            out = flat[:, jnp.arange(s), jnp.arange(s)]          # surface i's gate, i's rows
        return out.astype(jnp.float32)

    def __call__(self, h: jax.Array, surface: jax.Array) -> jax.Array:
        """h [B, F], surface [B] int in [0, S) -> logits [B, K] float32.

        A surface outside [0, S) gives NaN logits (cannot pass silently under jit).
        """
        if surface.shape != (h.shape[0],):
            raise ValueError(f"MultiDomainHead: surface must be [B={h.shape[0]}], got {surface.shape}")
        logits = self.all_logits(h)
        surface = surface.astype(jnp.int32)
        ok = (surface >= 0) & (surface < self.num_surfaces)
        idx = jnp.where(ok, surface, 0)
        out = jnp.take_along_axis(logits, idx[:, None, None], axis=1)[:, 0]
        return jnp.where(ok[:, None], out, jnp.nan)
