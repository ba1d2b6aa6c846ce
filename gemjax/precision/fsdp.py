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

In the train step (gemjax.train.step, model.precision.gather) a sharded kernel of an FP8 linear
goes through `all_gather_fp8_weight` instead, called inside the step's shard_map:

    w_full = all_gather_fp8_weight(w_shard, WeightGather(axes, dim, block, fmt, dtype))

It quantizes w_shard (cast to the GEMM's input dtype) with the scales the FP8 GEMM itself
takes for the whole weight: blocks `block` over the whole [R, C] (`weight_block`: the
recipe's forward weight blocks; a block may span shards, so each device reduces its part
of every block's amax and a pmax over `axes` completes them, an all-reduce of the
[ceil(R/br), ceil(C/bc)] amax grid), all-gathers the FP8 bits (1 byte per element) and
dequantizes with the (replicated) scales into w_shard's dtype. The FP8 GEMM that reads
the result quantizes it again to the same values and scales (a dequantized value divided
by its own block's scale rounds back to itself), so the step computes what gathering
w_shard in its own dtype and quantizing in the GEMM would, up to float rounding of the
scales. Its backward is the gather's: the cotangent of the whole weight (high precision)
reduce-scattered over `axes` onto the shard (the straight-through gradient of the
quantization).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from gemjax.precision.formats import FORMATS, WEIGHT_128X128, Layout
from gemjax.precision.gemm import Recipe, _operand_blocks
from gemjax.precision.quantize import (BlockScaled, dequantize, expand_scales, finite_abs,
                                       quantize, saturate, scales_from_amax, to_format)


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


def weight_block(recipe: Recipe, shape: tuple[int, int]) -> tuple[int, int]:
    """The blocks over a weight [K, N] of `shape` that fp8_dot's forward quantizes it in
    under `recipe`: rowwise (K, 1), tensor (K, N), blocked (128, 128)."""
    k, n = shape
    return _operand_blocks(1, k, n, recipe.scaling, True)[1]


@dataclasses.dataclass(frozen=True)
class WeightGather:
    """How all_gather_fp8_weight gathers one weight [R, C] (hashable: a static argument).

    axes: the mesh axes its dim `dim` (0 or 1) is sharded over, in the PartitionSpec's
      order; block: (br, bc) quantization blocks over the whole weight; fmt: FP8 format
      name; dtype: the dtype quantized from (w cast to it first: the GEMM's input dtype).
    """
    axes: tuple[str, ...]
    dim: int
    block: tuple[int, int]
    fmt: str = "e4m3"
    dtype: str = "float32"

    @property
    def axis_name(self):
        return self.axes[0] if len(self.axes) == 1 else self.axes


def _grid_amax(t32: jax.Array, block: tuple[int, int], g: WeightGather) -> jax.Array:
    """Block amax of the whole weight, from shard t32 [r, c] (sharded dim first, blocks in
    that order): float32 [ceil(r * n / br), ceil(c / bc)], the same on every device."""
    rows, cols = t32.shape
    br, bc = block
    n = jax.lax.axis_size(g.axis_name)
    mag = jnp.pad(finite_abs(t32), ((0, 0), (0, -cols % bc)))
    # chunks of c rows never straddle a block (c divides the shard's offset and br), so the
    # scatter into the block grid moves rows / c partial rows (one, when the shard is aligned)
    c = math.gcd(rows, br)
    mag = jnp.max(mag.reshape(rows // c, c, -1, bc), axis=(1, 3))      # [r / c, Cb]
    at = jax.lax.axis_index(g.axis_name) * rows + c * jnp.arange(rows // c)  # first rows
    part = jax.ops.segment_max(mag, at // br, num_segments=-(-rows * n // br),
                               indices_are_sorted=True)
    return jax.lax.pmax(jnp.maximum(part, 0.0), g.axis_name)          # empty blocks: 0


def _gather_fp8_weight(ws: jax.Array, g: WeightGather) -> jax.Array:
    f = FORMATS[g.fmt]
    t32 = ws.astype(g.dtype).astype(jnp.float32)
    block = g.block
    if g.dim == 1:                               # sharded dim first
        t32, block = t32.T, block[::-1]
    layout = Layout(block=block, scale="f32")
    scales = scales_from_amax(_grid_amax(t32, block, g), layout, f)     # whole weight's grid
    rows, cols = t32.shape
    rows_at = jax.lax.axis_index(g.axis_name) * rows + jnp.arange(rows)
    s = jnp.take(scales, rows_at // block[0], axis=0)                   # [r, Cb]
    s = jnp.repeat(s, block[1], axis=1, total_repeat_length=s.shape[1] * block[1])[:, :cols]
    q = to_format(t32, saturate(t32, s, f), f)
    if g.dim == 1:                               # back to ws's layout
        q, scales, layout = q.T, scales.T, Layout(block=g.block, scale="f32")
    bits = jax.lax.bitcast_convert_type(q, jnp.uint8)
    bits = jax.lax.all_gather(bits, g.axis_name, axis=g.dim, tiled=True)    # [R, C]
    q = jax.lax.optimization_barrier(jax.lax.bitcast_convert_type(bits, f.dtype))
    return (q.astype(jnp.float32) * expand_scales(scales, layout, q.shape)).astype(ws.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def all_gather_fp8_weight(ws: jax.Array, g: WeightGather) -> jax.Array:
    """Inside a shard_map: shard ws [R / n, C] (dim 0) or [R, C / n] (dim 1) -> the whole
    weight [R, C] in ws.dtype, gathered as FP8 bits with scales of the whole weight's
    blocks (module docstring). Gradient: the cotangent reduce-scattered onto the shard."""
    return _gather_fp8_weight(ws, g)


def _all_gather_fp8_weight_fwd(ws, g):
    return _gather_fp8_weight(ws, g), None


def _all_gather_fp8_weight_bwd(g, _, ct):
    return (jax.lax.psum_scatter(ct, g.axis_name, scatter_dimension=g.dim, tiled=True),)


all_gather_fp8_weight.defvjp(_all_gather_fp8_weight_fwd, _all_gather_fp8_weight_bwd)


_BYTES = {"f8e4m3fn": 1, "f8e5m2": 1, "f8e8m0fnu": 1, "bf16": 2, "f16": 2, "f32": 4, "s32": 4,
          "u32": 4, "u16": 2, "s16": 2, "f64": 8, "s8": 1, "u8": 1, "pred": 1, "s64": 8}
_GATHER = re.compile(r"= (\(?[^=]*?\)?) all-gather(?:-start)?\(")
_TYPE = re.compile(r"\b([a-z]+[0-9a-z]*)\[([0-9,]*)\]")


def all_gather_bytes(hlo_text: str, group_size: int, dtypes=None) -> int:
    """Sum over the all-gathers (and all-gather-starts) of a compiled HLO module's text of
    their operands' bytes per device: each result's bytes / group_size (the compiled text
    names operands without their types). dtypes: count only results of these HLO element
    types (e.g. {"u8"}); None: all. KeyError on an element type not in the table."""
    total = 0
    for m in _GATHER.finditer(hlo_text):
        for dtype, dims in _TYPE.findall(m.group(1)):
            if dtypes is not None and dtype not in dtypes:
                continue
            size = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
            total += _BYTES[dtype] * size
    if total % group_size:
        raise ValueError(f"all-gather results of {total} bytes do not split over {group_size}")
    return total // group_size
