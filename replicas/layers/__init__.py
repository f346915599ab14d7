"""Tensor-parallel building blocks of the model: linear, embedding, rotary, norm."""

from replicas.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from replicas.layers.linear import (ColumnParallelLinear, LinearBase, MergedColumnParallelLinear, QKVParallelLinear,
                                    RowParallelLinear, forward_pending)
from replicas.layers.norm import GeluTanhAndMul, RMSNorm, SiluAndMul
from replicas.layers.rotary import RotaryEmbedding, rope_inv_freq

__all__ = ["ColumnParallelLinear", "GeluTanhAndMul", "LinearBase", "MergedColumnParallelLinear", "ParallelLMHead",
           "QKVParallelLinear", "RMSNorm", "RotaryEmbedding", "RowParallelLinear", "SiluAndMul",
           "VocabParallelEmbedding", "forward_pending", "rope_inv_freq"]
