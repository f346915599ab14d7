"""lora_core.merge: a GPU slot's adapter folded into a linear layer's base weight, on every TP rank."""

from __future__ import annotations

import pytest
import torch

from lora_core.errors import LoRAConfigError
from lora_core.config import LoRAConfig
from lora_core.merge import add_slot_delta, check_mergeable, merge_slot_delta, remove_slot_delta
from lora_core.model_manager import LoRAModelManager
from lora_core.module_spec import LoRAKind, ShardKind
from tests.lora_core.test_model_manager import MAX_RANK, SPECS, make_lora, manager

LINEAR = [spec for spec in SPECS if spec.kind is LoRAKind.LINEAR]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # on the GPU: cuBLAS's subtraction, run twice alike


def _full_delta(lora, spec) -> torch.Tensor:
    """[out, in] of the whole module (every packed slice, zero where untargeted), from the adapter's own weights."""
    parts = []
    for name, width in zip(spec.sub_module_names(), spec.out_slices):
        layer = lora.get_lora(name)
        parts.append(torch.zeros(spec.in_features, width) if layer is None else layer.compute_delta_weight())
    return torch.cat(parts, dim=1).T


@pytest.mark.parametrize("tp_rank,tp_size", [(0, 1), (0, 2), (1, 2)])
def test_slot_delta_equals_the_adapters_delta_on_each_rank(tp_rank, tp_size):
    """Mixed ranks per sub-module (rank_pattern) in rank-16 slots, one slice untargeted: base + the slot's
    delta equals base + this rank's shard of B A * scaling (column layers: rows of each slice; row layers:
    columns of the input)."""
    m = manager(tp_rank=tp_rank, tp_size=tp_size)
    lora = make_lora(5, 8, skip=("v_proj",), rank_pattern={"gate_proj": 4, "down_proj": 16})
    m.add_adapter(lora)
    slot = m.activate_adapter(5)
    gen = torch.Generator().manual_seed(3)
    for spec in LINEAR:
        buffers = m.buffers(spec.name)
        full = _full_delta(lora, spec)
        if spec.shard is ShardKind.COLUMN:
            offsets = [0, *torch.tensor(spec.out_slices).cumsum(0).tolist()]
            want_delta = torch.cat([full[lo:hi].chunk(tp_size, 0)[tp_rank] for lo, hi in zip(offsets, offsets[1:])])
        else:
            want_delta = full.chunk(tp_size, 1)[tp_rank]
        base = torch.randn(want_delta.shape, generator=gen)
        weight = torch.empty_like(base)
        add_slot_delta(weight, buffers, slot, base=base)
        torch.testing.assert_close(weight, base + want_delta, rtol=1e-5, atol=1e-5)
        in_place = base.clone()
        add_slot_delta(in_place, buffers, slot)
        assert torch.equal(in_place, weight)


def test_a_low_rank_adapter_merges_alone_from_a_slot_a_wider_one_held():
    """The merge reads all max_lora_rank rows of a slot: those past the adapter's rank must be zero,
    also where the slot's previous adapter had weights."""
    m = manager()
    m.add_adapter(make_lora(1, 16))
    m.add_adapter(make_lora(2, 4))
    slot = m.activate_adapter(1)
    m.deactivate_adapter(1)
    assert m.activate_adapter(2) == slot
    spec = LINEAR[0]
    base = torch.zeros(sum(spec.out_slices), spec.in_features)
    add_slot_delta(base, m.buffers(spec.name), slot)
    torch.testing.assert_close(base, _full_delta(make_lora(2, 4), spec), rtol=1e-5, atol=1e-5)


def test_what_cannot_merge_is_refused_by_name():
    m = manager()
    for spec in SPECS:
        if spec.kind is not LoRAKind.LINEAR:
            with pytest.raises(LoRAConfigError, match=spec.name):
                check_mergeable(m.buffers(spec.name))
    sharded = manager(tp_size=2, fs=True)
    column = next(s for s in LINEAR if s.shard is ShardKind.COLUMN)
    with pytest.raises(LoRAConfigError, match="fully-sharded"):
        check_mergeable(sharded.buffers(column.name))
    with pytest.raises(LoRAConfigError, match="bias"):
        check_mergeable(manager(bias=True).buffers(column.name))
    weight = torch.zeros(3, 3)
    with pytest.raises(LoRAConfigError, match="does not match"):
        add_slot_delta(weight, m.buffers(column.name), 0)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_merge_comes_back_out_bit_for_bit_with_a_few_values_kept(dtype):
    """merge_slot_delta writes what add_slot_delta writes; remove_slot_delta gives the base weight back bit for
    bit, over repeated switches between adapters, also after the adapter's slot was given to another; it keeps
    the base values of a small share of the elements (the subtraction restores the rest), where a copy would
    keep them all."""
    m = LoRAModelManager(SPECS, LoRAConfig(max_loras=2, max_lora_rank=MAX_RANK, lora_dtype=dtype), DEVICE, dtype)
    for lora_id in (1, 2, 3):
        m.add_adapter(make_lora(lora_id, 8, seed=lora_id))
    gen = torch.Generator().manual_seed(11)
    for spec in LINEAR:
        buffers = m.buffers(spec.name)
        base = (torch.randn(sum(spec.out_slices), spec.in_features, generator=gen) * 200).to(DEVICE, dtype)  # ~30|BA|
        weight, kept = base.clone(), 0
        for lora_id in (1, 2, 1, 3):
            slot = m.activate_adapter(lora_id)
            want = torch.empty_like(base)
            add_slot_delta(want, buffers, slot, base=base)
            undo = merge_slot_delta(weight, buffers, slot, max_fixups=weight.numel())
            assert undo is not None and torch.equal(_bits(weight), _bits(want)) and not torch.equal(weight, base)
            m.deactivate_adapter(lora_id)
            m.activate_adapter(next(i for i in (1, 2, 3) if i != lora_id))  # its slot may now hold another
            remove_slot_delta(weight, undo)
            assert torch.equal(_bits(weight), _bits(base)), (spec.name, lora_id)
            kept += undo.fixups
            for i in (1, 2, 3):
                m.deactivate_adapter(i)
        if dtype == torch.bfloat16:  # the subtraction alone would not do: values were kept, but few
            assert 0 < kept < 0.1 * 4 * weight.numel(), (spec.name, kept)


def test_a_merge_that_would_keep_too_many_values_leaves_the_weight_alone():
    m = LoRAModelManager(SPECS, LoRAConfig(max_loras=2, max_lora_rank=MAX_RANK, lora_dtype=torch.bfloat16), DEVICE,
                         torch.bfloat16)
    m.add_adapter(make_lora(1, 8))
    slot = m.activate_adapter(1)
    spec = LINEAR[0]
    base = (torch.randn(sum(spec.out_slices), spec.in_features) * 0.05).to(DEVICE, torch.bfloat16)
    weight = base.clone()
    full = merge_slot_delta(weight, m.buffers(spec.name), slot, max_fixups=weight.numel())
    needed = full.fixups
    remove_slot_delta(weight, full)
    assert needed > 0 and merge_slot_delta(weight, m.buffers(spec.name), slot, max_fixups=needed - 1) is None
    assert torch.equal(_bits(weight), _bits(base))
    with pytest.raises(LoRAConfigError, match="contiguous"):
        merge_slot_delta(weight.t(), m.buffers(spec.name), slot, max_fixups=1)
