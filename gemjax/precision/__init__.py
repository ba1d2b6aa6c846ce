"""Low-precision numerics: block-scaled FP8 formats, quantization and the Hadamard transform.

  formats.py   FP8 element formats (E4M3, E5M2: dtype, max finite, mantissa bits) and
               block-scaling layouts (MX 1x32 with E8M0 scales, 1x128 activation tiles,
               128x128 weight blocks, float32 or power-of-two scales)
  quantize.py  BlockScaled (FP8 values + per-block scales + layout) and quantize /
               dequantize with round-to-nearest-even or stochastic rounding
  hadamard.py  blockwise seeded random Hadamard transform and its inverse
  saved.py     8-bit saved activations: a block whose backward keeps its inputs in E4M3
               (the teacher's train.remat "quantize" policy, gemjax.layers.regions)

Pure jnp, jit-able. Models compute in `model.dtype` (float32 or bfloat16;
gemjax.config.ModelConfig); FP8 appears only in what a "quantize" region keeps for its
backward. Imports nothing from gemjax outside this package.
"""
