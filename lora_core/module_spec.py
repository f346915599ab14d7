"""LoRAModuleSpec: what the served model tells lora_core about one LoRA-able layer.

lora_core knows no model. The engine describes each layer that can take a
LoRA (its full name, its kind and its dimensions on this tensor-parallel
rank), and LoRAModelManager sizes GPU slots from those descriptions.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class LoRAKind(str, Enum):
    LINEAR = "linear"        # nn.Linear-like: y = x @ W^T (+ packed slices)
    EMBEDDING = "embedding"  # token lookup: A is a [vocab, r] table
    LOGITS = "logits"        # lm_head: applied to sampled rows (prompt_mapping)


class ShardKind(str, Enum):
    """How the base layer is split over tensor-parallel ranks (Megatron)."""

    REPLICATED = "replicated"
    COLUMN = "column"  # output dim split (qkv, gate_up, lm_head)
    ROW = "row"        # input dim split (o_proj, down_proj)
    VOCAB = "vocab"    # embedding rows split


@dataclass(frozen=True)
class LoRAModuleSpec:
    """One LoRA-able layer.

    name: full module name, e.g. "model.layers.0.self_attn.qkv_proj".
    sub_modules: the PEFT module suffixes packed into it, in output order, e.g.
        ("q_proj", "k_proj", "v_proj"); a plain layer has one.
    in_features / out_slices: full (unsharded) dimensions; out_slices has one
        width per sub-module.
    """

    name: str
    kind: LoRAKind
    in_features: int
    out_slices: tuple[int, ...]
    sub_modules: tuple[str, ...]
    shard: ShardKind = ShardKind.REPLICATED

    def __post_init__(self) -> None:
        if len(self.out_slices) != len(self.sub_modules):
            raise ValueError(f"{self.name}: {len(self.out_slices)} slices for {len(self.sub_modules)} sub-modules")

    @property
    def out_features(self) -> int:
        return sum(self.out_slices)

    @property
    def packed(self) -> bool:
        return len(self.sub_modules) > 1

    def peft_suffixes(self) -> tuple[str, ...]:
        """The module suffixes an adapter may give this layer: its sub-modules, and for a packed layer its own
        name too, which an adapter of a model that stores the layer fused uses (Phi-3's qkv_proj and
        gate_up_proj: one A for all slices, one B across them)."""
        return self.sub_modules + ((self.name.rsplit(".", 1)[-1],) if self.packed else ())

    def sub_module_names(self) -> list[str]:
        """Full PEFT-side names of the packed sub-modules."""
        parent = self.name.rsplit(".", 1)[0] if "." in self.name else ""
        return [f"{parent}.{s}" if parent else s for s in self.sub_modules]
