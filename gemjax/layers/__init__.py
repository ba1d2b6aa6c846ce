"""Flax NNX building blocks of the dense model.

mlp (MLP), wukong (Wukong, cross-layer attention), experts (mixture of Wukong
experts), attention (jagged self/cross attention through kernels/), sequence
(SequenceEncoder, pooling), interformer (Cross / Interaction / Sequence Arch),
heads (multi-domain per-surface, per-task logits), pyramid (pyramid-parallel
sequence encoding), regions (activation-checkpointing regions and their policies),
axes (logical sharding names on parameters), inputs (where a batch's features become
tokens).
"""

from gemjax.layers.attention import (JaggedCrossAttention, JaggedSelfAttention,
                                     TokenCrossAttention, rope, uniform_offsets)
from gemjax.layers.experts import WukongExperts
from gemjax.layers.heads import MultiDomainHead
from gemjax.layers.interformer import CrossArch, Gating, InterFormer, InterFormerLayer
from gemjax.layers.mlp import MLP
from gemjax.layers.pyramid import ParallelPyramid, PyramidEncoder, PyramidLevel, concat_jagged
from gemjax.layers.sequence import SequenceEncoder, last_tokens, mean_pool
from gemjax.layers.wukong import Wukong, WukongLayer

__all__ = ["CrossArch", "Gating", "InterFormer", "InterFormerLayer", "JaggedCrossAttention",
           "JaggedSelfAttention", "MLP", "MultiDomainHead", "ParallelPyramid",
           "PyramidEncoder", "PyramidLevel", "concat_jagged", "SequenceEncoder", "TokenCrossAttention", "Wukong",
           "WukongExperts", "WukongLayer", "last_tokens", "mean_pool", "rope", "uniform_offsets"]
