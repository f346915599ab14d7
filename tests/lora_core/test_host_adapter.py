"""AdapterPreparer / HostAdapter: one slab per adapter, in plain or shared memory, moved whole by copy()."""

from __future__ import annotations

import pickle

import pytest
import torch

from tests.lora_core.test_model_manager import HIDDEN, KV, make_lora, manager


@pytest.mark.parametrize("memory", ["plain", "shared"])
def test_an_adapter_is_one_slot_image_and_copy_keeps_it(memory):
    m = manager(bias=True)
    adapter = m.preparer.prepare(make_lora(3, 8, bias=True), memory)
    assert adapter.slab.dtype == torch.uint8 and adapter.slab.numel() == m.layout.slot_bytes
    assert adapter.slab.is_shared() == (memory == "shared")
    assert adapter.ranks.untyped_storage().data_ptr() == adapter.slab.untyped_storage().data_ptr()
    qkv = m.layout.index("model.layers.0.self_attn.qkv_proj")
    assert adapter.ranks[qkv].tolist() == [8, 8, 8]
    moved = adapter.copy(pin_memory=False)
    assert moved.slab.data_ptr() != adapter.slab.data_ptr() and torch.equal(moved.slab, adapter.slab)
    assert moved.ranks.untyped_storage().data_ptr() == moved.slab.untyped_storage().data_ptr()
    assert torch.equal(moved.ranks, adapter.ranks) and moved.id == 3 and moved.rank == 8
    # The image is what a slot holds: activating it writes exactly these bytes.
    m.add_prepared(moved)
    slot = m.activate_adapter(3)
    assert torch.equal(m._arena[slot], adapter.slab)


def test_the_image_is_zero_past_each_rank():
    m = manager()
    ranks, regions = m.layout.image_views(m.preparer.prepare(make_lora(4, 4, skip=("k_proj",))).slab)
    a, b, _ = regions["model.layers.0.self_attn.qkv_proj"]
    assert a[0, :4].abs().sum() > 0 and a[0, 4:].abs().sum() == 0 and a[1].abs().sum() == 0  # k_proj: none
    assert b[:, 4:].abs().sum() == 0
    assert ranks[m.layout.index("model.layers.0.self_attn.qkv_proj")].tolist() == [4, 0, 4]


def test_prepared_adapter_equals_the_managers_and_the_preparer_pickles():
    m = manager()
    lora = make_lora(5, 16)
    want = m.prepare_adapter(lora)
    preparer = pickle.loads(pickle.dumps(m.preparer))  # a loader process gets a copy like this
    got = preparer.prepare(lora)
    assert torch.equal(got.slab, want.slab) and torch.equal(got.ranks, want.ranks)
    with pytest.raises(ValueError, match="memory must be one of"):
        preparer.prepare(lora, "gpu")


@pytest.mark.gpu
def test_copy_pins_a_shared_adapter():
    adapter = manager().preparer.prepare(make_lora(7, 8), "shared")
    pinned = adapter.copy()
    assert pinned.slab.is_pinned() and torch.equal(pinned.slab, adapter.slab)
    assert torch.equal(pinned.ranks, adapter.ranks)


@pytest.mark.parametrize("fill", [0x00, 0xFF, 0x3C])
def test_an_image_written_over_another_adapters_bytes_equals_a_fresh_one(monkeypatch, fill):
    """Slabs are reused (pool blocks) and never cleared whole: every byte that a view reads must come
    from this adapter or be zero, whatever the slab held before. Mixed ranks, untargeted slices and
    modules, biases on some slices, embeddings."""
    import lora_core.host_adapter as host_adapter

    m = manager(bias=True)
    lora = make_lora(6, 8, skip=("k_proj", "down_proj"), rank_pattern={"gate_proj": 4, "embed_tokens": 2}, bias=True)
    for name, layer in lora.loras.items():  # a bias on some slices only
        if name.endswith(("q_proj", "up_proj")):
            layer.bias = None
    real_slab = host_adapter._slab

    def dirty(nbytes, pin_memory, pool):
        slab, block = real_slab(nbytes, pin_memory, pool)
        return slab.fill_(fill), block

    want = m.preparer.prepare(lora)
    monkeypatch.setattr(host_adapter, "_slab", dirty)
    got = m.preparer.prepare(lora)
    want_ranks, want_views = m.layout.image_views(want.slab)
    got_ranks, got_views = m.layout.image_views(got.slab)
    assert torch.equal(got_ranks, want_ranks)
    assert torch.equal(got.slab, want.slab)  # alignment gaps included: images of one adapter are equal bytes
    for name, views in want_views.items():
        for w, g in zip(views, got_views[name], strict=True):
            assert (w is None) == (g is None) and (w is None or torch.equal(g, w)), name
    qkv_a, qkv_b, qkv_bias = got_views["model.layers.0.self_attn.qkv_proj"]
    assert qkv_a[1].abs().sum() == 0 and qkv_a[0, 8:].abs().sum() == 0 and qkv_b[:, 8:].abs().sum() == 0
    assert qkv_bias[:HIDDEN].abs().sum() == 0 and qkv_bias[HIDDEN + KV:].abs().sum() > 0  # q: none, v: given


@pytest.mark.parametrize("src_dtype, dst_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
                                                  (torch.float32, torch.float32), (torch.float16, torch.float32)])
@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "per-tensor"])
def test_batched_copies_round_as_one_scaled_copy_each(src_dtype, dst_dtype, foreach, monkeypatch):
    """SlotCopies (a few torch calls for a whole adapter) writes the bits that one torch.mul(src, scale, out=dst) per
    tensor writes: the product in the source dtype, rounded once into the slot's, into strided views too."""
    from lora_core.slot_copies import SlotCopies

    if not foreach:  # a torch without the private batched ops
        monkeypatch.delattr(torch, "_foreach_copy_")
    gen = torch.Generator().manual_seed(0)
    srcs = [(torch.randn(shape, generator=gen) * 3).to(src_dtype) for shape in [(5, 7), (3, 4), (6, 2), (1, 9), (2, 5)]]
    scales = [1.0, 2.0, 0.37, 3.0, 0.25]
    batched, reference = torch.zeros(18, 16, dtype=dst_dtype), torch.zeros(18, 16, dtype=dst_dtype)
    copies, row = SlotCopies(), 0
    for k, (src, scale) in enumerate(zip(srcs, scales)):  # disjoint strided views, as a slot image's regions
        rows, cols = src.shape
        copies.add(batched[row:row + rows, k:k + cols], src, scale)
        torch.mul(src, scale, out=reference[row:row + rows, k:k + cols])
        row += rows
    copies.run()
    assert torch.equal(batched.view(torch.uint8), reference.view(torch.uint8))
