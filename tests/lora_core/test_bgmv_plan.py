"""The BGMV shrink's launch plan (triton_ops.shrink_config), decided on the host from shapes alone: how K is
split over a decode row's programs and how wide each program's A tile is. The kernels' results under these
plans are tested against the reference in test_punica.py."""

from __future__ import annotations

import torch

from lora_core.punica import triton_ops
from lora_core.punica.metadata import PunicaMetadata


def test_bgmv_shrink_takes_its_k_chunk_in_one_step_where_a_tile_holds_it(monkeypatch):
    """Host-side launch plan: a decode shrink's program reads its K chunk in one A tile up to
    BGMV_SHRINK_TILE elements (down_proj's 14,336 inputs at rank 16 and 64), else in steps of the widest
    tile the limit allows."""
    meta = PunicaMetadata(64, 64, torch.device("cpu"))
    meta.update([3], 1)
    assert meta.use_bgmv
    for hidden, rank in ((14336, 16), (14336, 64), (4096, 16), (4096, 64), (896, 16)):
        block_k, split_k, _ = triton_ops.shrink_config(meta, hidden, 1, rank)
        assert block_k * split_k >= hidden and block_k * rank <= triton_ops.BGMV_SHRINK_TILE, (hidden, rank)
    monkeypatch.setattr(triton_ops, "BGMV_SHRINK_TILE", 4096)
    block_k, split_k, _ = triton_ops.shrink_config(meta, 14336, 1, 64)
    assert (block_k, split_k) == (64, 64)  # 224 inputs per program: four steps of 64


def test_bgmv_split_partials_cap_the_splits_unless_the_launch_would_hold_too_few_programs(monkeypatch):
    """Host-side launch plan: a decode shrink splits K at most BGMV_SPLIT_PARTIALS / rank ways (each split is a
    partial every expand program reads back), except where that leaves fewer than BGMV_MIN_PROGRAMS programs
    taking more than one A tile each: then as many splits as fill it, up to one tile per program."""
    def plans() -> dict:
        out = {}
        for rows in (1, 2, 16):
            meta = PunicaMetadata(64, 64, torch.device("cpu"))
            meta.update(list(range(rows)), rows)
            assert meta.use_bgmv
            for hidden in (4096, 14336):
                for rank in (16, 64):
                    out[rows, hidden, rank] = triton_ops.shrink_config(meta, hidden, 1, rank)[:2]
        return out

    plan = plans()
    monkeypatch.setattr(triton_ops, "BGMV_SPLIT_PARTIALS", 0)
    uncapped = plans()
    assert plan[1, 4096, 64] == (256, 16) and uncapped[1, 4096, 64] == (64, 64)  # 64 x 64 partials -> 16 x 64
    # down_proj, one row: 16 splits would be 16 programs of four steps each; 64 take one step each
    assert plan[1, 14336, 64] == uncapped[1, 14336, 64] == (256, 64)
    assert plan[2, 14336, 64] == (256, 32)  # 2 rows x 32 splits fill BGMV_MIN_PROGRAMS
    assert plan[16, 14336, 64] == (256, 16) and uncapped[16, 14336, 64][1] == 64
    assert all(plan[key] == uncapped[key] for key in plan if key[2] == 16)  # rank 16 never reaches the cap
