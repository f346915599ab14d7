"""PEFTHelper against PEFT itself: the same rank, alpha, scaling and targets per module."""

from __future__ import annotations

import json
import math

import pytest
import torch

from lora_core.config import LoRAConfig
from lora_core.errors import (
    AdapterFileMissingError,
    CorruptAdapterError,
    MultipleAdapterProblems,
    RankTooLargeError,
    UnsupportedAdapterError,
)
from lora_core.peft_helper import PEFTHelper
from tests.lora_core.conftest import PEFT_CASES

CASES = PEFT_CASES


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, make_peft_adapter):
    path, peft_model = make_peft_adapter(**CASES[request.param])
    return PEFTHelper.from_local_dir(path), peft_model


def test_fields_parsed(make_peft_adapter):
    path, _ = make_peft_adapter(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj"],
                                rank_pattern={"q_proj": 2}, alpha_pattern={"q_proj": 3})
    h = PEFTHelper.from_local_dir(path)
    assert (h.r, h.lora_alpha, h.use_rslora, h.target_modules) == (4, 8, True, ["q_proj"])
    assert (h.rank_pattern, h.alpha_pattern) == ({"q_proj": 2}, {"q_proj": 3})
    assert (h.bias, h.lora_bias, h.use_dora, h.modules_to_save, h.layers_to_transform) == (
        "none", False, False, None, None)
    assert h.config_path == str(path / "adapter_config.json")


def test_rank_alpha_scaling_match_peft(case, peft_layers):
    helper, peft_model = case
    layers = peft_layers(peft_model)
    assert layers
    for name, layer in layers.items():
        assert helper.rank_for(name) == layer.r["default"], name
        assert helper.alpha_for(name) == layer.lora_alpha["default"], name
        assert math.isclose(helper.scaling_for(name), layer.scaling["default"]), name


def test_patterns_really_vary():
    h = PEFTHelper.from_dict(dict(CASES["rank_pattern"]))
    assert h.rank_for("model.layers.0.self_attn.q_proj") == 8
    assert h.rank_for("model.layers.1.mlp.down_proj") == 2
    assert h.rank_for("model.layers.0.mlp.down_proj") == 4
    h = PEFTHelper.from_dict(dict(CASES["alpha_pattern"]))
    assert h.scaling_for("model.layers.1.self_attn.v_proj") == 32 / 4
    assert h.scaling_for("model.layers.0.mlp.up_proj") == 2 / 4
    assert h.scaling_for("model.layers.1.mlp.up_proj") == 8 / 4


def test_rslora_scaling():
    h = PEFTHelper.from_dict(dict(r=16, lora_alpha=8, use_rslora=True, target_modules=["q_proj"]))
    assert h.scaling_for("model.layers.0.self_attn.q_proj") == 8 / 4


def _candidates(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))}


@pytest.mark.parametrize("kwargs", [CASES["plain"], CASES["regex"], CASES["embed_lm_head"],
                                    dict(r=4, lora_alpha=8, target_modules="all-linear"),
                                    CASES["layers_to_transform"], CASES["layers_pattern"]],
                         ids=["list", "regex", "embed_lm_head", "all-linear", "layers_to_transform",
                              "layers_pattern"])
def test_targets_match_peft(kwargs, make_peft_adapter, tiny_llama, peft_layers):
    """targets() picks exactly the modules PEFT put a LoRA on (all-linear: before PEFT expands it)."""
    _, peft_model = make_peft_adapter(**kwargs)
    helper = PEFTHelper.from_dict(dict(kwargs))
    modules = _candidates(tiny_llama)
    linear = [n for n, m in modules.items() if isinstance(m, torch.nn.Linear)]
    chosen = {n for n in modules if helper.targets(n, linear)}
    assert chosen == set(peft_layers(peft_model))


def test_good_adapter_is_legal(case):
    helper, _ = case
    helper.validate_legal(LoRAConfig(max_lora_rank=16))
    helper.validate_legal(None)


def test_validate_legal_reports_every_problem():
    h = PEFTHelper.from_dict(
        dict(r=64, lora_alpha=0, target_modules=["q_proj"], use_dora=True, bias="all", lora_bias=True,
             modules_to_save=["lm_head"], rank_pattern={"k_proj": 32}),
        "/adapters/x/adapter_config.json")
    with pytest.raises(MultipleAdapterProblems) as info:
        h.validate_legal(LoRAConfig(max_lora_rank=16, bias_enabled=False))
    problems = info.value.problems
    by_field = {p.field: type(p) for p in problems}
    assert by_field == {
        "r": RankTooLargeError, "rank_pattern['k_proj']": RankTooLargeError, "lora_alpha": CorruptAdapterError,
        "use_dora": UnsupportedAdapterError, "modules_to_save": UnsupportedAdapterError,
        "bias": UnsupportedAdapterError, "lora_bias": UnsupportedAdapterError,
    }
    message = str(info.value)
    assert "/adapters/x/adapter_config.json" in message and "DoRA" in message
    assert "base model" in message  # bias="all" explains why it is refused
    for p in problems:
        assert p.path == "/adapters/x/adapter_config.json" and p.field in str(p)


def test_single_problem_raises_its_own_type():
    h = PEFTHelper.from_dict(dict(r=32, lora_alpha=8, target_modules=["q_proj"]), "cfg.json")
    with pytest.raises(RankTooLargeError, match=r"cfg\.json: r: .*max_lora_rank=16"):
        h.validate_legal(LoRAConfig(max_lora_rank=16))


def test_zero_rank_refused():
    h = PEFTHelper.from_dict(dict(r=0, lora_alpha=8, target_modules=["q_proj"]), "cfg.json")
    with pytest.raises(CorruptAdapterError, match=r"cfg\.json: r: rank must be > 0"):
        h.validate_legal()


def test_lora_bias_needs_bias_enabled():
    h = PEFTHelper.from_dict(dict(r=4, lora_alpha=8, target_modules=["q_proj"], lora_bias=True), "cfg.json")
    h.validate_legal(LoRAConfig(bias_enabled=True))
    with pytest.raises(UnsupportedAdapterError, match="lora_bias"):
        h.validate_legal(LoRAConfig(bias_enabled=False))


@pytest.mark.parametrize("field, value", [
    ("r", "8"), ("r", True), ("lora_alpha", "16"), ("target_modules", 3), ("target_modules", None),
    ("use_rslora", "yes"), ("rank_pattern", {"q_proj": "8"}), ("alpha_pattern", []), ("bias", "some"),
    ("modules_to_save", "lm_head"), ("layers_to_transform", "0"), ("layers_pattern", 3),
])
def test_wrong_field_type_is_corrupt(field, value):
    d = dict(r=8, lora_alpha=16, target_modules=["q_proj"])
    d[field] = value
    with pytest.raises(CorruptAdapterError) as info:
        PEFTHelper.from_dict(d, "/a/adapter_config.json")
    assert info.value.field == field
    assert str(info.value).startswith(f"/a/adapter_config.json: {field}: ")


def test_missing_required_field():
    with pytest.raises(CorruptAdapterError, match="r: required field is missing"):
        PEFTHelper.from_dict(dict(lora_alpha=16, target_modules=["q_proj"]), "cfg.json")


def test_non_lora_peft_type_refused():
    with pytest.raises(UnsupportedAdapterError, match="peft_type"):
        PEFTHelper.from_dict(dict(peft_type="IA3", r=8, lora_alpha=16, target_modules=["q_proj"]))


def test_from_local_dir_errors(tmp_path):
    with pytest.raises(AdapterFileMissingError, match="adapter_config.json"):
        PEFTHelper.from_local_dir(tmp_path)
    (tmp_path / "adapter_config.json").write_text("{\"r\": 8,")
    with pytest.raises(CorruptAdapterError, match="not valid JSON") as info:
        PEFTHelper.from_local_dir(tmp_path)
    assert str(tmp_path / "adapter_config.json") in str(info.value)
    (tmp_path / "adapter_config.json").write_text(json.dumps([1, 2]))
    with pytest.raises(CorruptAdapterError, match="JSON object"):
        PEFTHelper.from_local_dir(tmp_path)
