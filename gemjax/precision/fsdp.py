"""FP8 FSDP all-gather: a sharded weight is quantized per shard, then gathered as 8 bits.

    w_full = gather_fp8(w, mesh, axis="fsdp", dim=0)     # w sharded on `dim` over `axis`

Inside one shard_map over `axis`, each device quantizes its own shard w_i [..., K/n, ...]
to FP8 (128x128 blocks over the last two axes, float32 scales: gemjax.precision.quantize,
layout WEIGHT_128X128 by default), all-gathers the FP8 values (tiled along `dim`) and the
per-shard block scales, and dequantizes every shard with its own scales into `dtype`. So
the collective carries 1 byte per weight element plus 4 bytes per 128x128 block, against
2 bytes per element for a BF16 gather (`gather_dense` here, the same gather without the
quantization). The result is replicated over `axis`; it equals the concatenation of the
shards' dequantized values (ragged blocks inside a shard are padded there).

The FP8 values travel as their uint8 bits (the same bytes; XLA:CPU has no FP8 collective
and would widen an FP8 all-gather to f16). all_gather_bytes(hlo_text, n) sums the operand
bytes of every all-gather of a compiled HLO module, the figure the test compares.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from gemjax.precision.formats import FORMATS, WEIGHT_128X128, Layout
from gemjax.precision.quantize import BlockScaled, dequantize, quantize


def _spec(ndim: int, dim: int, axis: str) -> P:
    parts: list = [None] * ndim
    parts[dim] = axis
    return P(*parts)


def _check(w: jax.Array, mesh: Mesh, axis: str, dim: int) -> int:
    if axis not in mesh.shape:
        raise ValueError(f"gather_fp8: mesh has no axis {axis!r} (axes {tuple(mesh.shape)})")
    if not -w.ndim <= dim < w.ndim:
        raise ValueError(f"gather_fp8: dim={dim} out of range for w of shape {w.shape}")
    dim %= w.ndim
    n = mesh.shape[axis]
    if w.shape[dim] % n:
        raise ValueError(f"gather_fp8: w.shape[{dim}]={w.shape[dim]} is not a multiple of the "
                         f"{n} devices of mesh axis {axis!r}")
    return dim


def gather_fp8(w: jax.Array, mesh: Mesh, axis: str, dim: int = 0, *, fmt: str = "e4m3",
               layout: Layout = WEIGHT_128X128, dtype=jnp.bfloat16) -> jax.Array:
    """w [..., R, C] (rank >= 2) sharded along `dim` over mesh axis `axis` -> the whole w in
    `dtype`, replicated over `axis`, gathered as FP8 values + per-shard block scales."""
    dim = _check(w, mesh, axis, dim)
    if w.ndim < 2:
        raise ValueError(f"gather_fp8: w must have rank >= 2, got shape {w.shape}")
    n = mesh.shape[axis]
    f = FORMATS[fmt]

    def local(ws):
        bs = quantize(ws, layout, f)
        # gathered as their bits (uint8): a backend without FP8 collectives (XLA:CPU)
        # would otherwise widen the payload to f16 around the all-gather
        bits = jax.lax.bitcast_convert_type(bs.q, jnp.uint8)
        bits = jax.lax.all_gather(bits, axis, axis=dim, tiled=False)      # n inserted at dim
        q = jax.lax.bitcast_convert_type(bits, f.dtype)
        s = jax.lax.all_gather(bs.scales, axis, axis=0, tiled=False)       # [n, ...scales]
        shards = jax.vmap(lambda qi, si: dequantize(BlockScaled(qi, si, layout, f), dtype),
                          in_axes=(dim, 0), out_axes=dim)(q, s)
        shape = list(ws.shape)
        shape[dim] *= n
        return shards.reshape(shape)

    return jax.shard_map(local, mesh=mesh, in_specs=_spec(w.ndim, dim, axis),
                         out_specs=P(), check_vma=False)(w)


def gather_dense(w: jax.Array, mesh: Mesh, axis: str, dim: int = 0,
                 dtype=jnp.bfloat16) -> jax.Array:
    """The same gather of w cast to `dtype` (the BF16 baseline of gather_fp8)."""
    dim = _check(w, mesh, axis, dim)
    bits = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[jnp.dtype(dtype).itemsize]

    def local(ws):       # as bits, like gather_fp8 (XLA:CPU widens a bf16 all-gather to f32)
        b = jax.lax.bitcast_convert_type(ws.astype(dtype), bits)
        return jax.lax.bitcast_convert_type(jax.lax.all_gather(b, axis, axis=dim, tiled=True), dtype)

    return jax.shard_map(local, mesh=mesh, in_specs=_spec(w.ndim, dim, axis), out_specs=P(),
                         check_vma=False)(w)


_BYTES = {"f8e4m3fn": 1, "f8e5m2": 1, "f8e8m0fnu": 1, "bf16": 2, "f16": 2, "f32": 4, "s32": 4,
          "u32": 4, "u16": 2, "s16": 2, "f64": 8, "s8": 1, "u8": 1, "pred": 1, "s64": 8}
_GATHER = re.compile(r"= (\(?[^=]*?\)?) all-gather(?:-start)?\(")
_TYPE = re.compile(r"\b([a-z]+[0-9a-z]*)\[([0-9,]*)\]")


def all_gather_bytes(hlo_text: str, group_size: int) -> int:
    """Sum over the all-gathers (and all-gather-starts) of a compiled HLO module's text of
    their operands' bytes per device: each result's bytes / group_size (the compiled text
    names operands without their types). KeyError on an element type not in the table."""
    total = 0
    for m in _GATHER.finditer(hlo_text):
        for dtype, dims in _TYPE.findall(m.group(1)):
            size = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
            total += _BYTES[dtype] * size
    if total % group_size:
        raise ValueError(f"all-gather results of {total} bytes do not split over {group_size}")
    return total // group_size
