"""An adapter loaded in parts (lora_core/load_parts.py): the parts' images together are the whole load's,
byte for byte; each part validates the whole adapter's structure and the finiteness of its own layers."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from lora_core.config import LoRAConfig
from lora_core.demo import ADAPTERS, LAYERS, llama_specs, write_adapter
from lora_core.errors import CorruptAdapterError, NonFiniteWeightError, RankTooLargeError
from lora_core.host_adapter import AdapterPreparer
from lora_core.load_parts import part_of, read_part
from lora_core.lora_model import WEIGHTS_NAME, LoRAModel

SPECS = llama_specs()
EXPECTED = sorted({s for spec in SPECS for s in spec.sub_modules})
CONFIG = LoRAConfig(max_loras=2, max_lora_rank=16, lora_dtype="float32")


def _load(path, part=None, config=CONFIG):
    return LoRAModel.from_local_checkpoint(path, EXPECTED, lora_model_id=1, lora_config=config, module_specs=SPECS,
                                           copy=False, part=part)


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    # rank_pattern: the layers' modules differ in rank, so a part's rank is not its own layers' alone
    return write_adapter(tmp_path_factory.mktemp("parts") / "summarize", ADAPTERS["summarize-r4"], seed=3)


def test_part_of_splits_by_layer():
    assert [part_of(f"model.layers.{i}.mlp.down_proj", 3) for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert part_of("base_model.model.model.layers.12.self_attn.q_proj.lora_A.weight", 5) == 2
    assert part_of("model.embed_tokens", 4) == part_of("lm_head", 4) == 0


@pytest.mark.parametrize("parts", [1, 2, 3])  # 3 > LAYERS: one part has no layer at all
def test_the_parts_write_the_whole_image(adapter, parts):
    preparer = AdapterPreparer({s.name: s for s in SPECS}, CONFIG, torch.float32)
    whole = _load(adapter)
    want = preparer.prepare(whole)
    slab = torch.full((preparer.max_slab_bytes(),), 0xA5, dtype=torch.uint8)  # another adapter's bytes
    seen: list[str] = []
    for k in range(parts):
        lora = _load(adapter, (k, parts))
        assert lora.rank == whole.rank
        assert all(part_of(name, parts) == k for name in lora.loras)
        assert bool(lora.loras) == (k < LAYERS)
        seen += lora.loras
        preparer.prepare(lora, out=slab, part=(k, parts))
    assert sorted(seen) == sorted(whole.loras)
    assert torch.equal(slab, want.slab)


def test_a_part_reads_only_its_layers(adapter):
    tensors = read_part(adapter / WEIGHTS_NAME, 1, 2)
    whole = load_file(str(adapter / WEIGHTS_NAME))
    assert tensors.keys() == whole.keys()
    for key, t in tensors.items():
        assert t.shape == whole[key].shape and t.dtype == whole[key].dtype
        assert (t.device.type == "meta") == (part_of(key, 2) != 1)
        if t.device.type != "meta":
            assert torch.equal(t, whole[key])
    with pytest.raises(ValueError, match="part must be in"):
        read_part(adapter / WEIGHTS_NAME, 2, 2)


def test_each_part_checks_the_whole_structure_and_its_own_values(adapter, tmp_path):
    bad = tmp_path / "nan"
    bad.mkdir()
    (bad / "adapter_config.json").write_text((adapter / "adapter_config.json").read_text())
    tensors = load_file(str(adapter / WEIGHTS_NAME))
    key = next(k for k in tensors if ".layers.1." in k and "lora_B" in k)
    tensors[key][0, 0] = float("nan")
    save_file(tensors, str(bad / WEIGHTS_NAME))
    with pytest.raises(NonFiniteWeightError) as err:
        _load(bad, (1, 2))
    assert key in str(err.value)
    assert _load(bad, (0, 2)).rank == 4  # layer 1's values are the other part's to check
    big = json.loads((adapter / "adapter_config.json").read_text())
    small = LoRAConfig(max_loras=2, max_lora_rank=2, lora_dtype="float32")
    assert big["r"] > small.max_lora_rank
    for k in range(2):  # a rank above the limit: every part refuses, whichever layers it reads
        with pytest.raises(RankTooLargeError):
            _load(adapter, (k, 2), config=small)


@pytest.mark.parametrize("parts", [2, 3])
def test_peft_adapter_with_embeddings_in_parts_equals_whole(make_peft_adapter, expected_lora_modules,
                                                            llama_module_specs, parts):
    """A real PEFT adapter on the embeddings and lm_head too (part 0's, outside the layers), ranks per module."""
    path, _ = make_peft_adapter(seed=7, r=8, lora_alpha=16, rank_pattern={"down_proj": 4},
                                target_modules=["q_proj", "v_proj", "down_proj", "embed_tokens", "lm_head"])
    config = LoRAConfig(max_loras=2, max_lora_rank=8, lora_dtype="float32")
    preparer = AdapterPreparer({s.name: s for s in llama_module_specs}, config, torch.float32)

    def load(part=None):
        return LoRAModel.from_local_checkpoint(path, expected_lora_modules, lora_config=config,
                                               module_specs=llama_module_specs, part=part)

    want = preparer.prepare(load())
    slab = torch.full((preparer.max_slab_bytes(),), 0x5A, dtype=torch.uint8)
    for k in range(parts):
        lora = load((k, parts))
        assert ("model.embed_tokens" in lora.loras) == (k == 0) and ("lm_head" in lora.loras) == (k == 0)
        preparer.prepare(lora, out=slab, part=(k, parts))
    assert torch.equal(slab, want.slab)


def test_a_truncated_file_fails_every_part_alike(adapter, tmp_path):
    bad = tmp_path / "truncated"
    bad.mkdir()
    (bad / "adapter_config.json").write_text((adapter / "adapter_config.json").read_text())
    data = (adapter / WEIGHTS_NAME).read_bytes()
    (bad / WEIGHTS_NAME).write_bytes(data[:len(data) // 2])
    for k in range(2):
        with pytest.raises(CorruptAdapterError, match="not a readable safetensors file"):
            _load(bad, (k, 2))
