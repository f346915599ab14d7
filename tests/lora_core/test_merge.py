"""lora_core.merge: a GPU slot's adapter folded into a linear layer's base weight, on every TP rank, and taken
back out bit for bit. On CPU both the plain-torch reference and the Triton kernel (TRITON_INTERPRET=1,
tests/conftest.py) run; on a GPU the kernel is what the API runs."""

from __future__ import annotations

import pytest
import torch

from lora_core import merge
from lora_core.errors import LoRAConfigError
from lora_core.config import LoRAConfig
from lora_core.merge import (MergeUndo, allocate_undo, apply_merge, check_mergeable, count_fixups, remove_merge,
                             slot_factors)
from lora_core.model_manager import LoRAModelManager
from lora_core.module_spec import LoRAKind, ShardKind
from tests.lora_core.test_model_manager import MAX_RANK, SPECS, make_lora, manager

LINEAR = [spec for spec in SPECS if spec.kind is LoRAKind.LINEAR]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(params=["torch", "triton"] if DEVICE == "cpu" else ["as-served"])
def backend(request, monkeypatch):
    """Which implementation the API runs: on CPU the reference, or the kernel in the interpreter; on a GPU
    what serving runs (the kernel for CUDA tensors, the reference for CPU ones)."""
    if request.param == "triton":
        monkeypatch.setattr(merge, "_use_kernel", lambda weight: True)
    return request.param


def _merge(weight: torch.Tensor, buffers, slot: int, max_fixups: int | None = None) -> MergeUndo | None:
    """What LoRAMerger does for one weight: count, refuse over max_fixups (weight untouched), else merge."""
    factors = slot_factors(weight, buffers, slot)
    count = count_fixups(weight, factors)
    fixups = int(count.total)
    if max_fixups is not None and fixups > max_fixups:
        return None
    undo = allocate_undo(weight, factors, fixups)
    apply_merge(weight, count, undo)
    return undo


def _full_delta(lora, spec) -> torch.Tensor:
    """[out, in] of the whole module (every packed slice, zero where untargeted), from the adapter's own weights."""
    parts = []
    for name, width in zip(spec.sub_module_names(), spec.out_slices):
        layer = lora.get_lora(name)
        parts.append(torch.zeros(spec.in_features, width) if layer is None else layer.compute_delta_weight())
    return torch.cat(parts, dim=1).T


@pytest.mark.parametrize("tp_rank,tp_size", [(0, 1), (0, 2), (1, 2)])
def test_slot_delta_equals_the_adapters_delta_on_each_rank(tp_rank, tp_size, backend):
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
        weight = base.clone()
        undo = _merge(weight, buffers, slot)
        torch.testing.assert_close(weight, base + want_delta, rtol=1e-5, atol=1e-5)
        remove_merge(weight, undo)
        assert torch.equal(weight, base)


def test_a_low_rank_adapter_merges_alone_from_a_slot_a_wider_one_held(backend):
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
    _merge(base, m.buffers(spec.name), slot)
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
    with pytest.raises(LoRAConfigError, match="does not match"):
        slot_factors(torch.zeros(3, 3), m.buffers(column.name), 0)
    weight = torch.zeros(column.in_features, sum(column.out_slices))
    with pytest.raises(LoRAConfigError, match="contiguous"):
        slot_factors(weight.t(), m.buffers(column.name), 0)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


DTYPES = [torch.bfloat16, torch.float32] if DEVICE == "cuda" else [torch.float16, torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_merge_comes_back_out_bit_for_bit_with_a_few_values_kept(dtype, backend):
    """The merged weight is base + B A rounded once; the unmerge gives the base weight back bit for bit,
    over repeated switches between adapters, also after the adapter's slot was given to another; the undo
    keeps the base values (and flat indices) of exactly the elements count_fixups counted: a small share of
    them in half precision, where a copy would keep them all. (On CPU half precision is float16: the
    interpreter's bfloat16 rounds by truncation.)"""
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
            delta = torch.cat([b.float() @ a.float() for _, b, a in slot_factors(base, buffers, slot)])
            undo = _merge(weight, buffers, slot)
            eps = torch.finfo(dtype).eps  # rounded once, from a delta summed in another order: an ulp or so
            torch.testing.assert_close(weight.float(), (base.float() + delta).to(dtype).float(),
                                       rtol=2 * eps, atol=eps * float(base.abs().max()))
            assert not torch.equal(weight, base)
            index = undo.fix_index.long()
            assert index.unique().numel() == index.numel()
            assert torch.equal(_bits(undo.fix_value), _bits(base.view(-1)[index]))
            m.deactivate_adapter(lora_id)
            m.activate_adapter(next(i for i in (1, 2, 3) if i != lora_id))  # its slot may now hold another
            remove_merge(weight, undo)
            assert torch.equal(_bits(weight), _bits(base)), (spec.name, lora_id)
            kept += undo.fixups
            for i in (1, 2, 3):
                m.deactivate_adapter(i)
        if dtype != torch.float32:  # the subtraction alone would not do: values were kept, but few
            assert 0 < kept < 0.1 * 4 * weight.numel(), (spec.name, kept)


def test_counting_reads_the_weight_only_and_a_merge_over_the_cap_leaves_it_alone(backend):
    m = LoRAModelManager(SPECS, LoRAConfig(max_loras=2, max_lora_rank=MAX_RANK, lora_dtype=torch.float16), DEVICE,
                         torch.float16)
    m.add_adapter(make_lora(1, 8))
    slot = m.activate_adapter(1)
    spec = LINEAR[0]
    base = (torch.randn(sum(spec.out_slices), spec.in_features) * 0.05).to(DEVICE, torch.float16)
    weight = base.clone()
    needed = int(count_fixups(weight, slot_factors(weight, m.buffers(spec.name), slot)).total)
    assert needed > 0 and torch.equal(_bits(weight), _bits(base))
    assert _merge(weight, m.buffers(spec.name), slot, max_fixups=needed - 1) is None
    assert torch.equal(_bits(weight), _bits(base))
    assert _merge(weight, m.buffers(spec.name), slot, max_fixups=needed).fixups == needed
