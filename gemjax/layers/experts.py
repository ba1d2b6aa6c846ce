"""Mixture of Wukong experts with a top-k router (GEM's Wukong MoE).

    WukongExperts(num_tokens, dim, num_experts=E, top_k=k, ...)
        x [B, n, d] -> (y [B, n_out, d], aux)

Routing is per sample (a sample's n feature tokens travel together):
    probs  = softmax(flatten(x) W_r)                                 [B, E] (f32)
    top-k experts per sample, gates = their probs renormalised to sum to 1
    y_b    = sum over the sample's kept experts e of gate_be * Wukong_e(x_b)

Experts are E identical Wukong stacks whose parameters are stacked on a leading
axis named "expert" (nnx.vmap), so gemjax.parallel.rules can shard them over the
`expert` mesh axis. Dispatch is capacity based: every expert takes at most
C = ceil(capacity_factor * k * B / E) samples (capacity_factor=None: C = B, no
sample is ever dropped), gathered into an [E, C, n, d] buffer, run by a vmap
over experts, and scattered back weighted by the gates. Assignments past an
expert's capacity are dropped (earlier samples first); the fraction dropped is
reported in aux, never silent, and a sample with every choice dropped gets y = 0.

Expert parallelism (EP). Inside `jax.shard_map`, a caller that keeps each device's
expert parameters as its local shard [E/ep, ...] along a manual mesh axis (the
trainer, gemjax.train.step, for the axis the rules put on the "expert" dim) says so on
the model it merged there:

    set_mesh_axes(model, expert_axes="expert")   # the mesh axis (or tuple of axes) of size ep
    y, aux = experts(x)                          # x: this device's [B_local, n, d]

and the layer exchanges tokens instead of running every expert on its own samples:
route locally (router replicated) -> [E, C, n, d] -> reshape [ep, E/ep, C, n, d] ->
all_to_all over the axis -> this device's E/ep experts run on [E/ep, ep*C, n, d]
(its ep peers' slots side by side) -> all_to_all back -> combine with the gates.
ep must divide E and the expert params must have leading dim E/ep (ValueError
otherwise); expert axes outside shard_map are an error. Without expert axes nothing
changes (plain single-device use, or shard_map with gathered experts).
Gradients: the all_to_all transposes route activation cotangents back to the
sample's device, and each expert shard's gradient already sums every token it
served, so the caller must not psum expert grads over the EP axis (it still sums
them over the other batch axes).

Capacity under EP: C = expert_capacity(B_local, ...) is per (source device, expert),
and an expert receives ep*C slots. A device's assignments past C are dropped even
when a peer left slots empty, so per expert kept = sum_dev min(n_dev,e, C_local)
rather than the global path's min(sum_dev n_dev,e, C_global): equal when no
device overflows; more drops when one device's samples crowd an expert (ceil
rounding of C_local can also keep a few more). Drops happen per device and are
counted in aux["dropped_fraction"] (this shard's, or the global batch's with
batch axes, below); the routing is the same per-shard routing as the non-EP
path under shard_map, so EP and gathered experts give identical outputs and drops.

aux (all f32 scalars except expert_load):
  load_balance_loss  E * sum_e f_e P_e  (Switch Transformer, top-k form):
                     f_e = share of the B k assignments routed to e, P_e = mean
                     router prob of e; 1.0 when perfectly balanced.
  router_z_loss      mean(logsumexp(logits)^2), keeps router logits small.
  dropped_fraction   dropped assignments / (B k).
  expert_load        [E] f_e.

Global figures under a sharded batch. Inside `jax.shard_map` the layer sees only
this device's B_local samples, and f_e P_e summed per shard is not the global
loss (a product of means is not a mean of products). A caller that runs the
model per batch shard says over which manual mesh axes the batch is split:

    set_mesh_axes(model, batch_axes=("replica", "fsdp", "expert"))  # the trainer: every mesh axis
    y, aux = experts(x)

and route_top_k psums its per-shard sums (assignment counts [E], router prob sums
[E], sum of logsumexp^2, kept assignments) over those axes and divides by the
global counts (B = N B_local, N the product of the axes' sizes), so every aux
figure equals the one-device value on the whole batch, identical on each shard.
The routing itself (top-k, capacity queues, drops) stays per shard: drops depend
on C_local = expert_capacity(B_local) exactly as described above (none with
capacity_factor None, the default). Without batch axes aux is the shard's own.

Gradient of a global aux. With the trainer's shard_map(check_vma=False) the
transpose of psum is psum: a cotangent c placed on the global aux on each of the
N shards reaches every shard's local sums as N c. A caller that adds coef * aux
to its loss on every shard (models.interformer.attach_aux_loss) must therefore
weight it by `aux_loss_scale(local, batch_axes)` = 1/N, so the parameters get d(coef * aux)
once in total (under check_vma=True the batch axes are typed as varying, psum
transposes to pvary, and the scale is 1).
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from gemjax.layers.axes import linear
from gemjax.layers.wukong import Wukong
from gemjax.parallel.rules import with_logical_constraint

_EXPERT_AXIS = {nnx.PARTITION_NAME: "expert"}
def _axis_tuple(axis_name, who: str) -> tuple[str, ...]:
    axes = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    if not axes or not all(isinstance(a, str) for a in axes):
        raise ValueError(f"{who}: axis_name must be a mesh axis name or a tuple of them, "
                         f"got {axis_name!r}")
    return axes


def set_mesh_axes(model: nnx.Module, *, expert_axes: str | Sequence[str] | None = None,
                  batch_axes: str | Sequence[str] | None = None) -> nnx.Module:
    """Tell every WukongExperts in `model` (and any module with these attributes, such as
    a teacher that scales its aux loss) the manual shard_map axes it runs under; returns
    `model`. Call it on the model merged inside the shard_map, before the forward.

    expert_axes: the mesh axis (or tuple of axes, their product ep, device order
      row-major as in a PartitionSpec) the experts exchange tokens over; the expert
      params must be the local shard [E/ep, ...] of it. None: every expert runs here.
    batch_axes: the axes the batch is split over (each device an equal B_local share):
      the router's aux figures are global over them. None: the shard's own.
    See the module docstring.
    """
    attrs = {}
    if expert_axes is not None:
        attrs["expert_axes"] = _axis_tuple(expert_axes, "expert_axes")
    if batch_axes is not None:
        attrs["batch_axes"] = _axis_tuple(batch_axes, "batch_axes")
    if attrs:
        model.set_attributes(raise_if_not_found=False, **attrs)
    return model


def _manual_axes_size(axes: tuple[str, ...], who: str) -> int:
    """Product of `axes`' sizes; they must be manual axes of the current shard_map."""
    mesh = jax.sharding.get_abstract_mesh()
    live = mesh is not None and not mesh.empty
    names = mesh.axis_names if live else ()
    manual = {n for n, t in zip(names, mesh.axis_types if live else ())
              if t == jax.sharding.AxisType.Manual}
    missing = [a for a in axes if a not in manual]
    if missing:
        raise ValueError(f"{who}({axes}): axes {missing} are not manual axes of an "
                         f"enclosing jax.shard_map (mesh axes {names}); it works only inside "
                         f"shard_map")
    return math.prod(mesh.shape[a] for a in axes)


def aux_loss_scale(local: jax.Array, batch_axes: Sequence[str] = ()) -> float:
    """Per-shard weight of a global aux loss whose gradient every shard injects.

    1.0 without batch_axes (the manual axes the batch is split over, `set_mesh_axes`).
    With them, 1 / (product of the sizes of the batch axes along which psum transposes
    to psum): the axes `local` (any per-shard array of this shard_map, e.g. the logits)
    is not typed as varying along, i.e. all of them under check_vma=False (the trainer),
    none under check_vma=True. See "Gradient of a global aux" in the module docstring.
    """
    axes = tuple(batch_axes)
    if not axes:
        return 1.0
    _manual_axes_size(axes, "batch_axes")
    mat = getattr(jax.typeof(local), "manual_axis_type", None)
    varying = getattr(mat, "varying", frozenset()) or frozenset()
    summed = tuple(a for a in axes if a not in varying)
    mesh = jax.sharding.get_abstract_mesh()
    return 1.0 / math.prod(mesh.shape[a] for a in summed)


def _constrain(x: jax.Array, names) -> jax.Array:
    """Logical sharding constraint, skipped inside shard_map (manual mesh axes), where
    the caller already owns the layout (the trainer runs the model per batch shard)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is not None and not mesh.empty and any(
            t == jax.sharding.AxisType.Manual for t in mesh.axis_types):
        return x
    return with_logical_constraint(x, names)


def expert_capacity(batch: int, num_experts: int, top_k: int,
                    capacity_factor: float | None) -> int:
    """Samples per expert: B when capacity_factor is None, else ceil(cf k B / E) <= B."""
    if capacity_factor is None:
        return batch
    if capacity_factor <= 0:
        raise ValueError(f"capacity_factor must be > 0 or None, got {capacity_factor}")
    return max(1, min(batch, math.ceil(capacity_factor * top_k * batch / num_experts)))


def route_top_k(logits: jax.Array, top_k: int, capacity: int,
                batch_axes: Sequence[str] = ()):
    """Top-k routing with per-expert capacity.

    logits [B, E] -> (dispatch_index [E, C] int32 sample ids (B = empty slot),
    combine [E, C] f32 gates, aux dict). Pure function; see the module docstring.
    batch_axes: manual shard_map axes the batch is split over (logits is this
    shard's [B_local, E]); aux is then the global figures (psum over them).
    """
    b, e = logits.shape
    batch_axes = tuple(batch_axes)
    n_shards = _manual_axes_size(batch_axes, "batch_axes") if batch_axes else 1

    def total(x):                                     # sum over the batch shards
        return jax.lax.psum(x, batch_axes) if batch_axes else x

    logits = logits.astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    top_p, top_i = jax.lax.top_k(probs, top_k)                            # [B, k]
    gates = top_p / jnp.sum(top_p, axis=-1, keepdims=True)
    onehot = jax.nn.one_hot(top_i, e, dtype=jnp.int32)                    # [B, k, E]
    sel = jnp.sum(onehot, axis=1)                                         # [B, E] 0/1
    gate_be = jnp.sum(onehot * gates[..., None], axis=1)                  # [B, E]
    pos = jnp.cumsum(sel, axis=0) - 1                                     # queue slot
    keep = (sel > 0) & (pos < capacity)
    rows = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, e))
    cols = jnp.broadcast_to(jnp.arange(e, dtype=jnp.int32)[None, :], (b, e))
    slot = jnp.where(keep, pos, capacity)                                 # C = trash slot
    index = jnp.full((e, capacity + 1), b, jnp.int32).at[cols, slot].set(rows)[:, :capacity]
    combine = jnp.zeros((e, capacity + 1), jnp.float32).at[cols, slot].set(
        jnp.where(keep, gate_be, 0.0))[:, :capacity]
    b_all = b * n_shards                                                  # global batch
    load = total(jnp.sum(sel, axis=0)).astype(jnp.float32) / (b_all * top_k)   # f_e [E]
    mean_prob = total(jnp.sum(probs, axis=0)) / b_all                     # P_e [E]
    z_sum = total(jnp.sum(jax.nn.logsumexp(logits, axis=-1) ** 2))
    kept = total(jnp.sum(keep, dtype=jnp.int32)).astype(jnp.float32)
    aux = {
        "load_balance_loss": e * jnp.sum(load * mean_prob),
        "router_z_loss": z_sum / b_all,
        "dropped_fraction": 1.0 - kept / (b_all * top_k),
        "expert_load": load,
    }
    return index, combine, aux


class WukongExperts(nnx.Module):
    """x [B, num_tokens, dim] -> (y [B, out_tokens, dim], aux); see the module docstring.

    Args:
      num_tokens, dim: input tokens n and width d.
      num_experts: E (>= 1); top_k: experts per sample (1 <= k <= E).
      capacity_factor: None (no drops) or > 0.
      num_layers, fmb_tokens, lcb_tokens, rank, mlp_hidden, cross_layer_attention,
        cross_layer_heads: each expert's Wukong.
      dtype: compute dtype; params float32.
    """

    def __init__(self, num_tokens: int, dim: int, *, num_experts: int, top_k: int,
                 num_layers: int, fmb_tokens: int, lcb_tokens: int, rank: int,
                 mlp_hidden: Sequence[int] = (), cross_layer_attention: bool = False,
                 cross_layer_heads: int = 1, capacity_factor: float | None = None,
                 dtype=jnp.float32, rngs: nnx.Rngs):
        if num_experts < 1 or not 1 <= top_k <= num_experts:
            raise ValueError(f"WukongExperts: need 1 <= top_k={top_k} <= num_experts={num_experts}")
        if capacity_factor is not None and capacity_factor <= 0:
            raise ValueError(f"WukongExperts: capacity_factor must be > 0 or None, "
                             f"got {capacity_factor}")
        self.num_tokens, self.dim = int(num_tokens), int(dim)
        self.num_experts, self.top_k, self.capacity_factor = num_experts, top_k, capacity_factor
        self.out_tokens = int(fmb_tokens) + int(lcb_tokens)
        self.dtype = dtype
        # the manual shard_map axes of the forward (set_mesh_axes): EP and the global aux
        self.expert_axes: tuple[str, ...] | None = None
        self.batch_axes: tuple[str, ...] = ()
        self.router = linear(self.num_tokens * self.dim, num_experts, names=("embed", None),
                             dtype=jnp.float32, rngs=rngs)

        @nnx.split_rngs(splits=num_experts)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata=_EXPERT_AXIS)
        def make(r):
            return Wukong(num_tokens, dim, num_layers=num_layers, fmb_tokens=fmb_tokens,
                          lcb_tokens=lcb_tokens, rank=rank, mlp_hidden=mlp_hidden,
                          cross_layer_attention=cross_layer_attention,
                          cross_layer_heads=cross_layer_heads, dtype=dtype, rngs=r)

        self.experts = make(rngs)

    def __call__(self, x: jax.Array):
        if x.ndim != 3 or x.shape[1:] != (self.num_tokens, self.dim):
            raise ValueError(f"WukongExperts: x must be [B, {self.num_tokens}, {self.dim}], "
                             f"got {x.shape}")
        b = x.shape[0]
        cap = expert_capacity(b, self.num_experts, self.top_k, self.capacity_factor)
        logits = self.router(x.reshape(b, -1).astype(jnp.float32))
        index, combine, aux = route_top_k(logits, self.top_k, cap, self.batch_axes)
        xpad = jnp.concatenate([x.astype(self.dtype), jnp.zeros((1,) + x.shape[1:], self.dtype)])
        xin = _constrain(jnp.take(xpad, index, axis=0),                    # [E, C, n, d]
                         ("expert", "batch", None, None))

        @nnx.vmap(in_axes=(0, 0), out_axes=0, transform_metadata=_EXPERT_AXIS)
        def run(expert, xe):
            return expert(xe)

        ep_axes = self.expert_axes
        if ep_axes is None:
            yout = run(self.experts, xin)                                  # [E, C, n_out, d]
        else:
            yout = self._exchange_and_run(run, xin, ep_axes)
        yout = _constrain(yout, ("expert", "batch", None, None))
        weighted = yout.astype(jnp.float32) * combine[..., None, None]
        y = jnp.zeros((b + 1,) + yout.shape[2:], jnp.float32).at[index].add(weighted)[:b]
        return y.astype(self.dtype), aux

    def _exchange_and_run(self, run, xin: jax.Array, axes: tuple[str, ...]) -> jax.Array:
        """EP: xin [E, C, n, d] (slots for every expert) -> yout [E, C, n_out, d] via
        all_to_all over `axes`, this device's E/ep experts run on [E/ep, ep*C, n, d]."""
        ep, e = _manual_axes_size(axes, "expert_axes"), self.num_experts
        if e % ep:
            raise ValueError(f"WukongExperts: expert_axes {axes} (ep={ep}) must divide "
                             f"num_experts={e}")
        local = {int(v.shape[0]) for v in jax.tree.leaves(nnx.state(self.experts, nnx.Param))}
        if local != {e // ep}:
            raise ValueError(f"WukongExperts: with expert_axes {axes} (ep={ep}) the expert "
                             f"params must be local shards with leading dim E/ep={e // ep}, got "
                             f"leading dims {sorted(local)}")
        cap, rest = xin.shape[1], xin.shape[2:]
        send = xin.reshape((ep, e // ep, cap) + rest)              # [ep dst, E/ep, C, n, d]
        recv = jax.lax.all_to_all(send, axes, 0, 0, tiled=True)     # [ep src, E/ep, C, n, d]
        xe = jnp.swapaxes(recv, 0, 1).reshape((e // ep, ep * cap) + rest)
        ye = run(self.experts, xe)                                  # [E/ep, ep*C, n_out, d]
        back = jnp.swapaxes(ye.reshape((e // ep, ep, cap) + ye.shape[2:]), 0, 1)
        yout = jax.lax.all_to_all(back, axes, 0, 0, tiled=True)     # [ep owner, E/ep, C, ...]
        return yout.reshape((e, cap) + ye.shape[2:])
