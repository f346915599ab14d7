"""Test-wide setup.

Without a GPU the Triton kernels run under Triton's interpreter; it must be
switched on before triton.jit decorates them, so here, before any test module
imports lora_core.punica.triton_kernels.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
