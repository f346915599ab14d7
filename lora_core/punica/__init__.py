"""Punica-style multi-LoRA ops (SGMV shrink/expand) with a plain-torch reference."""

from lora_core.punica.metadata import PunicaMetadata
from lora_core.punica.layouts import StepLayout
from lora_core.punica.wrapper import PunicaWrapper

__all__ = ["PunicaMetadata", "PunicaWrapper", "StepLayout"]
