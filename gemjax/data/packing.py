"""One host-to-device copy per shard: a batch's leaves packed into one byte buffer.

A device_put of a pytree starts one transfer per leaf, each with its own fixed host
cost; the Feeder instead packs a shard's leaves into one uint8 row (``pack``: every
leaf's bytes end to end, in tree-flatten order), copies that row to the shard's
device, and unpacks the global [num_shards, nbytes] byte array on the mesh with one
jitted function (``Unpacker``: static slices, bitcasts and reshapes inside a
shard_map), giving the arrays a per-leaf copy gives: same dtypes, shapes, sharding
and bits.

Leaves are converted to JAX's canonical dtype first (int64 -> int32 without x64), as
device_put converts them. bool leaves travel as bytes 0 / 1 and come back as
``byte != 0``; 0-size leaves take no bytes.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


class Layout(NamedTuple):
    """Where each leaf lives in a packed row: the tree structure, per leaf (shape,
    dtype name, byte offset), and the row's length in bytes. Hashable: the unpack
    function is cached per Layout."""

    treedef: Any
    leaves: tuple[tuple[tuple[int, ...], str, int], ...]
    nbytes: int


def pack(tree) -> tuple[np.ndarray, Layout]:
    """A pytree of host arrays -> (uint8 [1, nbytes] row, its Layout)."""
    leaves, treedef = jax.tree.flatten(tree)
    arrays, spec, off = [], [], 0
    for x in leaves:
        x = np.asarray(x)
        x = np.ascontiguousarray(x, dtype=jax.dtypes.canonicalize_dtype(x.dtype))
        spec.append((x.shape, x.dtype.name, off))
        if x.size:
            arrays.append(x.reshape(-1).view(np.uint8))
            off += x.nbytes
    row = np.concatenate(arrays) if arrays else np.zeros((0,), np.uint8)
    return row.reshape(1, off), Layout(treedef, tuple(spec), off)


def _unpack_row(row: jax.Array, layout: Layout):
    """uint8 [1, nbytes] -> the pytree `layout` describes (traced; static slices)."""
    out = []
    for shape, name, off in layout.leaves:
        dtype = jnp.dtype(name)
        size = int(np.prod(shape, dtype=np.int64))
        if size == 0:
            out.append(jnp.zeros(shape, dtype))
            continue
        seg = row[0, off:off + size * dtype.itemsize]
        if dtype == jnp.bool_:
            x = seg != 0
        elif dtype.itemsize == 1:
            x = jax.lax.bitcast_convert_type(seg, dtype)
        else:
            x = jax.lax.bitcast_convert_type(seg.reshape(size, dtype.itemsize), dtype)
        out.append(x.reshape(shape))
    return jax.tree.unflatten(layout.treedef, out)


@functools.lru_cache(maxsize=64)
def unpacker(mesh: Mesh, axes: tuple[str, ...], layout: Layout, lead: int = 0):
    """jitted uint8 [num_shards, nbytes] (rows sharded over `axes`) -> the global pytree:
    each leaf [num_shards * rows, ...] sharded over `axes` on its leading axis, each
    device's block unpacked from its own row. lead: leading dims every device holds
    whole (1 for steps stacked [K, rows, ...]: the leaf is [K, num_shards * rows, ...],
    sharded on its second axis)."""
    spec = P(axes)
    out_spec = P(*([None] * lead), axes)
    sharding = NamedSharding(mesh, out_spec)
    body = jax.shard_map(functools.partial(_unpack_row, layout=layout), mesh=mesh,
                         in_specs=spec, out_specs=out_spec, check_vma=False)
    out = jax.tree.unflatten(layout.treedef, [sharding] * len(layout.leaves))
    return jax.jit(body, out_shardings=out)
