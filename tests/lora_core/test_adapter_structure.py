"""Structures checked once (lora_core/adapter_structure.py): an adapter whose file has a known structure loads as
it would with every check, its values are still checked, and anything the structural checks read is in the key."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import lora_core.lora_model as lora_model
from lora_core.adapter_structure import AdapterStructures, CheckedStructure, read_header
from lora_core.config import LoRAConfig
from lora_core.demo import ADAPTERS, llama_specs, write_adapter
from lora_core.errors import CorruptAdapterError, InvalidAdapterError, NonFiniteWeightError, RankTooLargeError
from lora_core.host_adapter import AdapterPreparer
from lora_core.lora_model import WEIGHTS_NAME, LoRAModel

SPECS = llama_specs()
EXPECTED = sorted({s for spec in SPECS for s in spec.sub_modules})
CONFIG = LoRAConfig(max_loras=2, max_lora_rank=16, lora_dtype="float32")
FIELDS = ADAPTERS["summarize-r4"]  # a rank_pattern: the modules' ranks differ


@pytest.fixture()
def checks(monkeypatch):
    """How many times the structural checks ran."""
    calls = []
    real = lora_model.checked_modules
    monkeypatch.setattr(lora_model, "checked_modules", lambda *args: calls.append(1) or real(*args))
    return calls


def _load(path, structures=None, part=None, config=CONFIG, specs=SPECS):
    return LoRAModel.from_local_checkpoint(path, EXPECTED, lora_model_id=1, lora_config=config, module_specs=specs,
                                           copy=False, part=part, structures=structures)


def _copy(src, dst, edit=None, config=None):
    """src's adapter in dst; edit(tensors) changes its weights in place, config its adapter_config.json fields."""
    dst.mkdir()
    fields = json.loads((src / "adapter_config.json").read_text()) | (config or {})
    (dst / "adapter_config.json").write_text(json.dumps(fields))
    tensors = load_file(str(src / WEIGHTS_NAME))
    if edit is not None:
        edit(tensors)
    save_file(tensors, str(dst / WEIGHTS_NAME), metadata={"format": "pt"})
    return dst


def _same(a: LoRAModel, b: LoRAModel) -> bool:
    return a.rank == b.rank and a.loras.keys() == b.loras.keys() and all(
        torch.equal(x.lora_a, y.lora_a) and torch.equal(x.lora_b, y.lora_b) and x.scaling == y.scaling
        for x, y in ((a.loras[n], b.loras[n]) for n in a.loras))


def test_an_adapter_of_a_known_structure_loads_as_with_every_check(tmp_path, checks):
    first = write_adapter(tmp_path / "first", FIELDS, seed=3)
    second = write_adapter(tmp_path / "second", FIELDS, seed=4)  # same recipe, other weights
    assert read_header(first / WEIGHTS_NAME) == read_header(second / WEIGHTS_NAME)
    structures = AdapterStructures()
    _load(first, structures)
    assert len(checks) == 1 and len(structures) == 1
    lora = _load(second, structures)
    assert len(checks) == 1  # known: not checked again
    assert _same(lora, _load(second)) and not _same(lora, _load(first))

    preparer = AdapterPreparer({s.name: s for s in SPECS}, CONFIG, torch.float32)
    slab = torch.full((preparer.max_slab_bytes(),), 0xA5, dtype=torch.uint8)
    checks.clear()
    for k in range(3):  # the parts of a known structure read their layers only, and write the whole image
        part = _load(second, structures, part=(k, 3))
        assert part.rank == lora.rank and set(part.loras) < set(lora.loras)
        preparer.prepare(part, out=slab, part=(k, 3))
    assert not checks and torch.equal(slab, preparer.prepare(lora).slab)


def test_a_known_structure_still_has_its_values_checked(tmp_path):
    good = write_adapter(tmp_path / "good", FIELDS, seed=3)
    key = next(k for k in load_file(str(good / WEIGHTS_NAME)) if ".layers.1." in k and "lora_B" in k)
    nan = _copy(good, tmp_path / "nan", edit=lambda t: t[key].view(-1)[0].fill_(float("nan")))
    assert read_header(nan / WEIGHTS_NAME) == read_header(good / WEIGHTS_NAME)
    structures = AdapterStructures()
    _load(good, structures)
    with pytest.raises(NonFiniteWeightError, match=key.replace(".", "[.]")):
        _load(nan, structures)
    assert _load(nan, structures, part=(0, 2)).rank == 4  # layer 1 is the other part's to check
    data = (good / WEIGHTS_NAME).read_bytes()  # the same header over too few bytes
    truncated = _copy(good, tmp_path / "truncated")
    (truncated / WEIGHTS_NAME).write_bytes(data[:len(data) // 2])
    with pytest.raises(CorruptAdapterError, match="not a readable safetensors file"):
        _load(truncated, structures)


def test_the_key_holds_what_the_checks_read(tmp_path, checks):
    good = write_adapter(tmp_path / "good", FIELDS, seed=3)
    structures = AdapterStructures()
    _load(good, structures)
    wrong_r = _copy(good, tmp_path / "wrong-r", config={"r": FIELDS["r"] + 1})  # not its tensors' rank
    with pytest.raises(InvalidAdapterError, match="does not match r="):
        _load(wrong_r, structures)
    pattern = _copy(good, tmp_path / "pattern", config={"rank_pattern": {}})  # down_proj's rank no longer 2
    with pytest.raises(InvalidAdapterError, match="does not match r="):
        _load(pattern, structures)
    with pytest.raises(RankTooLargeError):  # refused by the config's check, before the file is read
        _load(good, structures, config=LoRAConfig(max_loras=2, max_lora_rank=2, lora_dtype="float32"))
    narrow = [s for s in SPECS if not s.name.endswith("down_proj")]  # a model without down_proj's LoRA
    with pytest.raises(InvalidAdapterError, match="down_proj"):
        _load(good, structures, specs=narrow)
    assert len(checks) == 4 and len(structures) == 1  # each file read a miss, and none of them kept


def test_structures_are_bounded_least_recently_used_first():
    structures = AdapterStructures(capacity=2)
    known = [CheckedStructure({}, rank) for rank in range(3)]
    structures.put(("a",), known[0])
    structures.put(("b",), known[1])
    assert structures.get(("a",)) is known[0]  # now the most recently used
    structures.put(("c",), known[2])
    assert structures.get(("b",)) is None and structures.get(("a",)) is known[0] and len(structures) == 2
    with pytest.raises(ValueError, match="capacity"):
        AdapterStructures(capacity=0)


@pytest.mark.parametrize("data", [b"", b"\x01\x02", (10**9).to_bytes(8, "little") + b"{}", (50).to_bytes(8, "little")])
def test_a_file_without_a_plausible_header_is_left_to_the_full_read(tmp_path, data):
    good = write_adapter(tmp_path / "good", FIELDS, seed=3)
    bad = _copy(good, tmp_path / "bad")
    (bad / WEIGHTS_NAME).write_bytes(data)
    assert read_header(bad / WEIGHTS_NAME) is None
    with pytest.raises(CorruptAdapterError, match="not a readable safetensors file"):
        _load(bad, AdapterStructures())
