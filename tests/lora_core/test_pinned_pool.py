"""PinnedSlabPool and the host tier on it: blocks handed out, returned with their adapters, reused
without stale bytes, a fallback when full; on a GPU, a block is not reused under a running copy."""

from __future__ import annotations

import gc
import os

import pytest
import torch

from lora_core.config import LoRAConfig
from lora_core.model_manager import LoRAModelManager
from lora_core.pinned_pool import PinnedSlabPool
from tests.lora_core.test_model_manager import MAX_RANK, SPECS, assert_slot_holds, make_lora


def pooled_manager(blocks: int, max_loras: int = 2, max_cpu_loras: int = 2, bias: bool = False) -> LoRAModelManager:
    cfg = LoRAConfig(max_loras=max_loras, max_lora_rank=MAX_RANK, max_cpu_loras=max_cpu_loras, bias_enabled=bias)
    return LoRAModelManager(SPECS, cfg, "cpu", torch.float32, host_pool_blocks=blocks)


def _views(adapter, pool: PinnedSlabPool) -> bool:
    lo = pool._region.data_ptr()
    hi = lo + pool._region.numel()
    return lo <= adapter.slab.data_ptr() and adapter.slab.data_ptr() + adapter.slab.numel() <= hi


def test_blocks_are_handed_out_and_returned():
    pool = PinnedSlabPool(1000, 2, pin=False)
    assert pool.block_bytes == 1024  # 64-byte aligned blocks
    a, b = pool.allocate(10), pool.allocate(1024)
    assert a.tensor.numel() == 10 and b.tensor.numel() == 1024 and a.index != b.index
    assert pool.allocate(1) is None and pool.fallbacks == 1 and pool.free_blocks == 0
    assert pool.allocate(1025) is None  # larger than a block
    pool.release(a)
    with pytest.raises(ValueError, match="released twice"):
        pool.release(a)
    c = pool.allocate(5)
    assert c.index == a.index and pool.free_blocks == 0


def test_a_shared_pool_lives_in_shared_memory_or_says_it_does_not(monkeypatch):
    """shared=True puts the region in a SharedRegion (loader processes write into its blocks): on Linux an
    anonymous memory file, whatever room /dev/shm has; without memfd and with no room in /dev/shm the pool
    stays private and says so, so the loaders take their slower path."""
    from lora_core import pinned_pool, shared_region

    pool = PinnedSlabPool(1000, 3, pin=False, shared=True)
    assert pool.shared and pool.region.numel() == 3 * 1024
    assert pool.region.data_ptr() == pool.shared_region.tensor.data_ptr()
    block = pool.allocate(1000)
    assert block.tensor.data_ptr() == pool.region.data_ptr() + block.index * pool.block_bytes
    monkeypatch.setattr(shared_region.os, "statvfs", lambda path: os.statvfs_result((4096,) * 2 + (0,) * 8))
    assert PinnedSlabPool(1000, 3, pin=False, shared=True).shared == shared_region.MEMFD  # /dev/shm full
    monkeypatch.setattr(shared_region, "MEMFD", False)
    private = PinnedSlabPool(1000, 3, pin=False, shared=True)
    assert not private.shared and private.shared_region is None and not private.region.is_shared()
    assert not PinnedSlabPool(1000, 3, pin=False).shared
    monkeypatch.undo()
    monkeypatch.setattr(shared_region, "MEMFD", False)  # room in /dev/shm again: torch's shared memory
    assert PinnedSlabPool(1000, 3, pin=False, shared=True).region.is_shared()


def test_a_slab_written_in_place_equals_a_prepared_one():
    """prepare(out=block) (what a loader process does) lays out the same bytes as a prepared slab, over a block
    that held another adapter; in_block() gives the adapter that owns the block."""
    m = pooled_manager(blocks=3)
    pool = PinnedSlabPool(m.preparer.max_slab_bytes(), 2, pin=False, shared=True)
    block = pool.allocate(m.preparer.max_slab_bytes())
    m.preparer.prepare(make_lora(7, MAX_RANK), out=block.tensor)  # a stale image first
    lora = make_lora(1, 4)
    written = m.preparer.prepare(lora, out=block.tensor)
    adapter = m.preparer.in_block(1, lora.rank, block, pool)
    want = m.prepare_adapter(lora)
    assert torch.equal(written.slab, want.slab) and torch.equal(adapter.slab, want.slab)
    assert torch.equal(adapter.ranks, want.ranks) and adapter.block is block and pool.free_blocks == 1
    with pytest.raises(ValueError, match="uint8 slab"):
        m.preparer.prepare(lora, out=block.tensor[:10])
    del adapter, written
    gc.collect()
    assert pool.free_blocks == 2


def test_every_slab_is_one_slot_image_that_fits_a_block():
    for bias in (False, True):
        m = pooled_manager(1, bias=bias)
        full = m.prepare_adapter(make_lora(1, MAX_RANK, bias=bias))
        assert full.slab.numel() == m.preparer.max_slab_bytes() <= m.host_pool.block_bytes
        assert full.block is not None and _views(full, m.host_pool)


def test_host_tier_lives_in_the_pool_and_frees_blocks_on_eviction():
    m = pooled_manager(blocks=3, max_cpu_loras=2)
    pool = m.host_pool
    loras = [make_lora(i, r) for i, r in ((1, 16), (2, 4), (3, 8))]
    m.add_adapter(loras[0])
    m.add_adapter(loras[1])
    assert pool.free_blocks == 1
    m.add_adapter(loras[2])  # evicts adapter 1 from the host LRU: its block comes back
    gc.collect()
    assert m.list_adapters() == [2, 3] and pool.free_blocks == 1
    m.add_adapter(loras[0])  # reuses a freed block: the slot must hold adapter 1, not stale bytes
    for lora in (loras[2], loras[0]):
        assert_slot_holds(m, m.activate_adapter(lora.id), lora)
    assert pool.fallbacks == 0
    m.remove_adapter(3)
    m.remove_adapter(1)
    gc.collect()
    assert pool.free_blocks == 3


def test_a_full_pool_falls_back_to_slabs_of_their_own():
    m = pooled_manager(blocks=1, max_cpu_loras=2)
    first, second = make_lora(1, 8), make_lora(2, 16)
    m.add_adapter(first)
    m.add_adapter(second)
    assert m.host_pool.fallbacks == 1 and m.host_pool.free_blocks == 0
    for lora in (first, second):
        assert_slot_holds(m, m.activate_adapter(lora.id), lora)


def test_adapters_from_loader_processes_are_adopted_into_the_pool():
    m = pooled_manager(blocks=2)
    shared = m.preparer.prepare(make_lora(1, 8), "shared", m.host_pool)
    assert shared.block is None and m.host_pool.free_blocks == 2  # shared memory is never pooled
    adopted = m.adopt_shared(shared)
    assert adopted.block is not None and _views(adopted, m.host_pool)
    m.add_prepared(adopted)
    assert_slot_holds(m, m.activate_adapter(1), make_lora(1, 8))
    del shared, adopted
    m.remove_adapter(1)
    gc.collect()
    assert m.host_pool.free_blocks == 2


@pytest.mark.gpu
def test_a_block_is_not_reused_while_a_copy_reads_it():
    pool = PinnedSlabPool(1 << 24, 1, pin=True)
    block = pool.allocate(1 << 24)
    assert block.tensor.is_pinned()
    block.tensor.fill_(7)
    dst = torch.empty(1 << 24, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(200_000_000)  # the copy starts long after allocate() below would return
        dst.copy_(block.tensor, non_blocking=True)
        block.record()
    pool.release(block)
    again = pool.allocate(1 << 24)  # must wait for the copy before the bytes can change
    again.tensor.fill_(1)
    torch.cuda.synchronize()
    assert int(dst.min()) == 7 == int(dst.max())


def test_a_byte_cap_shrinks_the_pool_and_the_rest_pins_its_own(caplog):
    cfg = LoRAConfig(max_loras=2, max_lora_rank=MAX_RANK, max_cpu_loras=3)
    probe = LoRAModelManager(SPECS, cfg, "cpu", torch.float32)
    slot = probe.layout.slot_bytes
    with caplog.at_level("WARNING"):
        m = LoRAModelManager(SPECS, cfg, "cpu", torch.float32, host_pool_blocks=4, host_pool_max_bytes=2 * slot + 1)
    assert m.host_pool.num_blocks == 2 and "capped at 2 of 4 blocks" in caplog.text
    loras = [make_lora(i, 8) for i in (1, 2, 3)]
    for lora in loras:
        m.add_adapter(lora)
    assert m.host_pool.fallbacks == 1
    for lora in loras[1:]:
        assert_slot_holds(m, m.activate_adapter(lora.id), lora)
    assert LoRAModelManager(SPECS, cfg, "cpu", torch.float32, host_pool_blocks=4,
                            host_pool_max_bytes=slot - 1).host_pool is None


def test_physical_memory_is_known_here():
    from lora_core.pinned_pool import physical_memory_bytes

    total = physical_memory_bytes()
    assert total is not None and total > 2**30  # CI and GPU hosts alike have more than 1 GiB
