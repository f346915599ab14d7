"""PunicaMetadata (lora_core/punica/metadata.py): the tiles built on the host, and where they sit on the
device (CUDA graphs keep the pointers of the step they captured; Triton specializes on their alignment)."""

from __future__ import annotations

import numpy as np
import torch

from lora_core.punica import PunicaWrapper
from lora_core.punica.metadata import host_active, host_tiles
from tests.lora_core.punica_cases import POPULARITY, token_slots
from tests.lora_core.test_punica import NUM_SLOTS, _mapping


def test_metadata_tiles_cover_each_adapter_token_once():
    g = torch.Generator().manual_seed(2)
    for popularity in POPULARITY:
        slots = token_slots(300, NUM_SLOTS, popularity, g, none_fraction=0.25)
        w = PunicaWrapper(512, NUM_SLOTS, "cpu", backend="torch")
        before = w.token_meta._packed.data_ptr()
        w.update_metadata(_mapping(slots, [1, 2, 3, 4, 5, 6], True), [1, 2, 3, 4, 5, 6])
        meta = w.token_meta
        assert meta._packed.data_ptr() == before, "metadata buffers are allocated once"
        assert meta.slots.tolist() == slots and meta.num_tiles.item() == sum(t >= 0 for t in meta.tile_lora.tolist())
        seen = []
        for lora, start, end in zip(meta.tile_lora.tolist(), meta.tile_start.tolist(), meta.tile_end.tolist()):
            if lora < 0:
                continue
            rows = meta.sorted_idx[start: min(start + meta.block_m, end)].tolist()
            assert all(slots[r] == lora for r in rows)
            seen += rows
        assert sorted(seen) == [i for i, s in enumerate(slots) if s >= 0]


def test_metadata_of_steps_with_one_launch_key_sits_at_the_same_addresses():
    """A CUDA graph keeps the pointers of the step it captured: every later step with its launch key (rows
    and layout) must write its slots and tiles where that graph reads them, and another key elsewhere."""
    w = PunicaWrapper(64, NUM_SLOTS, "cpu", backend="torch")
    ids = list(range(1, NUM_SLOTS + 1))

    def step(slots):
        w.update_metadata(_mapping(slots, ids, False), ids)
        m = w.token_meta
        return m.launch_key(m.num_rows, m.num_adapters), [t.data_ptr() for t in (
            m.slots, m.sorted_idx, m.tile_lora, m.tile_start, m.tile_end, m.num_tiles)], m.slots.tolist()

    key_a, ptrs_a, _ = step([0, 1, 1, 2])
    key_b, ptrs_b, seen = step([3, 3, 4, 0])
    assert key_a == key_b and ptrs_a == ptrs_b and seen == [3, 3, 4, 0]
    key_c, ptrs_c, _ = step([0] * 20)
    assert key_c != key_a and ptrs_c[1:] != ptrs_a[1:]


def test_host_tiles_drop_tiles_past_the_bound_and_mark_the_rest():
    """More tiles than max_tiles: the first max_tiles in slot order stay, num_tiles says how many."""
    slots = np.array([2, 0, 2, 2, -1, 0, 1], dtype=np.int32)
    # tiles of 2 rows: slot 0 -> 1 tile, 1 -> 1, 2 -> 2; all 4 fit
    _, order, lora, start, end, count = [a.tolist() for a in host_tiles(slots, 3, 2, 4)]
    assert order == [4, 1, 5, 6, 0, 2, 3]  # stable: -1 first, then slots 0, 1, 2
    assert lora == [0, 1, 2, 2] and start == [1, 3, 4, 6] and end == [3, 4, 7, 7] and count == [4]
    _, _, lora, _, _, count = [a.tolist() for a in host_tiles(slots, 3, 2, 3)]
    assert lora == [0, 1, 2] and count == [3]
    _, _, lora, _, _, count = [a.tolist() for a in host_tiles(np.array([-1, -1], dtype=np.int32), 3, 16, 2)]
    assert lora == [-1, -1] and count == [0]


def test_metadata_arrays_start_16_byte_aligned_whatever_the_row_count():
    """Triton specializes kernels on pointer alignment: every array must start aligned for every step size,
    or steps of new sizes compile new kernel variants while serving."""
    w = PunicaWrapper(64, NUM_SLOTS, "cpu", backend="torch")
    ids = list(range(1, NUM_SLOTS + 1))
    for n in (1, 2, 3, 5, 7, 13, 33):
        w.update_metadata(_mapping([i % 3 for i in range(n)], ids, False), ids)
        m = w.token_meta
        views = (m.slots, m.sorted_idx, m.tile_lora, m.tile_start, m.tile_end, m.num_tiles, m.row_active, m.active,
                 m.num_active)
        assert all(v.data_ptr() % 16 == 0 for v in views), n
        assert m.slots.tolist() == [i % 3 for i in range(n)] and m.num_tiles.item() == len(set(m.slots.tolist()))


def test_active_tables_index_each_rows_adapter():
    """The one-launch sites' tables: the step's distinct slots in slot order, each row's index among them."""
    row_active, active, count = [a.tolist() for a in host_active(np.array([3, -1, 1, 3, 0], dtype=np.int32), 6)]
    assert active == [0, 1, 3, 0, 0, 0] and count == [3] and row_active == [2, -1, 1, 2, 0]
    row_active, active, count = [a.tolist() for a in host_active(np.array([-1, -1], dtype=np.int32), 3)]
    assert row_active == [-1, -1] and active == [0, 0, 0] and count == [0]
    w = PunicaWrapper(64, NUM_SLOTS, "cpu", backend="torch")
    ids = list(range(1, NUM_SLOTS + 1))
    w.update_metadata(_mapping([4, 4, -1, 2], ids, False), ids)
    m = w.token_meta
    assert m.row_active.tolist() == [1, 1, -1, 0] and m.active.tolist()[:2] == [2, 4] and m.num_active.item() == 2
