"""Every user-facing setting has its row in the docs (a field added without one fails here)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from lora_core.config import LoRAConfig
from replicas.engine_args import EngineArgs
from replicas.sampling_params import SamplingParams

DOCS = Path(__file__).resolve().parents[1] / "docs"


def _table_names(page: str) -> set[str]:
    """Names in the first cell of the page's table rows: `a`, or several as `a`, `b`."""
    names: set[str] = set()
    for line in (DOCS / page).read_text().splitlines():
        if line.startswith("| `"):
            names.update(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", line.split("|")[1]))
    return names


@pytest.mark.parametrize("settings, page", [(EngineArgs, "engine.md"), (SamplingParams, "engine.md"),
                                            (LoRAConfig, "lora_core.md")],
                         ids=["EngineArgs", "SamplingParams", "LoRAConfig"])
def test_every_field_has_a_row(settings, page):
    missing = [f.name for f in dataclasses.fields(settings) if f.name not in _table_names(page)]
    assert not missing, f"docs/{page} has no table row for {settings.__name__} fields {missing}"
