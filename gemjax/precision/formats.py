"""FP8 element formats and block-scaling layouts.

An `Fp8Format` describes one 8-bit float element type (its jnp dtype, largest finite
value, mantissa bits, smallest normal exponent); a `Layout` describes how a tensor is cut
into blocks that share one scale, and how that scale is stored:

  MX            1x32 blocks along the last axis, scales stored as E8M0 (powers of two)
  ACT_1X128     1x128 activation tiles along the last axis, float32 scales
  WEIGHT_128X128  128x128 blocks over the last two axes, float32 scales
  (`Layout(block=..., scale="pow2")` keeps power-of-two scales in float32.)

A tensor quantizes as x ~= q * scale, with q in the format's range and one scale per block.
"""

import dataclasses

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Fp8Format:
    """An 8-bit float element format.

    dtype: the jnp dtype holding the quantized values.
    max_finite: the largest finite magnitude (448 for E4M3, 57344 for E5M2).
    mantissa_bits: stored mantissa bits (3 for E4M3, 2 for E5M2).
    min_normal_exp: exponent of the smallest normal, 2**min_normal_exp (-6, -14); below
      it values are subnormal, spaced 2**(min_normal_exp - mantissa_bits) apart.
    has_inf: whether the format encodes +-inf (E5M2 does, E4M3FN does not).
    """
    name: str
    dtype: jnp.dtype
    max_finite: float
    mantissa_bits: int
    min_normal_exp: int
    has_inf: bool


E4M3 = Fp8Format("e4m3", jnp.dtype(jnp.float8_e4m3fn), 448.0, 3, -6, False)
E5M2 = Fp8Format("e5m2", jnp.dtype(jnp.float8_e5m2), 57344.0, 2, -14, True)
FORMATS = {f.name: f for f in (E4M3, E5M2)}

# Exponent range of a power-of-two scale: 2**-126 .. 2**127. E8M0 also encodes 2**-127,
# a float32 subnormal, which XLA may flush to zero; so the smallest scale is 2**-126.
POW2_MIN_EXP, POW2_MAX_EXP = -126, 127
SCALE_KINDS = ("f32", "pow2", "e8m0")


@dataclasses.dataclass(frozen=True)
class Layout:
    """Blocks sharing one scale, and the scale's kind.

    block: (rows, cols) of a block over the last two axes of a tensor; rows == 1 blocks
      along the last axis only (any rank >= 1), rows > 1 needs rank >= 2.
    scale: "f32" (amax / max_finite, in float32), "pow2" (the smallest power of two not
      below amax / max_finite, in float32) or "e8m0" (the same power of two, stored as
      float8_e8m0fnu).
    """
    block: tuple[int, int]
    scale: str

    def __post_init__(self):
        rows, cols = self.block
        if rows < 1 or cols < 1:
            raise ValueError(f"Layout.block must be positive, got {self.block}")
        if self.scale not in SCALE_KINDS:
            raise ValueError(f"Layout.scale must be one of {SCALE_KINDS}, got {self.scale!r}")

    @property
    def scale_dtype(self) -> jnp.dtype:
        return jnp.dtype(jnp.float8_e8m0fnu if self.scale == "e8m0" else jnp.float32)


MX = Layout(block=(1, 32), scale="e8m0")
ACT_1X128 = Layout(block=(1, 128), scale="f32")
WEIGHT_128X128 = Layout(block=(128, 128), scale="f32")
