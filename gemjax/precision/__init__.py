"""Low-precision numerics: block-scaled FP8 formats, quantization and the Hadamard transform.

  formats.py   FP8 element formats (E4M3, E5M2: dtype, max finite, mantissa bits) and
               block-scaling layouts (MX 1x32 with E8M0 scales, 1x128 activation tiles,
               128x128 weight blocks, float32 or power-of-two scales)
  quantize.py  BlockScaled (FP8 values + per-block scales + layout) and quantize /
               dequantize with round-to-nearest-even or stochastic rounding
  hadamard.py  blockwise seeded random Hadamard transform and its inverse
  saved.py     8-bit saved activations: a block whose backward keeps its inputs in E4M3
               (the teacher's train.remat "quantize" policy, gemjax.layers.regions)
  gemm.py      fp8_dot: x @ w in FP8 (row-wise or 128-block scales) with its dgrad / wgrad
  delayed.py   fp8_dot_delayed: per-tensor FP8 scales from an amax history of earlier steps
               (the history's cotangent is its update; the train state's "fp8_meta")
  policy.py    which linears of a model run FP8 (regions from ModelConfig.precision, ...)
  fsdp.py      FP8 FSDP all-gather: weights quantized per shard before the collective
               (all_gather_fp8_weight: the train step's gather of FP8 linears' kernels)

Pure jnp / flax, jit-able. A model computes in `model.dtype` (float32 or bfloat16) except
the linears its precision policy puts in FP8 and what a "quantize" region keeps for its
backward. Imports nothing from gemjax outside this package (the layers and models import
it, so it sits below them).
"""
