"""A multimodal model's text model, by name.

Gemma 3 4B-27B (and other models that wrap a language model beside a vision tower) name their text model's
tensors and modules under language_model (transformers v4: "language_model.model.layers...", v5:
"model.language_model.layers...") and their vision tower and projector beside it. A replica serves the text
model: its checkpoint tensors and its adapters' LoRA modules are read under the text model's own names, and
the vision tower's and projector's are left out (they act on images only; an adapter holds LoRAs there
wherever its target_modules matched a vision module too).
"""

from __future__ import annotations

_TEXT_MODEL_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                        ("language_model.lm_head.", "lm_head."))
_IMAGE_ONLY_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                        "model.multi_modal_projector.")


def text_model_name(name: str) -> str:
    """A tensor or module name under a multimodal model's language_model as the text model's own."""
    for prefix, own in _TEXT_MODEL_PREFIXES:
        if name.startswith(prefix):
            return own + name[len(prefix):]
    return name


def image_only(name: str) -> bool:
    """Whether name is a tensor or module of a multimodal model's vision tower or projector."""
    return name.startswith(_IMAGE_ONLY_PREFIXES)
