"""LoRA on the model's tensor-parallel layers, through lora_core's PunicaWrapper.

``add_lora(model, ...)`` replaces every LoRA-able layer (packed qkv_proj and
gate_up_proj, o_proj, down_proj, embed_tokens, lm_head) with a wrapper that
runs the base layer and adds the whole mixed batch's LoRA in a few launches.
The wrappers read the slot buffers of a LoRAModelManager and the per-step
metadata of one PunicaWrapper shared by all layers.

Tensor parallelism (design.md). Without fully_sharded_loras, column layers
replicate A and split B like the base output; row layers split A like the
input and replicate B, each rank adding its partial LoRA before the base
all-reduce: no extra collective. With it, nothing is replicated: column
layers all-gather the [S, T, r/tp] shrink buffer, row layers all-reduce the
[T, r] one and expand into their slice of the output.
"""

from __future__ import annotations

import torch
from torch import nn

from lora_core.config import LoRAConfig
from lora_core.errors import LoRAConfigError
from lora_core.model_manager import LoRAModelManager
from lora_core.module_spec import LoRAKind, LoRAModuleSpec, ShardKind
from lora_core.punica import PunicaWrapper
from replicas.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from replicas.layers.linear import ColumnParallelLinear, RowParallelLinear


class _LoRAWrapper(nn.Module):
    """Holds the base layer; attributes it lacks come from the base layer."""

    def __init__(self, base: nn.Module, spec: LoRAModuleSpec, manager: LoRAModelManager,
                 punica: PunicaWrapper, fully_sharded: bool) -> None:
        super().__init__()
        self.base = base
        self.spec = spec
        self.manager = manager
        self.punica = punica
        self.sharded = fully_sharded and base.tp_size > 1

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["base"], name)

    @property
    def slots(self):
        return self.manager.buffers(self.spec.name)

    def _shrink_gathered(self, x: torch.Tensor, meta) -> torch.Tensor:
        """Fully-sharded column layers: [S, T, r/tp] on each rank -> [S, T, r] everywhere."""
        b = self.slots
        buf = torch.zeros(b.lora_a.shape[0], x.shape[0], b.lora_a.shape[2], dtype=torch.float32, device=x.device)
        self.punica.add_shrink(buf, x, b.lora_a, 1.0, b.ranks, meta=meta)
        return self.base.ctx.all_gather(buf, dim=-1)

    def _linear_with_lora(self, x: torch.Tensor) -> torch.Tensor:
        """base_forward(x) plus this layer's LoRA, added in place (not fully sharded)."""
        b = self.slots
        y = self.base.base_forward(x)
        self.punica.add_lora_linear(y, x, b.lora_a, b.lora_b, b.bias, 1.0, b.output_slices, b.ranks)
        return y


class ColumnParallelLinearWithLoRA(_LoRAWrapper):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.punica.token_meta.num_adapters:
            return self.base.base_forward(x)
        if not self.sharded:
            return self._linear_with_lora(x)
        y = self.base.base_forward(x)
        b = self.slots
        self.punica.add_expand(y, self._shrink_gathered(x, None), b.lora_b, b.output_slices,
                               ranks=b.ranks, lora_bias_stacked=b.bias)
        return y


class RowParallelLinearWithLoRA(_LoRAWrapper):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # y is this rank's partial sum, before the all-reduce: its LoRA joins it there.
        if not self.punica.token_meta.num_adapters:
            return self.base.reduce(self.base.base_forward(x))
        if not self.sharded:
            return self.base.reduce(self._linear_with_lora(x))
        y = self.base.base_forward(x)
        b = self.slots
        buf = torch.zeros(1, x.shape[0], b.lora_a.shape[2], dtype=torch.float32, device=x.device)
        self.punica.add_shrink(buf, x, b.lora_a, 1.0, b.ranks)
        self.base.ctx.all_reduce(buf)
        width = b.output_slices[0]
        self.punica.add_expand(y, buf, b.lora_b, (width,), offset_start=self.base.tp_rank * width,
                               ranks=b.ranks, lora_bias_stacked=b.bias)
        return self.base.reduce(y)


class VocabParallelEmbeddingWithLoRA(_LoRAWrapper):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        y = self.base.base_forward(ids)
        if self.punica.token_meta.num_adapters:
            b = self.slots
            # Ids outside this rank's rows add nothing here; their owner adds them.
            self.punica.add_lora_embedding(y, ids - self.base.vocab_start_index, b.lora_a, b.lora_b, b.ranks)
        return self.base.reduce(y)


class ParallelLMHeadWithLoRA(_LoRAWrapper):
    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.base.base_forward(hidden)
        meta = self.punica.sampler_meta
        if meta.num_adapters:
            b = self.slots
            local = logits[:, : b.output_slices[0]]
            if self.sharded:
                self.punica.add_expand(local, self._shrink_gathered(hidden, meta), b.lora_b, b.output_slices,
                                       ranks=b.ranks, meta=meta)
            else:
                self.punica.add_lora_logits(local, hidden, b.lora_a, b.lora_b, 1.0, b.ranks)
        return self.base.gather(logits)


def lora_module_specs(model: nn.Module) -> list[LoRAModuleSpec]:
    """Describe every LoRA-able layer of ``model`` (full, unsharded dims) for LoRAModelManager."""
    packed = getattr(model, "packed_modules_mapping", {})
    specs = []
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, ColumnParallelLinear):
            subs = tuple(packed.get(leaf, [leaf]))
            specs.append(LoRAModuleSpec(name, LoRAKind.LINEAR, module.input_size, module.output_sizes, subs,
                                        ShardKind.COLUMN))
        elif isinstance(module, RowParallelLinear):
            specs.append(LoRAModuleSpec(name, LoRAKind.LINEAR, module.input_size, module.output_sizes, (leaf,),
                                        ShardKind.ROW))
        elif isinstance(module, VocabParallelEmbedding):
            specs.append(LoRAModuleSpec(name, LoRAKind.EMBEDDING, module.num_embeddings,
                                        (module.embedding_dim,), (leaf,), ShardKind.VOCAB))
        elif isinstance(module, ParallelLMHead):
            specs.append(LoRAModuleSpec(name, LoRAKind.LOGITS, module.embedding_dim, (module.num_embeddings,),
                                        (leaf,), ShardKind.COLUMN))
    return specs


_WRAPPERS = {LoRAKind.EMBEDDING: VocabParallelEmbeddingWithLoRA, LoRAKind.LOGITS: ParallelLMHeadWithLoRA}


def add_lora(model: nn.Module, manager: LoRAModelManager, punica: PunicaWrapper,
             lora_config: LoRAConfig) -> list[LoRAModuleSpec]:
    """Wrap every layer the manager has slots for; call after the base weights are loaded."""
    config = getattr(model, "config", None)
    tp_size = getattr(getattr(model, "ctx", None), "tp_size", 1)
    if config is not None and tp_size > config.num_key_value_heads:
        raise LoRAConfigError(f"LoRA with tensor_parallel_size {tp_size} > {config.num_key_value_heads} kv heads "
                              "(replicated k/v projections) is not supported yet")
    for spec in manager.specs.values():
        parent_name, _, leaf = spec.name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        base = getattr(parent, leaf)
        cls = _WRAPPERS.get(spec.kind) or (RowParallelLinearWithLoRA if spec.shard is ShardKind.ROW
                                           else ColumnParallelLinearWithLoRA)
        setattr(parent, leaf, cls(base, spec, manager, punica, lora_config.fully_sharded_loras))
    return list(manager.specs.values())
