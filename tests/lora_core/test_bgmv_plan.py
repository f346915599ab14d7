"""The BGMV launch plan, decided on the host from shapes alone: how K is split over a decode row's programs
and how wide each program's A tile is (triton_ops.shrink_config), and which sites of an SGMV step run BGMV
(triton_ops.use_bgmv_site). The kernels' results under these plans are tested against the reference here
and in test_punica.py."""

from __future__ import annotations

import pytest
import torch

from lora_core.mapping import LoRAMapping
from lora_core.punica import triton_ops
from lora_core.punica.metadata import PunicaMetadata
from tests.lora_core.punica_cases import lora_linear_both, stacked_weights, token_slots

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = (torch.bfloat16,) if ON_GPU else (torch.float32, torch.float16)


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


def test_sites_with_many_more_inputs_than_outputs_run_bgmv_in_shared_steps():
    """triton_ops.use_bgmv_site: a small step whose rows share adapters plans SGMV, but a rank-16 site with at
    least BGMV_SITE_K_OVER_N times more inputs than outputs (down_proj) runs BGMV; wider outputs, wider slots
    and steps past bgmv_max_rows keep the step's plan."""
    meta = PunicaMetadata(64, 64, torch.device("cpu"))
    meta.update([5] * 16, 1)  # 16 rows of one adapter
    assert not meta.use_bgmv
    assert triton_ops.use_bgmv_site(meta, 14336, 4096, 16)
    assert not triton_ops.use_bgmv_site(meta, 4096, 6144, 16)  # qkv
    assert not triton_ops.use_bgmv_site(meta, 4096, 28672, 16)  # gate_up
    assert not triton_ops.use_bgmv_site(meta, 14336, 4096, 64)  # rank-64 slots
    tall = PunicaMetadata(64, 64, torch.device("cpu"))
    tall.update([5] * 48, 1)  # past bgmv_max_rows (32)
    assert not triton_ops.use_bgmv_site(tall, 14336, 4096, 16)
    distinct = PunicaMetadata(64, 64, torch.device("cpu"))
    distinct.update(list(range(16)), 16)
    assert distinct.use_bgmv and triton_ops.use_bgmv_site(distinct, 4096, 28672, 64)  # the step's own plan


@pytest.mark.parametrize("popularity", ["identical", "uniform"])
def test_a_shared_step_runs_a_long_input_site_as_bgmv_and_equals_the_reference(popularity):
    """The kernels under use_bgmv_site's plan: 8 rows sharing rank-16 adapters (an SGMV step) over a site with
    more than twice as many inputs as outputs run BGMV, with some rows on no adapter, and equal the reference."""
    dtype = DTYPES[-1]
    g = torch.Generator().manual_seed(7)
    hidden, slices = 256, (48, 32)
    a, b, ranks = stacked_weights(4, 16, hidden, slices, [16, 8, 12, 4], dtype, DEVICE, g)
    slots = token_slots(8, 4, popularity, g, none_fraction=0.25)
    ids = [1, 2, 3, 4]
    mapping = LoRAMapping([0 if s < 0 else ids[s] for s in slots], [0], False)
    x = torch.randn(8, hidden, generator=g).to(DEVICE, dtype)
    y0 = torch.randn(8, sum(slices), generator=g).to(DEVICE, dtype)
    want, got, w = lora_linear_both(mapping, ids, x, a, b, y0, slices, ranks)
    assert not w.token_meta.use_bgmv and triton_ops.use_bgmv_site(w.token_meta, hidden, sum(slices), 16)
    err = (got.float() - want).abs().max() / want.abs().max()
    assert err < (1e-4 if dtype == torch.float32 else 2e-2), err
    untouched = torch.tensor([s < 0 for s in slots], device=DEVICE)
    assert torch.equal(got[untouched], y0[untouched])
