"""Slot compaction (LoRAModelManager(compact_slots=True)): a batch's adapters sit below adapter_bound(n).

Moves copy a slot's image, stacked A rows and ranks; every adapter on the GPU must still hold its own
weights afterwards, the base weights above the A rows must not change, and evictions must stay those of
LRU: compaction moves adapters, it does not cost the GPU cache any.
"""

from __future__ import annotations

import random

import torch

from lora_core.mapping import LoRAMapping
from lora_core.punica.metadata import adapter_bound
from tests.lora_core.test_model_manager import SPECS, assert_slot_holds, make_lora
from tests.lora_core.test_stacked_a import LINEAR, stacked_manager

RANKS = (4, 16, 8, 12, 2, 16, 4, 8, 12, 16, 2, 4)


def _managers(max_loras: int = 8, adapters: int = 12):
    """(compacting, plain) stacked managers over the same adapters, and the adapters by id."""
    (m, weights), (plain, _) = (stacked_manager(max_loras, compact_slots=c) for c in (True, False))
    loras = {i: make_lora(i, RANKS[i - 1]) for i in range(1, adapters + 1)}
    for lora in loras.values():
        m.add_adapter(lora)
        plain.add_adapter(lora)
    return m, weights, plain, loras


def _batch(m, ids) -> list[int | None]:
    return m.prepare_batch(LoRAMapping(tuple(ids), tuple(ids)))


def _assert_consistent(m, loras) -> None:
    """Each GPU adapter's slot holds its weights; each free slot has zero ranks (the kernels skip it)."""
    for slot, owner in enumerate(m.lora_index_to_id):
        if owner is not None:
            assert_slot_holds(m, slot, loras[owner])
        else:
            assert all(not m.buffers(s.name).ranks[:, slot].any() for s in SPECS)


def test_a_high_adapter_moves_down_and_the_idle_one_there_moves_up():
    m, _, _, loras = _managers()
    for lora_id in range(1, 9):
        m.activate_adapter(lora_id)
    assert m.lora_index_to_id == [1, 2, 3, 4, 5, 6, 7, 8]
    # one adapter: bound 1. Slot 0's adapter is the least recently used: it leaves, 8 moves down
    assert _batch(m, [8]) == [8, 2, 3, 4, 5, 6, 7, None] and m.slot_moves == 1
    assert _batch(m, [2, 3]) == [8, 2, 3, 4, 5, 6, 7, None]  # two adapters: bound 4, nothing moves
    assert m.slot_moves == 1
    # 8 (idle now) moves up into the free slot, 7 down into slot 0: nothing leaves the GPU
    assert _batch(m, [7]) == [7, 2, 3, 4, 5, 6, None, 8] and m.slot_moves == 3
    assert 1 not in m.active_adapters() and 1 in m.list_adapters()  # evicted from the GPU, still registered
    _assert_consistent(m, loras)


def test_a_missing_adapter_is_written_low_and_evicts_what_lru_would():
    m, _, plain, loras = _managers()
    for manager in (m, plain):
        for lora_id in range(1, 9):
            manager.activate_adapter(lora_id)
        _batch(manager, [1])  # 2 (slot 1) is the least recently used now
    _batch(m, [9])
    _batch(plain, [9])
    assert plain.slot_of(9) == 1  # LRU: 9 takes 2's slot
    assert m.slot_of(9) == 0 and m.slot_of(1) == 1  # compaction: 1 moves up into it, 9 goes below the bound
    assert set(m.active_adapters()) == set(plain.active_adapters()) == {1, *range(3, 10)}
    _assert_consistent(m, loras)


def test_random_traffic_keeps_batches_low_and_every_slot_right():
    m, weights, plain, loras = _managers()
    base = {s.name: weights[s.name][:sum(s.out_slices)].clone() for s in LINEAR}
    rng = random.Random(0)
    popularity = [1 / k ** 1.5 for k in range(1, len(loras) + 1)]
    for _ in range(60):
        ids = sorted(set(rng.choices(list(loras), weights=popularity, k=rng.randint(1, 6))))
        index_to_id = _batch(m, ids)
        _batch(plain, ids)
        bound = adapter_bound(len(ids), len(index_to_id))
        assert all(index_to_id.index(i) < bound for i in ids), (ids, index_to_id)
        _assert_consistent(m, loras)
        assert len(m.active_adapters()) >= len(plain.active_adapters()) - 1  # at most one slot borrowed
    assert m.slot_moves > 10
    for spec in LINEAR:
        assert torch.equal(weights[spec.name][:sum(spec.out_slices)], base[spec.name])


def test_pinned_adapters_keep_their_low_slots():
    m, _, _, loras = _managers()
    for lora_id in range(1, 9):
        m.activate_adapter(lora_id)
    m.pin_adapter(1)
    assert _batch(m, [5]) == [1, 2, 3, 4, 5, 6, 7, 8]  # slot 0 is pinned: 5 stays where it is
    assert m.slot_moves == 0 and m.is_pinned(1)
    assert _batch(m, [1]) == [1, 2, 3, 4, 5, 6, 7, 8]
    _assert_consistent(m, loras)


def test_running_adapters_are_never_moved_off_nor_evicted():
    m, _, _, loras = _managers()
    for lora_id in range(1, 9):
        m.activate_adapter(lora_id)
    m.set_running([1, 2, 3, 4])  # the step in flight reads these
    index_to_id = _batch(m, [1, 2, 3, 4, 8])  # five adapters: bound 16 -> 8, every slot is below it
    assert index_to_id == [1, 2, 3, 4, 5, 6, 7, 8] and m.slot_moves == 0
    index_to_id = _batch(m, [7, 8])  # bound 4: 7 and 8 take the slots of the LRU idle adapters 1 and 2
    assert index_to_id.index(7) < 4 and index_to_id.index(8) < 4
    _assert_consistent(m, loras)


def test_random_operations_keep_every_slot_right():
    """Batches, pins, deactivations, removals and re-adds in random order with compaction on: after each, every
    GPU adapter's slot holds its own weights, free slots read as empty, pinned adapters stay on the GPU, and an
    operation that fails (a batch too large for the unpinned slots, removing a running adapter) changes nothing."""
    from lora_core.errors import LoRACapacityError
    from tests.lora_core.test_model_manager import snapshot

    m, _, _, loras = _managers(max_loras=6, adapters=12)
    rng = random.Random(3)
    registered, pinned, refused = set(loras), set(), 0
    for _ in range(150):
        op = rng.choice(["batch"] * 5 + ["pin", "deactivate", "remove", "readd"])
        before = snapshot(m)
        try:
            if op == "batch":
                _batch(m, sorted(rng.sample(sorted(registered), rng.randint(1, min(6, len(registered))))))
            elif op == "pin" and len(pinned) < 2:
                lora_id = rng.choice(sorted(registered))
                m.pin_adapter(lora_id)
                pinned.add(lora_id)
            elif op == "deactivate":
                lora_id = rng.choice(sorted(registered))
                m.deactivate_adapter(lora_id)
                pinned.discard(lora_id)
            elif op == "remove" and len(registered) > 6:
                lora_id = rng.choice(sorted(registered))
                m.remove_adapter(lora_id)
                registered.discard(lora_id)
                pinned.discard(lora_id)
            elif op == "readd" and set(loras) - registered:
                lora_id = rng.choice(sorted(set(loras) - registered))
                m.add_adapter(loras[lora_id])
                registered.add(lora_id)
        except LoRACapacityError:
            assert snapshot(m) == before, op
            refused += 1
        _assert_consistent(m, loras)
        assert pinned <= set(m.active_adapters())
        index_to_id = m.lora_index_to_id
        assert sorted(i for i in index_to_id if i is not None) == sorted(m.active_adapters())
        assert all(index_to_id[m.slot_of(i)] == i for i in m.active_adapters())
    assert m.slot_moves > 10 and refused > 0
