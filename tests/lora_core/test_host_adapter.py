"""AdapterPreparer / HostAdapter: one slab per adapter, in plain or shared memory, moved whole by copy()."""

from __future__ import annotations

import pickle

import pytest
import torch

from tests.lora_core.test_model_manager import make_lora, manager


@pytest.mark.parametrize("memory", ["plain", "shared"])
def test_every_tensor_views_one_slab_and_copy_keeps_them(memory):
    preparer = manager(bias=True).preparer
    adapter = preparer.prepare(make_lora(3, 8, bias=True), memory)
    tensors = adapter.tensors()
    storages = {t.untyped_storage().data_ptr() for t in tensors}
    assert len(storages) == 1 and all(t.is_contiguous() for t in tensors)
    assert all(t.is_shared() for t in tensors) == (memory == "shared")
    moved = adapter.copy(pin_memory=False)
    new = moved.tensors()
    assert len({t.untyped_storage().data_ptr() for t in new}) == 1 and storages.isdisjoint(
        {t.untyped_storage().data_ptr() for t in new})
    assert [(t.dtype, t.shape) for t in new] == [(t.dtype, t.shape) for t in tensors]
    assert all(torch.equal(a, b) for a, b in zip(new, tensors))
    assert moved.id == 3 and moved.modules.keys() == adapter.modules.keys()


def test_prepared_adapter_equals_the_managers_and_the_preparer_pickles():
    m = manager()
    lora = make_lora(5, 16)
    want = m.prepare_adapter(lora).tensors()
    preparer = pickle.loads(pickle.dumps(m.preparer))  # a loader process gets a copy like this
    got = preparer.prepare(lora).tensors()
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
    with pytest.raises(ValueError, match="memory must be one of"):
        preparer.prepare(lora, "gpu")


@pytest.mark.gpu
def test_copy_pins_a_shared_adapter():
    adapter = manager().preparer.prepare(make_lora(7, 8), "shared")
    pinned = adapter.copy()
    assert all(t.is_pinned() for t in pinned.tensors())
    assert all(torch.equal(a, b) for a, b in zip(pinned.tensors(), adapter.tensors()))
