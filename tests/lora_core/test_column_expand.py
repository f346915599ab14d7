"""The column-tile expand of stacked decode steps (lora_core/punica/column_expand.py) against the torch reference.

Under TRITON_INTERPRET=1 on CPU (float32), on the GPU in bf16 / fp16. The shrink columns come from a real
stacked GEMM over zero-padded A slots, as the engine's do: the kernel relies on that padding (it reads
every used slot's whole width, masked by no rank).
"""

from __future__ import annotations

import pytest
import torch

from lora_core.mapping import LoRAMapping
from lora_core.punica import PunicaWrapper, column_expand as ce
from lora_core.punica.column_expand import column_expand, use_column_expand
from tests.lora_core.punica_cases import stacked_weights, token_slots

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = (torch.bfloat16, torch.float16) if ON_GPU else (torch.float32,)
HIDDEN = 64


def _step(num_rows: int, popularity: str, slices: tuple[int, ...], max_rank: int, num_slots: int, dtype, seed: int,
          none_fraction: float = 0.2):
    """(wrapper of the step, y0, shrunk [T, bound * S * R] from the stacked GEMM, B, ranks, slots)."""
    gen = torch.Generator().manual_seed(seed)
    ranks = [min(r, max_rank) for r in (4, max_rank, 16, 8, 12, 32)]
    a, b, rank_table = stacked_weights(num_slots, max_rank, HIDDEN, slices, ranks, torch.float32, "cpu", gen)
    if len(slices) > 1:  # slot 2 leaves the last slice alone (an untargeted module of a packed layer)
        rank_table[-1, 2] = 0
        a[-1, 2] = 0
        b[2, sum(slices[:-1]):] = 0
    slots = token_slots(num_rows, num_slots, popularity, gen, none_fraction=none_fraction)
    ids = list(range(1, num_slots + 1))
    mapping = LoRAMapping([ids[s] if s >= 0 else 0 for s in slots], [1], False)
    wrapper = PunicaWrapper(64, num_slots, DEVICE, backend="triton", stacked_max_tokens=64)
    wrapper.update_metadata(mapping, ids)
    bound = wrapper.stacked_rows()
    x = torch.randn(num_rows, HIDDEN, generator=gen)
    # [T, slot, slice, r]: what the GEMM over [W ; A rows of slots below the bound] writes past W's columns
    shrunk = torch.einsum("th,slrh->tlsr", x, a[:, :bound]).reshape(num_rows, -1)
    y0 = torch.randn(num_rows, sum(slices), generator=gen)
    return (wrapper, y0.to(DEVICE, dtype), shrunk.to(DEVICE, dtype).contiguous(), b.to(DEVICE, dtype),
            rank_table.to(DEVICE), slots, mapping, ids)


def _reference(y0, shrunk, b, rank_table, slices, mapping, ids, num_slots):
    ref = PunicaWrapper(64, num_slots, "cpu", backend="torch", stacked_max_tokens=64)
    ref.update_metadata(mapping, ids)
    want = y0.float().cpu().clone()
    ref.add_expand_stacked(want, shrunk.float().cpu(), b.float().cpu(), slices, rank_table.cpu())  # y0 untouched
    return want


def _assert_close(got, want, dtype):
    err = (got.float().cpu() - want).abs().max() / want.abs().max()
    assert err < (1e-5 if dtype == torch.float32 else 2e-2), err.item()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("config", [(32, 4, 0), (64, 2, 0), (64, 2, 1), (32, 2, 4), None])
@pytest.mark.parametrize("num_rows,popularity,slices,max_rank", [
    (1, "identical", (96,), 16),
    (7, "distinct", (64, 32, 16), 64),
    (33, "zipf", (100, 36), 32),       # partial column tiles; rows past 32 (what BGMV would not take)
    (64, "uniform", (64, 32, 16), 16),
    (20, "identical", (40,), 64),
])
def test_column_expand_equals_the_reference(num_rows, popularity, slices, max_rank, config, dtype):
    num_slots = 6
    wrapper, y0, shrunk, b, rank_table, slots, mapping, ids = _step(num_rows, popularity, slices, max_rank,
                                                                    num_slots, dtype, seed=num_rows)
    want = _reference(y0, shrunk, b, rank_table, slices, mapping, ids, num_slots)
    got = y0.clone()
    meta = wrapper.token_meta
    column_expand(got, shrunk, b, wrapper._offsets(slices), max(slices), len(slices), meta.slots,
                  num_rows, meta.slot_bound, config=config)
    _assert_close(got, want, dtype)
    free = torch.tensor([s < 0 for s in slots], device=DEVICE)
    assert torch.equal(got[free], y0[free])  # rows with no adapter: not written at all


@pytest.mark.parametrize("group", [0, 1, 2])
def test_slots_no_row_uses_are_never_read(group):
    """An idle slot below the bound (a stale adapter in it, or garbage) adds nothing: NaN there stays out, whether
    one program walks every slot (group 0) or a program each slot or pair of slots."""
    num_slots, slices = 6, (64, 32)
    wrapper, y0, shrunk, b, rank_table, slots, mapping, ids = _step(16, "identical", slices, 16, num_slots,
                                                                    DTYPES[0], seed=3, none_fraction=0.0)
    want = _reference(y0, shrunk, b, rank_table, slices, mapping, ids, num_slots)
    bound = wrapper.token_meta.slot_bound
    assert set(slots) == {0} and bound == 1
    wrapper.update_metadata(LoRAMapping([ids[3]] + [ids[0]] * 15, [1], False), ids)  # slot 3 in one row
    bound = wrapper.token_meta.slot_bound
    shrunk4 = torch.zeros(16, bound * len(slices) * 16, device=DEVICE, dtype=shrunk.dtype)
    shrunk4[:, :shrunk.shape[1]] = shrunk
    per_slot = len(slices) * 16
    shrunk4[:, per_slot:3 * per_slot] = float("nan")  # slots 1 and 2: in no row
    shrunk4[0, :per_slot] = float("nan")              # row 0 is slot 3's: slot 0's columns of it unread
    shrunk4[0, 3 * per_slot:4 * per_slot] = 0.0       # slot 3's shrink of row 0: zero, so row 0 keeps y0
    b = b.clone()
    b[1:3] = float("nan")
    got = y0.clone()
    meta = wrapper.token_meta
    column_expand(got, shrunk4, b, wrapper._offsets(slices), max(slices), len(slices), meta.slots, 16,
                  bound, config=(32, 2, group))
    assert torch.isfinite(got).all()
    _assert_close(got[1:], want[1:], DTYPES[0])
    assert torch.equal(got[0], y0[0])


@pytest.mark.gpu  # a B arena of over 2**31 elements (8 GB): the engine's rank-64 8B slots are that far apart
@pytest.mark.parametrize("group", [0, 1])
def test_slots_past_two_to_the_31_elements_apart(group):
    """B's slots are views of the manager's arena, a whole adapter apart: slot * stride overflows int32, in the
    loop's pointer step (group 0) and in a program's first slot (group 1)."""
    num_slots, slices, rank, dtype = 2, (64,), 16, torch.bfloat16
    wrapper, y0, shrunk, b, rank_table, slots, mapping, ids = _step(8, "uniform", slices, rank, num_slots, dtype,
                                                                    seed=9, none_fraction=0.0)
    stride = 2 ** 31 + 4096
    arena = torch.zeros(stride + b[0].numel(), device=DEVICE, dtype=dtype)
    far = arena.as_strided((num_slots, sum(slices), rank), (stride, rank, 1))
    far.copy_(b)
    want = _reference(y0, shrunk, b, rank_table, slices, mapping, ids, num_slots)
    got = y0.clone()
    meta = wrapper.token_meta
    column_expand(got, shrunk, far, wrapper._offsets(slices), max(slices), 1, meta.slots, 8, meta.slot_bound,
                  config=(64, 2, group))
    _assert_close(got, want, dtype)


def test_add_expand_stacked_takes_it_where_the_rule_says(monkeypatch):
    """The stacked step's expand runs here for steps the rule picks (33 rows: past BGMV's 32) and equals the
    reference; with LORAFLEET_COLUMN_EXPAND=0 the tile expand runs instead, to the same result."""
    num_slots, slices = 6, (64, 32, 16)
    wrapper, y0, shrunk, b, rank_table, slots, mapping, ids = _step(33, "zipf", slices, 16, num_slots, DTYPES[0],
                                                                    seed=5)
    want = _reference(y0, shrunk, b, rank_table, slices, mapping, ids, num_slots)
    calls = []
    real = ce.column_expand
    monkeypatch.setattr(ce, "column_expand", lambda *a, **k: calls.append(1) or real(*a, **k))
    for switch, runs in (("1", 1), ("0", 0)):
        monkeypatch.setenv("LORAFLEET_COLUMN_EXPAND", switch)
        got = y0.clone()
        wrapper.add_expand_stacked(got, shrunk, b, slices, rank_table)
        _assert_close(got, want, DTYPES[0])
        assert len(calls) == runs
        calls.clear()


def test_the_rule():
    # few slots: always, unless one row per program (BGMV) would run the tile expand
    assert use_column_expand(32, 16, 4096, 64, tile_bgmv=False)
    assert use_column_expand(32, 1, 28672, 16, tile_bgmv=False)
    assert not use_column_expand(32, 16, 4096, 16, tile_bgmv=True)
    # 32 slots: only where their B is large (gate_up at rank 64), not o_proj's
    assert use_column_expand(32, 32, 28672, 64, tile_bgmv=False)
    assert not use_column_expand(32, 32, 4096, 64, tile_bgmv=False)
    assert not use_column_expand(32, 32, 28672, 16, tile_bgmv=False)
    # taller steps: any bound
    assert use_column_expand(64, 32, 4096, 16, tile_bgmv=False)
    # prompt-sized steps, and more slots than the kernel's bit mask holds
    assert not use_column_expand(65, 4, 28672, 64, tile_bgmv=False)
    assert not use_column_expand(0, 4, 28672, 64, tile_bgmv=False)
    assert not use_column_expand(32, 128, 28672, 64, tile_bgmv=False)
    # slots tl.dot cannot take as they are (narrower than 16, or not a power of two)
    assert not use_column_expand(32, 4, 28672, 8, tile_bgmv=False)
    assert not use_column_expand(32, 4, 28672, 48, tile_bgmv=False)


def test_it_refuses_what_it_cannot_hold():
    y = torch.zeros(65, 32, device=DEVICE)
    b = torch.zeros(4, 32, 16, device=DEVICE)
    offsets = torch.tensor([0, 32], dtype=torch.int32, device=DEVICE)
    slots = torch.zeros(65, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="up to 64 rows"):
        column_expand(y, torch.zeros(65, 64, device=DEVICE), b, offsets, 32, 1, slots, 65, 4)
    with pytest.raises(ValueError, match="unit stride"):
        column_expand(y[:8].t().contiguous().t(), torch.zeros(8, 64, device=DEVICE), b, offsets, 32, 1,
                      slots[:8], 8, 4)
    with pytest.raises(ValueError, match="rank 8"):
        column_expand(y[:8], torch.zeros(8, 32, device=DEVICE), torch.zeros(4, 32, 8, device=DEVICE), offsets, 32, 1,
                      slots[:8], 8, 4)
