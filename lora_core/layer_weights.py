"""LoRALayerWeights: one adapter's A and B for one module.

Layout follows the seed: ``lora_a`` is [in, r] and ``lora_b`` is [r, out], so
``x @ lora_a @ lora_b * scaling`` is the module's LoRA output and
``compute_delta_weight()`` is the [in, out] update to the base weight's
transpose. For an embedding, ``in`` is the vocabulary: ``lora_a`` is a lookup
table [vocab, r].
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LoRALayerWeights:
    module_name: str
    rank: int
    lora_alpha: float
    lora_a: torch.Tensor  # [in, r]
    lora_b: torch.Tensor  # [r, out]
    scaling: float
    bias: torch.Tensor | None = None  # [out], PEFT lora_bias (already scaled once optimized)
    is_embedding: bool = False

    @property
    def input_dim(self) -> int:
        return self.lora_a.shape[0]

    @property
    def output_dim(self) -> int:
        return self.lora_b.shape[1]

    @property
    def is_packed(self) -> bool:
        return False

    def compute_delta_weight(self) -> torch.Tensor:
        """The [in, out] update this adapter adds to the module's weight."""
        a = self.lora_a.float()
        b = self.lora_b.float()
        return (a @ b) * self.scaling

    def optimize(self) -> "LoRALayerWeights":
        """Fold the scaling into B so kernels run with scale 1.0. Idempotent."""
        if self.scaling != 1.0:
            self.lora_b = self.lora_b * self.scaling
            if self.bias is not None:
                self.bias = self.bias * self.scaling
            self.scaling = 1.0
        return self

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None,
           pin_memory: bool = False) -> "LoRALayerWeights":
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            t = t.to(device=device, dtype=dtype)
            return t.pin_memory() if pin_memory and t.device.type == "cpu" else t

        self.lora_a = move(self.lora_a)
        self.lora_b = move(self.lora_b)
        self.bias = move(self.bias)
        return self

    def num_bytes(self) -> int:
        total = self.lora_a.numel() * self.lora_a.element_size() + self.lora_b.numel() * self.lora_b.element_size()
        if self.bias is not None:
            total += self.bias.numel() * self.bias.element_size()
        return total


@dataclass
class PackedLoRALayerWeights:
    """LoRA for a merged module (qkv_proj, gate_up_proj): one entry per sub-module.

    A sub-module the adapter does not target is None; its output slice gets no
    update. Sub-modules may have different ranks (PEFT rank_pattern).
    """

    module_name: str
    sub_modules: tuple[str, ...]
    output_slices: tuple[int, ...]
    loras: list[LoRALayerWeights | None] = field(default_factory=list)

    @classmethod
    def pack(cls, module_name: str, sub_modules: tuple[str, ...], output_slices: tuple[int, ...],
             loras: list[LoRALayerWeights | None]) -> "PackedLoRALayerWeights":
        if len(loras) != len(sub_modules) or len(output_slices) != len(sub_modules):
            raise ValueError(f"{module_name}: {len(loras)} loras for {len(sub_modules)} sub-modules")
        return cls(module_name, tuple(sub_modules), tuple(output_slices), list(loras))

    @property
    def is_packed(self) -> bool:
        return True

    @property
    def rank(self) -> int:
        return max((l.rank for l in self.loras if l is not None), default=0)

    @property
    def input_dim(self) -> int:
        return next(l.input_dim for l in self.loras if l is not None)

    @property
    def output_dim(self) -> int:
        return sum(self.output_slices)

    def compute_delta_weight(self) -> torch.Tensor:
        """The [in, sum(out)] update; untargeted slices are zero."""
        parts = []
        for lora, width in zip(self.loras, self.output_slices):
            if lora is None:
                parts.append(torch.zeros(self.input_dim, width))
            else:
                parts.append(lora.compute_delta_weight())
        return torch.cat(parts, dim=1)

    def optimize(self) -> "PackedLoRALayerWeights":
        for lora in self.loras:
            if lora is not None:
                lora.optimize()
        return self

    def num_bytes(self) -> int:
        return sum(l.num_bytes() for l in self.loras if l is not None)
