"""Phi-3 (Phi-3-mini/medium 4k, Phi-4): the Llama computation over a checkpoint with fused projections.

HF's Phi3ForCausalLM stores ``self_attn.qkv_proj`` as one [q_size + 2 * kv_size, hidden] tensor (rows q, k, v)
and ``mlp.gate_up_proj`` as one [2 * intermediate, hidden] tensor (gate rows, then up: Phi3MLP chunks its output
gate first). Our packed layers hold the same rows, but at tensor parallelism each rank holds its own heads' slice
of q, of k and of v (and its slice of gate and of up), not a slice of the fused tensor: the loader splits the
fused tensors back into the pieces a Llama checkpoint has, and each layer cuts its shard of every piece.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

from replicas.loader import CheckpointError
from replicas.models.llama import LlamaForCausalLM

Weights = Iterable[tuple[str, torch.Tensor]]


class Phi3ForCausalLM(LlamaForCausalLM):
    """LlamaForCausalLM loading Phi-3's fused qkv_proj / gate_up_proj checkpoint tensors."""

    def load_weights(self, weights: Weights) -> set[str]:
        """As LlamaForCausalLM.load_weights; a fused tensor whose rows do not add up raises CheckpointError."""
        return super().load_weights(self._unfused(weights))

    def _unfused(self, weights: Weights) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield each fused tensor as its q/k/v or gate/up pieces (row views, no copies), under Llama's names."""
        cfg = self.config
        q, kv, inter = (cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim,
                        cfg.intermediate_size)
        fused = {".qkv_proj.": ((".q_proj.", q), (".k_proj.", kv), (".v_proj.", kv)),
                 ".gate_up_proj.": ((".gate_proj.", inter), (".up_proj.", inter))}
        for name, tensor in weights:
            packed = next((p for p in fused if p in name), None)
            if packed is None:
                yield name, tensor
                continue
            names, rows = zip(*fused[packed])
            if name.endswith("_scale") and tensor.numel() == 1:  # an FP8 scale for the fused tensor: each piece's
                for sub in names:
                    yield name.replace(packed, sub), tensor
                continue
            if tensor.shape[0] != sum(rows):
                raise CheckpointError(f"{name}: {tensor.shape[0]} rows, expected {' + '.join(map(str, rows))} "
                                      f"({', '.join(n.strip('.') for n in names)}) from config.json")
            for sub, piece in zip(names, tensor.split(rows)):
                yield name.replace(packed, sub), piece
