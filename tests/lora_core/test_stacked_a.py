"""Stacked A: linear layers' A slots as rows under the base weight; the GEMM's extra columns are the shrink.

The manager writes those rows on activation and reads them as lora_a; PunicaWrapper.add_expand_stacked
takes the GEMM's extra columns where add_lora_linear runs its own shrink (torch reference and the Triton
kernels, under TRITON_INTERPRET=1 on CPU).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lora_core.config import LoRAConfig
from lora_core.errors import LoRAConfigError
from lora_core.mapping import LoRAMapping
from lora_core.model_manager import LoRAModelManager
from lora_core.module_spec import LoRAKind
from lora_core.punica import PunicaWrapper, StepLayout
from lora_core.punica.metadata import PunicaMetadata
from lora_core.slot_layout import SlotLayout
from lora_core.punica.torch_ops import gather_shrunk
from lora_core.punica.triton_ops import use_bgmv_stacked as bgmv_expand
from lora_core.stacked_a import a_rows, max_idle_slots, stack_bias, stack_weight
from lora_core.tp import LocalDims
from tests.lora_core.punica_cases import stacked_weights, token_slots
from tests.lora_core.test_model_manager import MAX_RANK, SPECS, assert_slot_holds, make_lora, manager

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = (torch.bfloat16, torch.float16) if ON_GPU else (torch.float32, torch.float16)
LINEAR = [s for s in SPECS if s.kind is LoRAKind.LINEAR]


def stacked_manager(max_loras: int = 3, bias: bool = False, compact_slots: bool = False
                    ) -> tuple[LoRAModelManager, dict[str, torch.Tensor]]:
    """A manager whose linear modules' A slots live under random base weights; returns it and those weights."""
    g = torch.Generator().manual_seed(0)
    weights, rows = {}, {}
    for spec in LINEAR:
        base = torch.randn(sum(spec.out_slices), spec.in_features, generator=g)
        weights[spec.name] = stack_weight(base, max_loras, len(spec.out_slices), MAX_RANK)
        rows[spec.name] = a_rows(weights[spec.name], base.shape[0], max_loras, len(spec.out_slices), MAX_RANK)
    cfg = LoRAConfig(max_loras=max_loras, max_lora_rank=MAX_RANK, bias_enabled=bias)
    return LoRAModelManager(SPECS, cfg, "cpu", torch.float32, stacked_a=rows, compact_slots=compact_slots), weights


def test_activation_writes_the_a_rows_under_the_base_weight_and_leaves_it():
    m, weights = stacked_manager()
    plain = manager()
    base = {name: w[:sum(s.out_slices)].clone() for s in LINEAR for name, w in [(s.name, weights[s.name])]}
    loras = [make_lora(i, r) for i, r in ((1, 4), (2, 16), (3, 8), (4, 12))]
    for lora in loras:
        m.add_adapter(lora)
        plain.add_adapter(lora)
    for lora in loras:  # four adapters through three slots: the last one reuses the first's slot
        slot = m.activate_adapter(lora.id)
        assert slot == plain.activate_adapter(lora.id)
        assert_slot_holds(m, slot, lora)
    for spec in LINEAR:
        buf, ref = m.buffers(spec.name), plain.buffers(spec.name)
        assert buf.lora_a.data_ptr() >= weights[spec.name].data_ptr()  # a view of the stacked rows
        assert torch.equal(buf.lora_a, ref.lora_a) and torch.equal(buf.lora_b, ref.lora_b)
        assert torch.equal(weights[spec.name][:sum(spec.out_slices)], base[spec.name])
    # the arena keeps everything else: the linear modules' A bytes are not in it
    assert m._arena.shape[1] == m.layout.arena_bytes < m.layout.slot_bytes == plain._arena.shape[1]


def test_stacked_rows_must_fit_the_slots():
    m, _ = stacked_manager()
    rows = {name: m.buffers(name).lora_a.transpose(0, 1) for name in m.layout.a_last}
    cfg = LoRAConfig(max_loras=3, max_lora_rank=MAX_RANK)
    missing = dict(rows)
    missing.pop(LINEAR[0].name)
    with pytest.raises(LoRAConfigError, match="missing .*qkv_proj"):
        LoRAModelManager(SPECS, cfg, "cpu", torch.float32, stacked_a=missing)
    with pytest.raises(LoRAConfigError, match="not linear or unknown .*lm_head"):
        LoRAModelManager(SPECS, cfg, "cpu", torch.float32, stacked_a={**rows, "lm_head": rows[LINEAR[0].name]})
    narrow = {**rows, LINEAR[1].name: rows[LINEAR[1].name][:, :, :8]}
    with pytest.raises(LoRAConfigError, match="o_proj: stacked A rows are .* the slots need"):
        LoRAModelManager(SPECS, cfg, "cpu", torch.float32, stacked_a=narrow)
    with pytest.raises(LoRAConfigError, match="the slots need torch.float16"):
        LoRAModelManager(SPECS, LoRAConfig(max_loras=3, max_lora_rank=MAX_RANK, lora_dtype="float16"), "cpu",
                         torch.float32, stacked_a=rows)


def test_gather_shrunk_picks_each_rows_slot():
    slots, slices, rank = torch.tensor([2, -1, 0, 2], dtype=torch.int32), 2, 3
    shrunk = torch.arange(4 * 4 * slices * rank, dtype=torch.float32).view(4, -1)  # 4 slots' columns
    got = gather_shrunk(shrunk, slots, slices, rank)
    per = shrunk.view(4, 4, slices, rank)
    for t, s in enumerate(slots.tolist()):
        want = per[t, s] if s >= 0 else torch.zeros(slices, rank)
        assert torch.equal(got[:, t], want)


def test_stack_bias_pads_with_zeros():
    stacked = stack_weight(torch.ones(5, 3), 2, 1, 4)
    assert stacked.shape == (13, 3) and stacked[5:].abs().sum() == 0
    bias = stack_bias(torch.arange(5.0), stacked)
    assert bias.tolist() == [0, 1, 2, 3, 4] + [0] * 8 and stack_bias(None, stacked) is None


def _site(num_tokens, popularity, slices, dtype, num_slots, ranks, gen, max_rank=MAX_RANK):
    hidden = 64
    a, b, rank_table = stacked_weights(num_slots, max_rank, hidden, slices, ranks, dtype, DEVICE, gen)
    base = (torch.randn(sum(slices), hidden, generator=gen) / hidden ** 0.5).to(DEVICE, dtype)
    stacked = stack_weight(base, num_slots, len(slices), max_rank)
    a_rows(stacked, base.shape[0], num_slots, len(slices), max_rank).copy_(a.transpose(0, 1))
    slots = token_slots(num_tokens, num_slots, popularity, gen, none_fraction=0.2 if num_tokens > 1 else 0.0)
    x = torch.randn(num_tokens, hidden, generator=gen).to(DEVICE, dtype)
    return a, b, rank_table, base, stacked, slots, x


# (slot rank, slices) -> output slices: rank-64 slots run 64-column B tiles per stacked-expand program and
# rank-16 ones 256-column tiles (triton_ops.stacked_expand_config), here over outputs ending in partial tiles.
SITE_CASES = {(64, 1): (96,), (64, 3): (64, 32, 16), (16, 1): (300,), (16, 3): (264, 40, 40)}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("max_rank,num_slices", list(SITE_CASES))
@pytest.mark.parametrize("num_tokens,popularity", [(1, "identical"), (7, "distinct"), (32, "zipf"), (64, "identical")])
def test_expand_of_the_stacked_gemm_equals_lora_linear(num_tokens, popularity, max_rank, num_slices, dtype):
    slices = SITE_CASES[max_rank, num_slices]
    num_slots = 6
    gen = torch.Generator().manual_seed(num_tokens * 7 + num_slices)
    ranks = [min(r, max_rank) for r in (4, 8, 16, 32, 64, 12)]
    a, b, ranks, base, stacked, slots, x = _site(num_tokens, popularity, slices, dtype, num_slots, ranks, gen,
                                                 max_rank)
    ids = list(range(1, num_slots + 1))
    mapping = LoRAMapping([ids[s] if s >= 0 else 0 for s in slots], [1], False)
    # PEFT lora_bias (bias_enabled) on the three-slice site
    bias = torch.randn(num_slots, sum(slices), generator=gen).to(DEVICE, dtype) if num_slices == 3 else None
    want = F.linear(x, base)
    ref = PunicaWrapper(64, num_slots, DEVICE, backend="torch")
    ref.update_metadata(mapping, ids)
    ref.add_lora_linear(want, x, a, b, bias, 1.0, slices, ranks)
    for backend in ("torch", "triton"):
        w = PunicaWrapper(64, num_slots, DEVICE, backend=backend, stacked_max_tokens=64)
        w.update_metadata(mapping, ids)
        bound = w.stacked_rows()
        assert bound is not None and bound > max(slots)
        out = F.linear(x, stacked[:base.shape[0] + bound * num_slices * max_rank])
        y = out[:, :base.shape[0]]
        w.add_expand_stacked(y, out[:, base.shape[0]:], b, slices, ranks, bias)
        err = (y.float() - want.float()).abs().max() / want.float().abs().max()
        assert err < (1e-4 if dtype == torch.float32 else 2e-2), (backend, err.item())


def test_the_gemm_covers_slots_up_to_the_highest_one_used():
    """A step's slot bound follows its highest slot (rounded up to a power of four), not its adapter count:
    one adapter in slot 9 of 32 needs the A rows of slots 0-15."""
    w = PunicaWrapper(64, 32, "cpu", backend="torch", stacked_max_tokens=16)
    ids = list(range(1, 33))
    w.update_metadata(LoRAMapping([10, 10, 0], [10], False), ids)
    assert w.token_meta.num_adapters == 1 and w.stacked_rows() == 16
    w.update_metadata(LoRAMapping([1, 2, 3], [1], False), ids)
    assert w.stacked_rows() == 4
    w.update_metadata(LoRAMapping([1] * 17, [1], False), ids)  # more rows than stacked_max_tokens
    assert w.stacked_rows() is None
    w.update_metadata(LoRAMapping([0, 0], [0], False), ids)  # no adapter: no LoRA at all
    assert w.stacked_rows() is None
    with pytest.raises(ValueError, match="does not hold 2 rows of 4 slots"):
        w.update_metadata(LoRAMapping([1, 4], [1], False), ids)
        w.add_expand_stacked(torch.zeros(2, 8), torch.zeros(2, 3 * 4), torch.zeros(32, 8, 4), (8,),
                             torch.zeros(1, 32, dtype=torch.int32))


def test_launch_layouts_cover_every_slot_bound():
    w = PunicaWrapper(64, 32, "cpu", max_num_prompts=64, stacked_max_tokens=16)
    for rows in (1, 8, 16, 32):
        layouts = w.decode_layouts(rows)
        for key, layout in layouts.items():
            w.apply_layout(rows, layout)
            assert w.launch_key() == key
            if layout.num_adapters:
                assert int(w.token_meta.slots.max()) == layout.slot_bound - 1
        # a real step whose slots reach far up finds its key among them
        ids = list(range(1, 33))
        step = [30 - i % 3 for i in range(rows)]
        w.update_metadata(LoRAMapping(step, step, False), ids)
        assert w.launch_key() in layouts
    # one adapter at 8 rows: one key per slot bound (1, 4, 16, 32); past 16 rows no bound enters the key
    ones = [layout for layout in w.decode_layouts(8).values() if layout.num_adapters == 1]
    assert sorted(layout.slot_bound for layout in ones) == [1, 4, 16, 32]
    assert w.decode_layouts(32).keys() == PunicaWrapper(64, 32, "cpu", max_num_prompts=64).decode_layouts(32).keys()
    assert StepLayout(3).slot_bound is None


def test_steps_with_many_idle_slots_below_their_bound_run_the_shrink_kernel():
    """Rank 64 (max_idle_slots 10): one adapter in slot 20 would make the GEMM read 31 idle slots' A rows."""
    assert max_idle_slots(16) == 40 and max_idle_slots(64) == 10
    w = PunicaWrapper(64, 32, "cpu", max_num_prompts=64, stacked_max_tokens=64, stacked_max_idle_slots=10)
    ids = list(range(1, 33))
    w.update_metadata(LoRAMapping([21] * 4, [21] * 4, False), ids)
    assert w.token_meta.slot_bound == 32 and w.stacked_rows() is None
    w.update_metadata(LoRAMapping(list(range(1, 26)), list(range(1, 26)), False), ids)  # 25 adapters, 7 idle
    assert w.stacked_rows() == 32
    w.update_metadata(LoRAMapping([3, 3, 1], [3, 3, 1], False), ids)  # 2 adapters under bound 4
    assert w.stacked_rows() == 4
    plain = PunicaWrapper(64, 32, "cpu", max_num_prompts=64)
    for rows in (4, 25, 32):  # warm-up's layouts give stacked keys exactly to the steps that stack
        for key, layout in w.decode_layouts(rows).items():
            w.apply_layout(rows, layout)
            plain.apply_layout(rows, layout)
            assert w.launch_key() == key
            assert (w.stacked_rows() is not None) == (key != plain.launch_key())


def test_stacked_expand_runs_bgmv_for_small_shared_steps_only():
    """16 rows of one adapter: SGMV tiles for add_lora_linear (the shrink shares A reads), BGMV for a stacked
    expand of a 4096-wide rank-16 output, not for gate_up's 28672 outputs nor past bgmv_max_rows."""
    meta = PunicaMetadata(64, 32, torch.device("cpu"))
    meta.update(torch.zeros(16, dtype=torch.int32), 1)
    assert not meta.use_bgmv
    assert bgmv_expand(meta, 4096, 16) and bgmv_expand(meta, 4096, 64)
    assert not bgmv_expand(meta, 28672, 16) and not bgmv_expand(meta, 6144, 64)
    meta.update(torch.zeros(33, dtype=torch.int32), 1)
    assert not bgmv_expand(meta, 64, 4)


def test_image_a_all_finds_each_linear_modules_a_rows_across_alignment_gaps():
    """Odd widths in float16 leave gaps between the A regions at the end of an image: the one split that
    activation uses must still land on each module's rows (as image_views sees them)."""
    dims = {"emb": LocalDims(10, (6,), 4, 4, is_embedding=True), "q": LocalDims(9, (5, 3), 4, 4),
            "o": LocalDims(7, (9,), 4, 4), "head": LocalDims(9, (10,), 4, 4)}
    layout = SlotLayout(dims, torch.float16, bias_enabled=False, a_last=frozenset({"q", "o"}))
    assert layout.a_last_names() == ["q", "o"] and layout.arena_bytes < layout.slot_bytes
    slab = torch.arange(layout.slot_bytes, dtype=torch.int64).remainder(251).to(torch.uint8)
    _, regions = layout.image_views(slab)
    for name, flat in zip(layout.a_last_names(), layout.image_a_all(slab)):
        assert torch.equal(flat, regions[name][0].reshape(-1)), name
    with pytest.raises(ValueError, match="not linear"):
        SlotLayout(dims, torch.float16, bias_enabled=False, a_last=frozenset({"emb"}))
