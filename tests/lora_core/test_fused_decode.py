"""The one-launch BGMV decode op (PunicaWrapper(fused_decode_max_tokens=...)) against the torch reference.

On CPU the kernel runs under TRITON_INTERPRET=1 (tests/conftest.py) in
float32 and float16; on a GPU the same tests run in bfloat16 and float16.
"""

from __future__ import annotations

import pytest
import torch

from lora_core.mapping import LoRAMapping
from lora_core.punica import PunicaWrapper, torch_ops
from tests.lora_core.punica_cases import stacked_weights, token_slots

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = (torch.bfloat16, torch.float16) if ON_GPU else (torch.float32, torch.float16)
NUM_SLOTS = 24  # enough distinct adapters that 32-token steps still take the BGMV path
MAX_RANK = 32
MIXED_RANKS = [4, 8, 16, 32, 12]
HIDDEN = 72 if not ON_GPU else 1000  # not a multiple of the K block: the tail is masked
QKV = (64, 16, 16)  # q, k, v of a scaled-down GQA layer
IDS = list(range(101, 101 + NUM_SLOTS))


def _mapping(slots: list[int]) -> LoRAMapping:
    by_slot = [0 if s < 0 else IDS[s] for s in slots]
    return LoRAMapping(by_slot, by_slot, is_prefill=False)


def _slots(num_tokens: int, g: torch.Generator) -> list[int]:
    """Mostly distinct adapters in shuffled order, every fourth token with none, one adapter used twice."""
    slots = token_slots(num_tokens, NUM_SLOTS, "distinct", g)
    slots = [-1 if i % 4 == 1 else s for i, s in enumerate(slots)]
    if num_tokens > 4:
        slots[-1] = slots[0]
    return [slots[i] for i in torch.randperm(num_tokens, generator=g).tolist()]


def _assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    err = (got.float() - want.float()).abs().max().item()
    scale = want.float().abs().max().item() + 1e-6
    limit = 1e-4 if dtype == torch.float32 else 2e-2
    assert err / scale < limit, f"max abs err {err:.3g} vs max {scale:.3g}"


def _case(num_tokens: int, slices: tuple[int, ...], dtype: torch.dtype, with_bias: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    a, b, ranks = stacked_weights(NUM_SLOTS, MAX_RANK, HIDDEN, slices, MIXED_RANKS, dtype, DEVICE, g)
    # Garbage past each adapter's rank: only the ranks table may keep it out.
    pad = torch.arange(MAX_RANK, device=DEVICE) >= ranks[0][:, None]  # [L, R]
    a = torch.where(pad[None, :, :, None], torch.ones_like(a), a)
    b = torch.where(pad[:, None, :], torch.ones_like(b), b)
    bias = torch.randn(NUM_SLOTS, sum(slices), generator=g).to(DEVICE, dtype) if with_bias else None
    slots = _slots(num_tokens, g)
    x = torch.randn(num_tokens, HIDDEN, generator=g).to(DEVICE, dtype)
    y0 = torch.randn(num_tokens, sum(slices), generator=g).to(DEVICE, dtype)
    return a, b, ranks, bias, slots, x, y0


def _run(wrapper: PunicaWrapper, case, slices, scale: float = 0.5) -> torch.Tensor:
    a, b, ranks, bias, slots, x, y0 = case
    wrapper.update_metadata(_mapping(slots), IDS)
    if wrapper.backend == "torch":  # the reference, in float32 on the same low-precision inputs
        y = y0.float()
        wrapper.add_lora_linear(y, x.float(), a.float(), b.float(), None if bias is None else bias.float(),
                                scale, slices, ranks)
        return y
    y = y0.clone()
    wrapper.add_lora_linear(y, x, a, b, bias, scale, slices, ranks)
    return y


@pytest.fixture
def fused_calls(monkeypatch) -> list[int]:
    """Counts launches of the fused op (the row count of each)."""
    from lora_core.punica import triton_ops

    calls: list[int] = []
    real = triton_ops.bgmv_fused

    def spy(y, x, *args, **kwargs):
        calls.append(x.shape[0])
        return real(y, x, *args, **kwargs)

    monkeypatch.setattr(triton_ops, "bgmv_fused", spy)
    return calls


# Every size in the first dtype; a spread in the second (the interpreter is slow).
SIZES = {DTYPES[0]: list(range(1, 33)), DTYPES[1]: [1, 2, 3, 8, 16, 31, 32]}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_decode_size_matches_reference(dtype, fused_calls):
    """T = 1..32, qkv-like slices, mixed ranks and slot -1; bias on every other T."""
    ref = PunicaWrapper(32, NUM_SLOTS, DEVICE, backend="torch")
    tri = PunicaWrapper(32, NUM_SLOTS, DEVICE, backend="triton", fused_decode_max_tokens=32)
    for t in SIZES[dtype]:
        case = _case(t, QKV, dtype, with_bias=t % 2 == 0, seed=t)
        got, want = _run(tri, case, QKV), _run(ref, case, QKV)
        assert tri.token_meta.use_bgmv, f"T={t}: the case must take the BGMV path"
        _assert_close(got, want, dtype)
        untouched = torch.tensor([s < 0 for s in case[4]], device=DEVICE)
        assert torch.equal(got[untouched], case[6][untouched]), f"T={t}: rows with no adapter must not change"
    assert fused_calls == SIZES[dtype], "every step ran the fused op, once"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("slices", [(48,), (40, 24), QKV], ids=["1slice", "2slices", "qkv"])
def test_slices_and_bias(slices, with_bias, dtype, fused_calls):
    case = _case(5, slices, dtype, with_bias, seed=len(slices) * 7 + with_bias)
    got = _run(PunicaWrapper(8, NUM_SLOTS, DEVICE, backend="triton", fused_decode_max_tokens=8), case, slices)
    want = _run(PunicaWrapper(8, NUM_SLOTS, DEVICE, backend="torch"), case, slices)
    _assert_close(got, want, dtype)
    assert fused_calls == [5]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_column_chunks_k_loop_offset_and_overwrite(dtype):
    """The op itself with small blocks: several K steps with a masked tail, several column chunks
    and several N steps per chunk, a column offset into a wider y, and add_inputs=False."""
    from lora_core.punica import triton_ops

    slices = QKV
    a, b, ranks, bias, slots, x, _ = _case(6, slices, dtype, with_bias=True, seed=42)
    wrapper = PunicaWrapper(8, NUM_SLOTS, DEVICE, backend="triton")
    wrapper.update_metadata(_mapping(slots), IDS)
    meta = wrapper.token_meta
    offset = 5
    y0 = torch.full((6, offset + sum(slices) + 3), 3.0, dtype=dtype, device=DEVICE)
    config = dict(block_k=32, block_n=16, n_per_prog=32, num_warps=4)
    for add_inputs in (True, False):
        got = y0.clone()
        triton_ops.bgmv_fused(got, x, a, b, ranks, wrapper._offsets(slices), max(slices), meta, 0.5, offset,
                              bias, add_inputs, config=config)
        want = y0.float()
        buf = torch.zeros(len(slices), 6, MAX_RANK, device=DEVICE)
        torch_ops.shrink(buf, x.float(), a.float(), meta.slots, ranks, 0.5)
        torch_ops.expand(want, buf, b.float(), meta.slots, ranks, slices, offset, bias.float(), add_inputs)
        _assert_close(got, want, dtype)
        assert torch.all(got[:, :offset] == 3.0) and torch.all(got[:, offset + sum(slices):] == 3.0)
        none = torch.tensor([s < 0 for s in slots], device=DEVICE)
        assert torch.all(got[none] == 3.0)


def test_fused_path_is_chosen_from_the_step_layout(fused_calls):
    """Fused only when switched on, for BGMV steps of at most fused_decode_max_tokens rows."""
    case1 = _case(1, QKV, torch.float32, False, seed=1)
    case16 = _case(16, QKV, torch.float32, False, seed=2)
    off = PunicaWrapper(32, NUM_SLOTS, DEVICE, backend="triton")
    on = PunicaWrapper(32, NUM_SLOTS, DEVICE, backend="triton", fused_decode_max_tokens=8)
    _run(off, case1, QKV)
    assert fused_calls == [], "off by default"
    _run(on, case1, QKV)
    _run(on, case16, QKV)  # BGMV, but more rows than the limit
    assert fused_calls == [1]
    same = list(case16)
    same[4] = [0] * 16  # one adapter for 16 tokens: SGMV tiles, never fused
    _run(PunicaWrapper(32, NUM_SLOTS, DEVICE, backend="triton", fused_decode_max_tokens=32), same, QKV)
    assert fused_calls == [1]
    # The choice follows (num_rows, use_bgmv), which the launch key already holds.
    for w in (on, off):
        w.update_metadata(_mapping(case1[4]), IDS)
    assert on.launch_key() == off.launch_key()
