"""A known structure's values checked in one pass over the file (adapter_checks.data_all_finite): it finds every
NaN and Inf wherever it lies, answers only for files of one float dtype, and a finding still names the tensor."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

import lora_core.adapter_checks as adapter_checks
import lora_core.lora_model as lora_model
from lora_core.adapter_checks import data_all_finite
from lora_core.adapter_structure import AdapterStructures, read_header, uniform_dtype
from lora_core.config import LoRAConfig
from lora_core.demo import ADAPTERS, llama_specs, write_adapter
from lora_core.errors import NonFiniteWeightError
from lora_core.lora_model import WEIGHTS_NAME, LoRAModel

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _file(tmp_path, tensors: dict[str, torch.Tensor]):
    path = tmp_path / f"{len(list(tmp_path.iterdir()))}.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_every_position_of_every_tensor_is_read(tmp_path, monkeypatch, dtype, bad):
    monkeypatch.setattr(adapter_checks, "_FINITE_CHUNK", 7)  # chunk edges fall inside tensors
    shapes = {"a": (3, 5), "b": (4, 1), "c": (2, 9)}
    clean = {k: torch.randn(s).to(dtype) for k, s in shapes.items()}
    assert data_all_finite(_file(tmp_path, clean), dtype) is True
    for key, shape in shapes.items():
        for flat in (0, shape[0] * shape[1] // 2, shape[0] * shape[1] - 1):
            tensors = {k: t.clone() for k, t in clean.items()}
            tensors[key].view(-1)[flat] = bad
            assert data_all_finite(_file(tmp_path, tensors), dtype) is False, (key, flat)


def test_largest_finite_values_and_odd_header_lengths_pass(tmp_path):
    for dtype in DTYPES:
        info = torch.finfo(dtype)
        for pad in range(4):  # key lengths move the data section's start to every offset mod 4
            tensors = {"k" * (pad + 1): torch.tensor([info.max, -info.max, info.tiny, -0.0, 0.0], dtype=dtype)}
            assert data_all_finite(_file(tmp_path, tensors), dtype) is True


def test_only_files_of_one_known_float_dtype_get_one_pass(tmp_path):
    one = _file(tmp_path, {"a": torch.zeros(2, dtype=torch.bfloat16), "b": torch.ones(3, dtype=torch.bfloat16)})
    mixed = _file(tmp_path, {"a": torch.zeros(2, dtype=torch.bfloat16), "b": torch.ones(3, dtype=torch.float32)})
    wide = _file(tmp_path, {"a": torch.zeros(2, dtype=torch.float64)})
    assert uniform_dtype(read_header(one)) == torch.bfloat16
    assert uniform_dtype(read_header(mixed)) is None
    assert uniform_dtype(read_header(wide)) is None and data_all_finite(wide, torch.float64) is None
    assert uniform_dtype(b"not json") is None


def test_a_known_clean_file_skips_the_per_tensor_checks_and_a_nan_is_still_named(tmp_path, monkeypatch):
    specs = llama_specs()
    expected = sorted({s for spec in specs for s in spec.sub_modules})
    config = LoRAConfig(max_loras=2, max_lora_rank=16, lora_dtype="float32")
    fields = ADAPTERS["sql-r8"]

    def load(path, structures):
        return LoRAModel.from_local_checkpoint(path, expected, lora_model_id=1, lora_config=config,
                                               module_specs=specs, copy=False, structures=structures)

    first = write_adapter(tmp_path / "first", fields, seed=1)
    second = write_adapter(tmp_path / "second", fields, seed=2)
    structures = AdapterStructures()
    load(first, structures)
    per_tensor = []
    real = lora_model.value_problems
    monkeypatch.setattr(lora_model, "value_problems", lambda mt, path: per_tensor.append(1) or real(mt, path))
    load(second, structures)
    assert per_tensor == []  # one pass over the file instead

    weights = (second / WEIGHTS_NAME).read_bytes()
    header = 8 + int.from_bytes(weights[:8], "little")
    nan_bits = torch.tensor([float("nan")], dtype=torch.float32).view(torch.uint8).numpy().tobytes()
    (second / WEIGHTS_NAME).write_bytes(weights[:-4] + nan_bits)  # the last element of the last tensor
    assert read_header(second / WEIGHTS_NAME) == read_header(first / WEIGHTS_NAME)
    assert len(weights) > header + 4
    with pytest.raises(NonFiniteWeightError, match="holds 1 NaN"):
        load(second, structures)
    assert per_tensor  # the finding went tensor by tensor, to name the one at fault
