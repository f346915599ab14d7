"""LoRAConfig: the engine-side limits every adapter is checked against."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lora_core.errors import LoRAConfigError

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}

# Ranks beyond this make one slot larger than most base layers; nobody serves them.
MAX_SUPPORTED_RANK = 1024


def resolve_dtype(value: str | torch.dtype, field: str = "dtype") -> torch.dtype:
    """Turn 'bfloat16' / torch.bfloat16 into a torch dtype, or raise LoRAConfigError."""
    if isinstance(value, torch.dtype):
        if value in _DTYPES.values():
            return value
        raise LoRAConfigError(f"{field}: {value} is not one of float32, float16, bfloat16")
    if isinstance(value, str) and value.lower() in _DTYPES:
        return _DTYPES[value.lower()]
    raise LoRAConfigError(f"{field}: {value!r} is not one of float32, float16, bfloat16 (or 'auto')")


@dataclass
class LoRAConfig:
    """Limits of the multi-LoRA engine.

    max_loras: adapters that fit on the GPU at once (GPU slots; also the most
        distinct adapters one batch can mix).
    max_lora_rank: largest rank accepted; slots are sized for it.
    max_cpu_loras: adapters kept in the host LRU (pinned memory); defaults to
        2 x max_loras and may not be smaller than max_loras.
    lora_dtype: dtype of the slot buffers; 'auto' follows the model dtype.
    fully_sharded_loras: shard both A and B over tensor-parallel ranks
        (S-LoRA); otherwise one of the two is replicated.
    bias_enabled: accept adapters that carry a LoRA bias (PEFT lora_bias).
    """

    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_dtype: str | torch.dtype = "auto"
    fully_sharded_loras: bool = False
    bias_enabled: bool = False

    def __post_init__(self) -> None:
        problems: list[str] = []
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"{name} must be a positive integer, got {value!r}")
        if isinstance(self.max_lora_rank, int) and self.max_lora_rank > MAX_SUPPORTED_RANK:
            problems.append(f"max_lora_rank {self.max_lora_rank} exceeds the supported {MAX_SUPPORTED_RANK}")
        if self.max_cpu_loras is None and isinstance(self.max_loras, int):
            self.max_cpu_loras = 2 * self.max_loras
        value = self.max_cpu_loras
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            problems.append(f"max_cpu_loras must be a positive integer, got {value!r}")
        elif isinstance(self.max_loras, int) and value < self.max_loras:
            problems.append(
                f"max_cpu_loras ({value}) must be >= max_loras ({self.max_loras}): "
                "every adapter on the GPU also has a host copy"
            )
        if self.lora_dtype != "auto":
            try:
                self.lora_dtype = resolve_dtype(self.lora_dtype, "lora_dtype")
            except LoRAConfigError as exc:
                problems.append(str(exc))
        for name in ("fully_sharded_loras", "bias_enabled"):
            if not isinstance(getattr(self, name), bool):
                problems.append(f"{name} must be true or false, got {getattr(self, name)!r}")
        if problems:
            raise LoRAConfigError("invalid LoRAConfig: " + "; ".join(problems))

    def slot_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype slot buffers use: lora_dtype, or the model's when 'auto'."""
        return model_dtype if self.lora_dtype == "auto" else self.lora_dtype  # type: ignore[return-value]
