"""The `make demo` tour runs end to end, and what it writes is an adapter PEFT itself loads."""

from __future__ import annotations

import warnings

import pytest
import torch
from peft import PeftModel
from transformers import LlamaConfig, LlamaForCausalLM

from lora_core import demo
from lora_core.lora_model import LoRAModel


def test_demo_runs_and_checks_every_token(tmp_path, capsys):
    assert demo.main(tmp_path) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("OK")
    assert "RankTooLargeError" in out and "max_lora_rank=16" in out
    for name in demo.ADAPTERS:
        assert (tmp_path / "demo-adapters" / name / "adapter_model.safetensors").is_file()
    assert demo.main(tmp_path) == 0  # a second run reuses the cached adapters


@pytest.mark.parametrize("name", list(demo.ADAPTERS))
def test_demo_adapters_are_real_peft(tmp_path, name, peft_deltas):
    """PEFT loads each demo adapter and gives every module the delta our loader computes."""
    path = demo.write_adapter(tmp_path / name, demo.ADAPTERS[name], seed=1)
    base = LlamaForCausalLM(LlamaConfig(
        hidden_size=demo.HIDDEN, intermediate_size=demo.INTER, num_hidden_layers=demo.LAYERS,
        num_attention_heads=4, num_key_value_heads=4 * demo.KV // demo.HIDDEN, vocab_size=32))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = peft_deltas(PeftModel.from_pretrained(base, path))
    ours = LoRAModel.from_local_checkpoint(path, list(demo.SUB_DIMS))
    assert set(ours.loras) == set(want)
    for module, delta in want.items():
        torch.testing.assert_close(ours.loras[module].compute_delta_weight(), delta)
