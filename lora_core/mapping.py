"""LoRAMapping: which adapter each token and each prompt of a batch uses."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRAMapping:
    """Adapter ids for one model step.

    index_mapping: one lora_int_id per token of the flattened batch (0 = base
        model); drives every LoRA linear and the embedding.
    prompt_mapping: one lora_int_id per row that reaches the LM head (the
        sampled positions: one per sequence, or every prompt token when prompt
        logprobs are asked for); drives add_lora_logits.
    is_prefill: the step holds prompt segments (SGMV shapes) rather than one
        token per sequence (BGMV shapes); it only selects kernel tile sizes.
    """

    index_mapping: tuple[int, ...]
    prompt_mapping: tuple[int, ...]
    is_prefill: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "index_mapping", tuple(int(i) for i in self.index_mapping))
        object.__setattr__(self, "prompt_mapping", tuple(int(i) for i in self.prompt_mapping))
        for name in ("index_mapping", "prompt_mapping"):
            if any(i < 0 for i in getattr(self, name)):
                raise ValueError(f"LoRAMapping.{name}: ids must be >= 0 (0 = no adapter)")

    @property
    def num_tokens(self) -> int:
        return len(self.index_mapping)

    def active_ids(self) -> set[int]:
        """Adapter ids used by this step (0 excluded)."""
        return {i for i in (*self.index_mapping, *self.prompt_mapping) if i}
