"""Launch keys: what a CUDA graph of a decode step freezes of the punica metadata."""

from __future__ import annotations

import torch

from lora_core.mapping import LoRAMapping
from lora_core.punica import PunicaWrapper


def test_decode_layouts_cover_every_adapter_count():
    wrapper = PunicaWrapper(64, max_loras=8, device="cpu", max_num_prompts=64)
    for rows in (1, 4, 16, 32, 64):
        layouts = wrapper.decode_layouts(rows)
        # every adapter count maps to one of the listed keys, and each key is reproduced by set_decode_layout
        for adapters in range(min(rows, 8) + 1):
            wrapper.set_decode_layout(rows, adapters)
            assert wrapper.launch_key() in layouts
        for key, layout in layouts.items():
            wrapper.apply_layout(rows, layout)
            assert wrapper.launch_key() == key
            assert wrapper.token_meta.num_rows == rows and wrapper.token_meta.num_adapters == layout.num_adapters
    # no adapter, BGMV (adapters barely shared) and SGMV tiles are all reachable at 16 rows with 8 slots
    keys = wrapper.decode_layouts(16)
    assert (16, 0, 16, 0) in keys
    assert {key[3] for key in keys if len(key) > 2} == {True, False}


def test_a_real_step_has_the_key_of_its_synthetic_twin():
    """A step with 3 adapters over 8 rows launches like set_decode_layout(8, 3), whatever the ids."""
    wrapper = PunicaWrapper(64, max_loras=4, device="cpu", max_num_prompts=64)
    ids = [7, 7, 9, 0, 11, 9, 0, 7]
    wrapper.update_metadata(LoRAMapping(ids, ids, is_prefill=False), [7, 9, 11, None])
    key = wrapper.launch_key()
    wrapper.set_decode_layout(8, 3)
    assert wrapper.launch_key() == key
    assert torch.equal(wrapper.token_meta.slots, torch.tensor([0, 1, 2, 0, 1, 2, 0, 1], dtype=torch.int32))


def test_sgmv_grids_are_bounded_by_the_steps_adapters_not_the_slots():
    """32 rows over 32 slots: one adapter launches 2 tiles' programs, not the 33 that every slot would
    need; 3 adapters count as 4 and 5-16 as 16 (powers of four, so few graphs cover every count)."""
    wrapper = PunicaWrapper(64, max_loras=32, device="cpu", max_num_prompts=64)
    tiles = {}
    for adapters in (1, 2, 3, 4, 5, 8, 15):
        wrapper.set_decode_layout(32, adapters)
        assert not wrapper.token_meta.use_bgmv
        tiles[adapters] = wrapper.token_meta.max_tiles
    assert tiles == {1: 2, 2: 5, 3: 5, 4: 5, 5: 17, 8: 17, 15: 17}
    # a real step: every tile it has fits under its bound (3 adapters, 30 rows of one and 1 each of two)
    ids = [5] * 30 + [6, 7]
    wrapper.update_metadata(LoRAMapping(ids, ids, is_prefill=False), list(range(5, 37)))
    assert int(wrapper.token_meta.num_tiles) == 4 <= wrapper.token_meta.max_tiles == 5


def test_small_steps_of_few_adapters_get_one_launch_keys():
    """fused_max_adapters: a stacked step of <= fused_max_tokens rows whose adapter bound is within it keys its
    graphs by its phase-A programs (its adapter bound); larger steps keep the stacked key, and the
    synthetic layouts reproduce both."""
    def wrapper(fused_max_adapters: int, backend: str = "triton") -> PunicaWrapper:
        return PunicaWrapper(64, max_loras=8, device="cpu", max_num_prompts=64, backend=backend,
                             stacked_max_tokens=64, fused_max_adapters=fused_max_adapters, fused_max_tokens=32)

    one, stacked, torch_backend = wrapper(4), wrapper(0), wrapper(4, "torch")
    for rows, adapters, fused in ((16, 1, 1), (16, 3, 4), (2, 2, 4), (16, 5, 0), (48, 2, 0)):
        for w in (one, stacked, torch_backend):
            w.set_decode_layout(rows, adapters)
        assert one.token_launch_key() == stacked.token_launch_key() + ((fused,) if fused else ())
        assert torch_backend.token_launch_key() == stacked.token_launch_key()  # never on the torch backend
    for rows in (1, 16, 32):
        for key, layout in one.decode_layouts(rows).items():
            one.apply_layout(rows, layout)
            assert one.launch_key() == key
