"""PunicaWrapper.lora_linear: x @ W^T plus the LoRA, the expand writing the delta before the base GEMM adds into it.

On CPU the Triton kernels run under TRITON_INTERPRET=1 (tests/conftest.py); on a GPU the same tests run in
bfloat16 and float16 against a float32 torch reference.
"""

from __future__ import annotations

import pytest
import torch

from lora_core.mapping import LoRAMapping
from lora_core.punica import PunicaWrapper, triton_ops
from tests.lora_core.punica_cases import stacked_weights, token_slots

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = (torch.bfloat16, torch.float16) if ON_GPU else (torch.float32, torch.float16)
HIDDEN = 512 if ON_GPU else 64
SLICES = {1: (96,), 2: (80, 48), 3: (64, 32, 16)}
IDS = [11, 12, 13, 14, 15, 16]


def _case(num_tokens: int, popularity: str, num_slices: int, dtype: torch.dtype, none_fraction: float):
    g = torch.Generator().manual_seed(num_tokens * 7 + num_slices)
    slices = SLICES[num_slices]
    a, b, ranks = stacked_weights(len(IDS), 64, HIDDEN, slices, [4, 16, 64, 8], dtype, DEVICE, g)
    slots = token_slots(num_tokens, len(IDS), popularity, g, none_fraction=none_fraction)
    by_slot = [0 if s < 0 else IDS[s] for s in slots]
    mapping = LoRAMapping(by_slot, by_slot[-2:], True)
    x = torch.randn(num_tokens, HIDDEN, generator=g).to(DEVICE, dtype)
    w = (torch.randn(sum(slices), HIDDEN, generator=g) / HIDDEN ** 0.5).to(DEVICE, dtype)
    return mapping, x, w, a, b, ranks, slices


def _reference(mapping, x, w, a, b, ranks, slices) -> torch.Tensor:
    ref = PunicaWrapper(1024, len(IDS), DEVICE, backend="torch")
    ref.update_metadata(mapping, IDS)
    y = x.float() @ w.float().t()
    ref.add_lora_linear(y, x.float(), a.float(), b.float(), None, 1.0, slices, ranks)
    return y


@pytest.fixture
def expands(monkeypatch):
    """Every Triton expand launch's (add_inputs, zero_base)."""
    calls, real = [], triton_ops.expand

    def spy(*args, **kwargs):
        calls.append((kwargs.get("add_inputs", args[9] if len(args) > 9 else None), kwargs.get("zero_base", False)))
        return real(*args, **kwargs)

    monkeypatch.setattr(triton_ops, "expand", spy)
    return calls


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_slices", [1, 3])
@pytest.mark.parametrize("popularity", ["identical", "zipf", "distinct"])
@pytest.mark.parametrize("num_tokens", [40, 200])
def test_sgmv_steps_write_the_delta_and_the_gemm_adds_into_it(num_tokens, popularity, num_slices, dtype, expands):
    mapping, x, w, a, b, ranks, slices = _case(num_tokens, popularity, num_slices, dtype, none_fraction=0.3)
    assert any(i == 0 for i in mapping.index_mapping), "the case must hold rows with no adapter"
    tri = PunicaWrapper(1024, len(IDS), DEVICE, backend="triton")
    tri.update_metadata(mapping, IDS)
    got = tri.lora_linear(x, w, a, b, None, slices, ranks)
    want = _reference(mapping, x, w, a, b, ranks, slices)
    err = (got.float() - want).abs().max() / want.abs().max()
    assert err < (1e-4 if dtype == torch.float32 else 2e-2), err
    assert expands == [(False, True)], "an SGMV step writes the delta (no read of y) and zeroes the base rows"


@pytest.mark.parametrize("none_fraction", [0.0, 0.3, 1.0])
def test_the_zeroing_expand_writes_every_row_and_reads_none(none_fraction):
    """What lora_linear's new tensor held before (here NaN) reaches no output: adapter rows get the delta,
    the others zeros."""
    dtype = DTYPES[-1]
    mapping, x, w, a, b, ranks, slices = _case(72, "zipf", 3, dtype, none_fraction)
    tri = PunicaWrapper(1024, len(IDS), DEVICE, backend="triton")
    tri.update_metadata(mapping, IDS)
    buf, splits = tri._shrink_partials(x, a, ranks, 1.0, tri.token_meta, bgmv=False)
    y = torch.full((72, sum(slices)), float("nan"), dtype=dtype, device=DEVICE)
    triton_ops.expand(y, buf, b, ranks, tri._offsets(slices), max(slices), tri.token_meta, 0, None,
                      add_inputs=False, shrink_splits=splits, bgmv=False, zero_base=True)
    want = torch.zeros(72, sum(slices), device=DEVICE)
    ref = PunicaWrapper(1024, len(IDS), DEVICE, backend="torch")
    ref.update_metadata(mapping, IDS)
    ref.add_lora_linear(want, x.float(), a.float(), b.float(), None, 1.0, slices, ranks)
    assert not torch.isnan(y).any()
    base = torch.tensor([i == 0 for i in mapping.index_mapping], device=DEVICE)
    assert torch.count_nonzero(y[base]) == 0
    if not base.all():
        assert (y.float() - want).abs().max() / want.abs().max() < 2e-2


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_step_of_base_rows_only_is_the_base_gemm(dtype, expands):
    mapping, x, w, a, b, ranks, slices = _case(48, "zipf", 2, dtype, none_fraction=1.0)
    tri = PunicaWrapper(1024, len(IDS), DEVICE, backend="triton")
    tri.update_metadata(mapping, IDS)
    got = tri.lora_linear(x, w, a, b, None, slices, ranks)
    want = x.float() @ w.float().t()
    assert (got.float() - want).abs().max() / want.abs().max() < (1e-4 if dtype == torch.float32 else 2e-2)
    assert expands == [(False, True)]


@pytest.mark.parametrize("num_tokens", [1, 7])
def test_bgmv_steps_and_the_torch_backend_add_the_lora_after_the_gemm(num_tokens, expands):
    dtype = DTYPES[-1]
    mapping, x, w, a, b, ranks, slices = _case(num_tokens, "distinct", 2, dtype, none_fraction=0.3)
    want = _reference(mapping, x, w, a, b, ranks, slices)
    for backend in ("triton", "torch"):
        p = PunicaWrapper(1024, len(IDS), DEVICE, backend=backend)
        p.update_metadata(mapping, IDS)
        got = p.lora_linear(x, w, a, b, None, slices, ranks)
        assert (got.float() - want).abs().max() / want.abs().max() < 2e-2, backend
    assert expands == [(True, False)], "a BGMV step reads y back: its kernels have no zeroing programs"


def test_zero_base_is_refused_where_the_expand_reads_y():
    p = PunicaWrapper(64, 2, DEVICE, backend="triton")
    p.update_metadata(LoRAMapping([11] * 40, [11], True), [11, None])
    buf = torch.zeros(1, 1, 40, 16, device=DEVICE)
    b = torch.zeros(2, 32, 16, device=DEVICE)
    ranks = torch.full((1, 2), 16, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="zero_base"):
        triton_ops.expand(torch.zeros(40, 32, device=DEVICE), buf, b, ranks, p._offsets((32,)), 32, p.token_meta, 0,
                          None, add_inputs=True, zero_base=True)
