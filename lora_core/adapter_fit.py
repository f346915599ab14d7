"""AdapterFit: what an adapter must fit to be served by one deployment, as plain data.

The served model's LoRA-able layers (their LoRAModuleSpecs) and the engine's
limits (LoRAConfig). The cluster checks a new adapter against it before the
adapter counts as registered, with the very check the engine's loader runs, so
an adapter that registers is one every replica can load: a rank above
max_lora_rank or a hidden size of another model is refused at load time,
never on its first request. Picklable, so it travels to the adapter tier.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from lora_core.config import LoRAConfig
from lora_core.lora_model import LoRAModel
from lora_core.module_spec import LoRAModuleSpec


@dataclass(frozen=True)
class AdapterFit:
    module_specs: tuple[LoRAModuleSpec, ...]
    lora_config: LoRAConfig

    @classmethod
    def of(cls, module_specs: Iterable[LoRAModuleSpec], lora_config: LoRAConfig) -> "AdapterFit":
        return cls(tuple(module_specs), lora_config)

    def __hash__(self) -> int:  # LoRAConfig is mutable, so the dataclass gives none; the tier keys fetches by fit
        return hash((self.module_specs, tuple(sorted(vars(self.lora_config).items()))))

    @property
    def expected_modules(self) -> list[str]:
        """The PEFT module suffixes this model takes a LoRA on (the engine's loader expects the same)."""
        return sorted({s for spec in self.module_specs for s in spec.peft_suffixes()})

    def check(self, adapter_dir: str | Path) -> LoRAModel:
        """Parse and check the adapter in adapter_dir as the engine will: config against the limits, every
        tensor against its layer. Raises lora_core's InvalidAdapterError subclasses; the model, on success."""
        return LoRAModel.from_local_checkpoint(adapter_dir, self.expected_modules, lora_config=self.lora_config,
                                               module_specs=self.module_specs, copy=False)
