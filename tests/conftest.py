"""Test-wide setup.

Without a GPU the Triton kernels run under Triton's interpreter; it must be
switched on before triton.jit decorates them, so here, before any test module
imports lora_core.punica.triton_kernels.

--strict-skips (tests/skip_gate.py; make test passes it) fails a run in which
anything but a gpu-marked test on a CPU-only machine skips.
"""

import os

import pytest
import torch

from tests.skip_gate import GPU_SKIP_REASON, pytest_addoption, pytest_configure  # noqa: F401 - the gate's hooks

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# On a two-core CI machine intra-op threads fight over the small tensors of
# these tests (a softmax took 100x longer with two threads); worker processes
# started by tests inherit the variable.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=GPU_SKIP_REASON)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
