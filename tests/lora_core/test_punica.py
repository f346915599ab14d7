"""Triton punica kernels against the plain-torch reference.

On CPU the kernels run under TRITON_INTERPRET=1 (tests/conftest.py) in
float32 and float16; on a GPU the same tests run in bfloat16 and float16.
"""

from __future__ import annotations

import pytest
import torch

from lora_core.errors import UnknownLoRAError
from lora_core.mapping import LoRAMapping
from lora_core.punica import PunicaWrapper
from tests.lora_core.punica_cases import POPULARITY, stacked_weights, token_slots

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = (torch.bfloat16, torch.float16) if ON_GPU else (torch.float32, torch.float16)
NUM_SLOTS = 6
MAX_RANK = 64
MIXED_RANKS = [4, 8, 16, 32, 64, 12]
HIDDEN = 64 if not ON_GPU else 512
SLICES = {1: (96,), 2: (80, 48), 3: (64, 32, 16)}  # unequal widths, as GQA qkv


def _mapping(slots: list[int], ids: list[int | None], is_prefill: bool) -> LoRAMapping:
    by_slot = [0 if s < 0 else ids[s] for s in slots]
    return LoRAMapping(by_slot, by_slot[-4:], is_prefill)


def _wrappers(mapping: LoRAMapping, ids: list[int | None]):
    out = []
    for backend in ("torch", "triton"):
        w = PunicaWrapper(1024, NUM_SLOTS, DEVICE, backend=backend)
        w.update_metadata(mapping, ids)
        out.append(w)
    return out


def _assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    err = (got.float() - want.float()).abs().max().item()
    scale = want.float().abs().max().item() + 1e-6
    limit = 1e-4 if dtype == torch.float32 else 2e-2
    assert err / scale < limit, f"max abs err {err:.3g} vs max {scale:.3g}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_slices", [1, 2, 3])
@pytest.mark.parametrize("popularity", POPULARITY)
@pytest.mark.parametrize("num_tokens", [1, 7, 64, 200, 512])
def test_lora_linear_matches_reference(num_tokens, popularity, num_slices, dtype):
    g = torch.Generator().manual_seed(num_tokens * 31 + num_slices)
    slices = SLICES[num_slices]
    a, b, ranks = stacked_weights(NUM_SLOTS, MAX_RANK, HIDDEN, slices, MIXED_RANKS, dtype, DEVICE, g)
    slots = token_slots(num_tokens, NUM_SLOTS, popularity, g, none_fraction=0.2 if num_tokens > 1 else 0.0)
    ids = [11, 12, 13, 14, 15, 16]
    ref, tri = _wrappers(_mapping(slots, ids, num_tokens > 16), ids)
    x = torch.randn(num_tokens, HIDDEN, generator=g).to(DEVICE, dtype)
    y0 = torch.randn(num_tokens, sum(slices), generator=g).to(DEVICE, dtype)
    want, got = y0.clone(), y0.clone()
    # The reference runs in float32 on the same low-precision inputs.
    ref.add_lora_linear(want_f := want.float(), x.float(), a.float(), b.float(), None, 0.5, slices, ranks)
    tri.add_lora_linear(got, x, a, b, None, 0.5, slices, ranks)
    _assert_close(got, want_f, dtype)
    untouched = torch.tensor([s < 0 for s in slots], device=DEVICE)
    assert torch.equal(got[untouched], y0[untouched]), "rows with no adapter must not change"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_shrink_then_expand_equals_fused(dtype):
    """add_shrink + add_expand (the fully-sharded path) equals add_lora_linear."""
    g = torch.Generator().manual_seed(3)
    slices = SLICES[3]
    a, b, ranks = stacked_weights(NUM_SLOTS, 32, HIDDEN, slices, [4, 32, 16], dtype, DEVICE, g)
    slots = token_slots(40, NUM_SLOTS, "zipf", g, none_fraction=0.1)
    ids = [1, 2, 3, 4, 5, 6]
    ref, tri = _wrappers(_mapping(slots, ids, True), ids)
    x = torch.randn(40, HIDDEN, generator=g).to(DEVICE, dtype)
    for w in (ref, tri):
        buf = torch.zeros(3, 40, 32, dtype=torch.float32, device=DEVICE)
        w.add_shrink(buf, x, a, 2.0, ranks)
        y = torch.zeros(40, 7 + sum(slices), dtype=dtype, device=DEVICE)
        w.add_expand(y, buf, b, slices, offset_start=7, ranks=ranks)
        fused = torch.zeros(40, sum(slices), dtype=dtype, device=DEVICE)
        w.add_lora_linear(fused, x, a, b, None, 2.0, slices, ranks)
        assert torch.count_nonzero(y[:, :7]) == 0, "offset_start columns before the slices stay untouched"
        _assert_close(y[:, 7:], fused, dtype)
        w.result = y
    _assert_close(tri.result, ref.result, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bias_and_overwrite(dtype):
    g = torch.Generator().manual_seed(5)
    slices = SLICES[2]
    a, b, ranks = stacked_weights(NUM_SLOTS, 16, HIDDEN, slices, [8, 16], dtype, DEVICE, g)
    bias = torch.randn(NUM_SLOTS, sum(slices), generator=g).to(DEVICE, dtype)
    slots = token_slots(20, NUM_SLOTS, "uniform", g, none_fraction=0.3)
    ids = [1, 2, 3, 4, 5, 6]
    results = []
    for w in _wrappers(_mapping(slots, ids, False), ids):
        buf = torch.zeros(2, 20, 16, device=DEVICE)
        w.add_shrink(buf, torch.randn(20, HIDDEN, generator=torch.Generator().manual_seed(9)).to(DEVICE, dtype),
                     a, 1.0, ranks)
        y = torch.full((20, sum(slices)), 3.0, dtype=dtype, device=DEVICE)
        w.add_expand(y, buf, b, slices, add_inputs=False, ranks=ranks, lora_bias_stacked=bias)
        results.append(y)
    _assert_close(results[1], results[0], dtype)
    none_rows = torch.tensor([s < 0 for s in slots], device=DEVICE)
    assert torch.all(results[1][none_rows] == 3.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_embedding_and_logits(dtype):
    g = torch.Generator().manual_seed(7)
    vocab, dim, rank = 50, HIDDEN, 16
    emb_a = torch.randn(1, NUM_SLOTS, vocab, rank, generator=g).to(DEVICE, dtype)
    emb_b = torch.randn(NUM_SLOTS, dim, rank, generator=g).to(DEVICE, dtype)
    head_a, head_b, head_ranks = stacked_weights(NUM_SLOTS, rank, dim, (vocab,), [8, 16], dtype, DEVICE, g)
    slots = token_slots(30, NUM_SLOTS, "zipf", g, none_fraction=0.2)
    ids = [21, 22, 23, 24, 25, 26]
    token_ids = torch.randint(-5, vocab + 5, (30,), generator=g).to(DEVICE)  # some outside this shard
    outs = []
    for w in _wrappers(_mapping(slots, ids, True), ids):
        y = torch.zeros(30, dim, dtype=dtype, device=DEVICE)
        w.add_lora_embedding(y, token_ids, emb_a, emb_b)
        logits = torch.zeros(4, vocab, dtype=dtype, device=DEVICE)
        h = torch.randn(4, dim, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
        w.add_lora_logits(logits, h, head_a, head_b, 1.0, head_ranks)
        outs.append((y, logits))
    _assert_close(outs[1][0], outs[0][0], dtype)
    _assert_close(outs[1][1], outs[0][1], dtype)
    # Direct check of the embedding semantics for one owned token.
    i = next(i for i, s in enumerate(slots) if s >= 0 and 0 <= token_ids[i] < vocab)
    want = emb_a[0, slots[i], token_ids[i]].float() @ emb_b[slots[i]].float().t()
    _assert_close(outs[1][0][i], want, dtype)
    foreign = [i for i, s in enumerate(slots) if s >= 0 and not 0 <= token_ids[i] < vocab]
    assert all(torch.count_nonzero(outs[1][0][i]) == 0 for i in foreign)


def test_reference_matches_plain_loop():
    """The torch reference itself against a per-token loop written from the semantics."""
    g = torch.Generator().manual_seed(11)
    slices = (24, 8)
    a, b, ranks = stacked_weights(3, 8, 16, slices, [2, 8, 5], torch.float32, "cpu", g)
    slots = [0, -1, 2, 1, 1, 0, -1]
    ids = [1, 2, 3]
    w = PunicaWrapper(16, 3, "cpu", backend="torch")
    w.update_metadata(_mapping(slots, ids, False), ids)
    x = torch.randn(len(slots), 16, generator=g)
    y = torch.zeros(len(slots), 32)
    w.add_lora_linear(y, x, a, b, None, 0.25, slices, ranks)
    for i, s in enumerate(slots):
        if s < 0:
            assert torch.count_nonzero(y[i]) == 0
            continue
        parts = []
        for k, (lo, hi) in enumerate([(0, 24), (24, 32)]):
            r = int(ranks[k, s])
            parts.append((x[i] @ a[k, s, :r].t() * 0.25) @ b[s, lo:hi, :r].t())
        torch.testing.assert_close(y[i], torch.cat(parts))


def test_errors_are_clear():
    w = PunicaWrapper(8, 2, "cpu", backend="torch")
    with pytest.raises(UnknownLoRAError, match="lora id 9"):
        w.update_metadata(LoRAMapping([9], [9]), [1, None])
    with pytest.raises(ValueError, match="exceed"):
        w.update_metadata(LoRAMapping([1] * 9, [1]), [1, None])
    w.update_metadata(LoRAMapping([1, 0], [1]), [1, None])
    a = torch.zeros(1, 2, 4, 8)
    with pytest.raises(TypeError, match="float16"):
        w.add_lora_linear(torch.zeros(2, 4), torch.zeros(2, 8, dtype=torch.float16), a, torch.zeros(2, 4, 4),
                          output_slices=(4,))
    with pytest.raises(ValueError, match="output_slices"):
        w.add_lora_linear(torch.zeros(2, 4), torch.zeros(2, 8), a, torch.zeros(2, 4, 4), output_slices=(3,))
    with pytest.raises(ValueError, match="backend"):
        PunicaWrapper(8, 2, "cpu", backend="cuda")
