"""Bad adapters: each is refused with its typed error, naming the file and the field."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lora_core.config import LoRAConfig
from lora_core.errors import (
    AdapterFileMissingError,
    AdapterShapeError,
    CorruptAdapterError,
    InvalidAdapterError,
    MultipleAdapterProblems,
    NonFiniteWeightError,
    RankTooLargeError,
    UnknownTargetModuleError,
    UnsafeAdapterFormatError,
    UnsupportedAdapterError,
)
from lora_core.lora_model import LoRAModel

WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"
Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
Q_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


@pytest.fixture(scope="module")
def good_adapter(make_peft_adapter) -> Path:
    path, _ = make_peft_adapter(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"])
    return path


@pytest.fixture
def adapter(good_adapter, tmp_path) -> Path:
    """A private copy of the good adapter for a test to break."""
    return Path(shutil.copytree(good_adapter, tmp_path / "adapter"))


@pytest.fixture
def load(expected_lora_modules, llama_module_specs):
    def load(path: Path, **kwargs) -> LoRAModel:
        kwargs.setdefault("lora_config", LoRAConfig(max_lora_rank=16))
        kwargs.setdefault("module_specs", llama_module_specs)
        return LoRAModel.from_local_checkpoint(path, expected_lora_modules, **kwargs)
    return load


def _edit_config(path: Path, **changes) -> None:
    data = json.loads((path / CONFIG).read_text())
    data.update(changes)
    (path / CONFIG).write_text(json.dumps(data))


def _edit_tensors(path: Path, edit) -> None:
    tensors = load_file(path / WEIGHTS)
    edit(tensors)
    save_file(tensors, path / WEIGHTS)


def _raises(error: type, load, path: Path, file: str, field: str | None, **kwargs) -> InvalidAdapterError:
    with pytest.raises(error) as info:
        load(path, **kwargs)
    exc = info.value
    assert exc.path == str(path / file)
    assert exc.field == field
    assert str(path / file) in str(exc) and (field is None or field in str(exc))
    return exc


def test_good_adapter_loads(load, adapter):
    assert load(adapter).rank == 8


def test_no_config(load, adapter):
    (adapter / CONFIG).unlink()
    _raises(AdapterFileMissingError, load, adapter, CONFIG, None)


def test_bad_json(load, adapter):
    (adapter / CONFIG).write_text('{"r": 8, "lora_alpha": ')
    exc = _raises(CorruptAdapterError, load, adapter, CONFIG, None)
    assert "not valid JSON" in str(exc)


def test_wrong_field_type(load, adapter):
    _edit_config(adapter, r="8")
    _raises(CorruptAdapterError, load, adapter, CONFIG, "r")


def test_no_weights(load, adapter):
    (adapter / WEIGHTS).unlink()
    _raises(AdapterFileMissingError, load, adapter, WEIGHTS, None)


def test_pickle_weights_refused_and_never_unpickled(load, adapter, monkeypatch):
    torch.save(load_file(adapter / WEIGHTS), adapter / "adapter_model.bin")
    (adapter / WEIGHTS).unlink()

    def forbidden(*args, **kwargs):
        pytest.fail("the loader unpickled an untrusted file")

    monkeypatch.setattr(torch, "load", forbidden)
    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(pickle, "loads", forbidden)
    monkeypatch.setattr(pickle, "Unpickler", forbidden)
    exc = _raises(UnsafeAdapterFormatError, load, adapter, "adapter_model.bin", None)
    assert "arbitrary code" in str(exc) and "safetensors" in str(exc)


def test_truncated_safetensors(load, adapter):
    data = (adapter / WEIGHTS).read_bytes()
    (adapter / WEIGHTS).write_bytes(data[: len(data) // 2])
    _raises(CorruptAdapterError, load, adapter, WEIGHTS, None)


def test_garbage_safetensors(load, adapter):
    (adapter / WEIGHTS).write_bytes(b"\x13\x37 this is not a safetensors file " * 64)
    _raises(CorruptAdapterError, load, adapter, WEIGHTS, None)


def test_shape_does_not_fit_module(load, adapter):
    # Consistent rank, but q_proj's output is 64 wide, not 72.
    _edit_tensors(adapter, lambda t: t.__setitem__(Q_B, torch.randn(72, 8)))
    exc = _raises(AdapterShapeError, load, adapter, WEIGHTS, Q_B)
    assert "out_features=64" in str(exc)


def test_input_dim_does_not_fit_module(load, adapter):
    _edit_tensors(adapter, lambda t: t.__setitem__(Q_A, torch.randn(8, 48)))
    exc = _raises(AdapterShapeError, load, adapter, WEIGHTS, Q_A)
    assert "in_features=64" in str(exc)


def test_rank_mismatch_between_a_and_b(load, adapter):
    _edit_tensors(adapter, lambda t: t.__setitem__(Q_B, torch.randn(64, 4)))
    _raises(AdapterShapeError, load, adapter, WEIGHTS, Q_B)


def test_rank_mismatch_with_config(load, adapter):
    def shrink(t):
        t[Q_A], t[Q_B] = t[Q_A][:4].clone(), t[Q_B][:, :4].clone()
    _edit_tensors(adapter, shrink)
    exc = _raises(AdapterShapeError, load, adapter, WEIGHTS, Q_A)
    assert "r=8" in str(exc) and CONFIG in str(exc)


def test_a_without_b(load, adapter):
    _edit_tensors(adapter, lambda t: t.pop(Q_B))
    exc = _raises(CorruptAdapterError, load, adapter, WEIGHTS, Q_A)
    assert "lora_B" in str(exc)


def test_module_the_model_does_not_have(load, adapter):
    def rename(t):
        for key in [k for k in t if ".q_proj." in k]:
            t[key.replace(".q_proj.", ".rotary_proj.")] = t.pop(key)
    _edit_tensors(adapter, rename)
    _edit_config(adapter, target_modules=["q_proj", "v_proj", "down_proj"])
    with pytest.raises(MultipleAdapterProblems) as info:
        load(adapter)
    problems = info.value.problems
    assert all(isinstance(p, UnknownTargetModuleError) for p in problems)
    assert {p.field for p in problems} == {Q_A.replace(".q_proj.", ".rotary_proj."),
                                           Q_A.replace(".q_proj.", ".rotary_proj.").replace("layers.0", "layers.1")}
    assert "rotary_proj" in str(info.value) and str(adapter / WEIGHTS) in str(info.value)


def test_target_modules_the_model_does_not_have(load, adapter):
    _edit_config(adapter, target_modules=["q_proj", "v_proj", "down_proj", "rotary_proj"])
    exc = _raises(UnknownTargetModuleError, load, adapter, CONFIG, "target_modules")
    assert "rotary_proj" in str(exc)


def test_layer_the_model_does_not_have(load, adapter):
    """The suffix is known, but the served model has 2 layers, not 8 (caught through module_specs)."""
    def rename(t):
        for key in [k for k in t if ".layers.1." in k]:
            t[key.replace(".layers.1.", ".layers.7.")] = t.pop(key)
    _edit_tensors(adapter, rename)
    with pytest.raises(MultipleAdapterProblems) as info:
        load(adapter)
    assert all(isinstance(p, UnknownTargetModuleError) and ".layers.7." in p.field for p in info.value.problems)


def test_weights_outside_layers_to_transform(load, adapter):
    """An adapter that says it reaches layer 1 only but holds layer 0's weights too is inconsistent: refused,
    naming each tensor outside; the same file saying layer 0 and 1 loads."""
    _edit_config(adapter, layers_to_transform=[1])
    with pytest.raises(MultipleAdapterProblems) as info:
        load(adapter)
    assert {p.field for p in info.value.problems} == {Q_A, Q_A.replace("q_proj", "v_proj"),
                                                      Q_A.replace("self_attn.q_proj", "mlp.down_proj")}
    assert all(isinstance(p, UnknownTargetModuleError) and "layers_to_transform" in str(p)
               for p in info.value.problems)
    _edit_config(adapter, layers_to_transform=[0, 1])
    assert len(load(adapter).loras) == 6


def test_rank_above_max(load, adapter):
    exc = _raises(RankTooLargeError, load, adapter, CONFIG, "r", lora_config=LoRAConfig(max_lora_rank=4))
    assert "max_lora_rank=4" in str(exc)


@pytest.mark.parametrize("alpha", [0, -8])
def test_alpha_not_positive(load, adapter, alpha):
    _edit_config(adapter, lora_alpha=alpha)
    _raises(CorruptAdapterError, load, adapter, CONFIG, "lora_alpha")


def test_dora_refused(load, make_peft_adapter):
    path, _ = make_peft_adapter(r=4, lora_alpha=8, use_dora=True, target_modules=["q_proj"])
    assert any("lora_magnitude_vector" in k for k in load_file(path / WEIGHTS))
    exc = _raises(UnsupportedAdapterError, load, path, CONFIG, "use_dora")
    assert "DoRA" in str(exc)


def test_dora_tensors_without_dora_config(load, make_peft_adapter):
    path, _ = make_peft_adapter(r=4, lora_alpha=8, use_dora=True, target_modules=["q_proj"])
    _edit_config(path, use_dora=False)
    with pytest.raises(MultipleAdapterProblems) as info:
        load(path)
    assert all(isinstance(p, UnsupportedAdapterError) and "DoRA" in str(p) for p in info.value.problems)


def test_lora_bias_needs_bias_enabled(load, make_peft_adapter):
    path, _ = make_peft_adapter(with_bias=True, r=4, lora_alpha=8, lora_bias=True, target_modules=["q_proj"])
    _raises(UnsupportedAdapterError, load, path, CONFIG, "lora_bias")
    assert load(path, lora_config=LoRAConfig(bias_enabled=True)).get_lora("model.layers.0.self_attn.q_proj").bias \
        is not None


@pytest.mark.parametrize("bad, word", [(float("nan"), "NaN"), (float("inf"), "Inf"), (float("-inf"), "Inf")])
def test_non_finite_weight(load, adapter, bad, word):
    def poison(t):
        t[Q_B][3, 1] = bad
    _edit_tensors(adapter, poison)
    exc = _raises(NonFiniteWeightError, load, adapter, WEIGHTS, Q_B)
    assert f"1 {word}" in str(exc)


def test_several_tensor_problems_reported_together(load, adapter):
    def break_two(t):
        t[Q_A][0, 0] = float("nan")
        t[Q_B] = torch.randn(72, 8)
    _edit_tensors(adapter, break_two)
    with pytest.raises(MultipleAdapterProblems) as info:
        load(adapter)
    assert {(type(p), p.field) for p in info.value.problems} == {
        (NonFiniteWeightError, Q_A), (AdapterShapeError, Q_B)}


def test_bad_adapter_leaves_loaded_adapter_intact(load, good_adapter, adapter):
    """Loading touches no shared state: an adapter already serving keeps its exact tensors."""
    serving = load(good_adapter)
    snapshot = {name: (l.lora_a.clone(), l.lora_b.clone(), l.scaling) for name, l in serving.loras.items()}
    _edit_tensors(adapter, lambda t: t[Q_B].fill_(float("nan")))
    with pytest.raises(NonFiniteWeightError):
        load(adapter)
    (adapter / WEIGHTS).write_bytes(b"garbage" * 10)
    with pytest.raises(CorruptAdapterError):
        load(adapter)
    assert set(serving.loras) == set(snapshot)
    for name, (a, b, scaling) in snapshot.items():
        lora = serving.get_lora(name)
        assert torch.equal(lora.lora_a, a) and torch.equal(lora.lora_b, b) and lora.scaling == scaling
    assert load(good_adapter).rank == serving.rank
