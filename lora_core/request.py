"""LoRARequest: which adapter a generation request wants."""

from __future__ import annotations

from dataclasses import dataclass

from lora_core.errors import LoRAConfigError


@dataclass(frozen=True)
class LoRARequest:
    """An adapter asked for by name, with a stable integer id and where it lives.

    lora_int_id is the key the engine uses for slots and caches; 0 is reserved
    for "no adapter", so ids start at 1. lora_path is a local directory in
    PEFT format (adapter_config.json + adapter_model.safetensors).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise LoRAConfigError(f"LoRARequest.lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise LoRAConfigError(
                f"LoRARequest.lora_int_id must be an integer > 0 (0 means no adapter), got {self.lora_int_id!r}"
            )
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise LoRAConfigError(f"LoRARequest.lora_path is required for adapter {self.lora_name!r}")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id
