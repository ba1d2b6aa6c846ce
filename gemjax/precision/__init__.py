"""Reserved for low-precision training (block-scaled FP8 matmuls and their scaling recipes).

It holds no code yet: every model computes in `model.dtype` (float32 or bfloat16, with
float32 parameters; gemjax.config.ModelConfig), embedding tables are stored in float32 or
bfloat16 (gemjax.sparse.TableSpec.dtype) with the sparse optimizers' math in float32, and
the attention kernels compute in the dtype of their inputs.
"""
