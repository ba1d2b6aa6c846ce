"""Flax NNX building blocks of the dense model: MLP, Wukong, jagged attention, sequence encoder."""

from gemjax.layers.attention import JaggedSelfAttention, rope
from gemjax.layers.mlp import MLP
from gemjax.layers.sequence import SequenceEncoder, last_tokens, mean_pool
from gemjax.layers.wukong import Wukong, WukongLayer

__all__ = ["JaggedSelfAttention", "MLP", "SequenceEncoder", "Wukong", "WukongLayer",
           "last_tokens", "mean_pool", "rope"]
