"""Punica-style multi-LoRA ops (SGMV shrink/expand) with a plain-torch reference."""

from lora_core.punica.metadata import PunicaMetadata
from lora_core.punica.wrapper import PunicaWrapper, StepLayout

__all__ = ["PunicaMetadata", "PunicaWrapper", "StepLayout"]
