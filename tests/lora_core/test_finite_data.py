"""A known structure's values checked in one pass over the file (adapter_checks.data_all_finite): it finds every
NaN and Inf wherever it lies, answers only for files of one float dtype, and a finding still names the tensor."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

import lora_core.adapter_checks as adapter_checks
import lora_core.lora_model as lora_model
from lora_core.adapter_checks import data_all_finite
from lora_core.adapter_structure import AdapterStructures, ModuleKeys, read_header, value_layout
from lora_core.config import LoRAConfig
from lora_core.demo import ADAPTERS, llama_specs, write_adapter
from lora_core.errors import NonFiniteWeightError
from lora_core.lora_model import WEIGHTS_NAME, LoRAModel

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _finite(path, dtype, spans=None):
    return data_all_finite(path, 8 + len(read_header(path)), dtype, spans)


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
    assert _finite(_file(tmp_path, clean), dtype) is True
    for key, shape in shapes.items():
        for flat in (0, shape[0] * shape[1] // 2, shape[0] * shape[1] - 1):
            tensors = {k: t.clone() for k, t in clean.items()}
            tensors[key].view(-1)[flat] = bad
            assert _finite(_file(tmp_path, tensors), dtype) is False, (key, flat)


def test_largest_finite_values_and_odd_header_lengths_pass(tmp_path):
    for dtype in DTYPES:
        info = torch.finfo(dtype)
        for pad in range(4):  # key lengths move the data section's start to every offset mod 4
            tensors = {"k" * (pad + 1): torch.tensor([info.max, -info.max, info.tiny, -0.0, 0.0], dtype=dtype)}
            assert _finite(_file(tmp_path, tensors), dtype) is True


def test_only_files_of_one_known_float_dtype_get_one_pass(tmp_path):
    one = _file(tmp_path, {"a": torch.zeros(2, dtype=torch.bfloat16), "b": torch.ones(3, dtype=torch.bfloat16)})
    mixed = _file(tmp_path, {"a": torch.zeros(2, dtype=torch.bfloat16), "b": torch.ones(3, dtype=torch.float32)})
    wide = _file(tmp_path, {"a": torch.zeros(2, dtype=torch.float64)})
    module = {"m": ModuleKeys("a", "b", None, False)}
    assert value_layout(read_header(one), module) == (torch.bfloat16, {"m": (0, 10)})
    assert value_layout(read_header(mixed), module)[0] is None
    assert value_layout(read_header(wide), {"m": ModuleKeys("a", "a", None, False)})[0] is None
    assert _finite(wide, torch.float64) is None
    assert value_layout(b"not json", module) == (None, {})
    assert value_layout(read_header(one), {"m": ModuleKeys("a", "missing", None, False)}) == (None, {})


def test_spans_read_only_their_bytes(tmp_path, monkeypatch):
    """A part's check reads its modules' byte ranges: a NaN outside them is not its to find, one inside is."""
    monkeypatch.setattr(adapter_checks, "_FINITE_CHUNK", 3)
    tensors = {k: torch.randn(4, 3).to(torch.bfloat16) for k in ("a", "b", "c", "d")}  # 24 bytes each, in key order
    tensors["c"][1, 2] = float("nan")
    path = _file(tmp_path, tensors)
    assert _finite(path, torch.bfloat16) is False
    assert _finite(path, torch.bfloat16, [(0, 24), (24, 48), (72, 96)]) is True  # a, b (joined), d
    assert _finite(path, torch.bfloat16, [(72, 96), (48, 72)]) is False  # c, out of order
    assert _finite(path, torch.bfloat16, []) is True
    assert _finite(path, torch.bfloat16, [(0, 4096)]) is None  # past the file: the caller checks per tensor
    assert adapter_checks._merged([(48, 72), (0, 24), (24, 48), (10, 20)]) == [(0, 72)]


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


def test_a_part_checks_its_own_layers_in_one_pass(tmp_path, monkeypatch):
    """Split loads (load_parts.py) of a known structure: each part finds a NaN in its own layers, naming the tensor,
    and passes over one in another part's."""
    specs = llama_specs()
    expected = sorted({s for spec in specs for s in spec.sub_modules})
    config = LoRAConfig(max_loras=2, max_lora_rank=16, lora_dtype="float32")
    fields = ADAPTERS["sql-r8"]

    def load(path, structures, part):
        return LoRAModel.from_local_checkpoint(path, expected, lora_model_id=1, lora_config=config,
                                               module_specs=specs, copy=False, structures=structures, part=part)

    first = write_adapter(tmp_path / "first", fields, seed=1)
    structures = AdapterStructures()
    load(first, structures, None)
    tensors = load_file(str(first / WEIGHTS_NAME))
    key = next(k for k in tensors if ".layers.1." in k and "lora_A" in k)
    tensors[key].view(-1)[-1] = float("inf")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text((first / "adapter_config.json").read_text())
    save_file(tensors, str(bad / WEIGHTS_NAME), metadata={"format": "pt"})
    per_tensor = []
    real = lora_model.value_problems
    monkeypatch.setattr(lora_model, "value_problems", lambda mt, path: per_tensor.append(1) or real(mt, path))
    assert load(bad, structures, (0, 2)).rank == 8  # layer 1 is part 1's
    assert per_tensor == []
    with pytest.raises(NonFiniteWeightError, match=key.replace(".", "[.]")):
        load(bad, structures, (1, 2))
