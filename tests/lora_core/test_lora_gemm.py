"""The one-launch LoRA GEMM (lora_core/punica/lora_gemm.py) against its plain-torch reference.

On CPU the kernel runs under TRITON_INTERPRET=1 (tests/conftest.py) in float32 and float16; on a GPU the
same tests run in bfloat16 and float16. Sizes stay small: the interpreter runs every program in turn.
"""

from __future__ import annotations

import pytest
import torch

import numpy as np

from lora_core.punica.lora_gemm import LoRAGemm, reference
from lora_core.punica.metadata import host_active
from tests.lora_core.punica_cases import token_slots

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = (torch.bfloat16, torch.float16) if ON_GPU else (torch.float32, torch.float16)
LIMIT = {torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 2e-2}
NUM_SLOTS, RANK = 6, 16
QKV, GATE_UP, O = (64, 32, 32), (32, 32), (64,)

# rows, slices, K, block_n, split_w, a_splits, prefetch_b, popularity, rows with no adapter, padding of active
CASES = [
    (1, O, 64, 32, 1, 1, True, "identical", (), 0),
    (1, QKV, 128, 32, 2, 3, False, "identical", (), 3),
    (2, GATE_UP, 256, 16, 1, 3, True, "distinct", (), 2),
    (3, QKV, 128, 16, 2, 1, True, "zipf", (0,), 4),
    (4, GATE_UP, 64, 32, 2, 3, False, "distinct", (2,), 0),
    (5, QKV, 256, 32, 1, 1, False, "zipf", (1, 3), 5),
    (5, O, 128, 16, 2, 3, True, "distinct", (4,), 1),
    (5, (32,), 64, 16, 1, 3, False, "identical", (0, 1, 2, 3, 4), 1),  # one active slot that no row uses
    (17, QKV, 128, 32, 2, 3, True, "zipf", (0, 5, 16), 2),
]


def _weights(n: int, k: int, slices: tuple[int, ...], dtype: torch.dtype, g: torch.Generator, rank: int = RANK):
    """w [N, K], a [L, S*R, K], b [L, N, R], scaled so the base and the LoRA terms are both of order one."""
    w = torch.randn(n, k, generator=g) / k ** 0.5
    a = torch.randn(NUM_SLOTS, len(slices) * rank, k, generator=g) / k ** 0.5
    b = torch.randn(NUM_SLOTS, n, rank, generator=g) / rank ** 0.5
    return w.to(DEVICE, dtype), a.to(DEVICE, dtype), b.to(DEVICE, dtype)


def _tables(slots: list[int], max_active: int, active_slots: list[int] | None = None):
    """rows (slots and host_active's index per row, int32), active padded with 0 to max_active entries,
    num_active [1]."""
    row_active, active, count = host_active(np.array(slots, dtype=np.int32), NUM_SLOTS)
    row_active, active = row_active.tolist(), active[:count[0]].tolist()
    active = active if active_slots is None else active_slots
    padded = active + [0] * max(0, max_active - len(active))

    def ints(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=DEVICE)
    return (ints(slots), ints(row_active)), ints(padded), ints([len(active)])


def _run(g: LoRAGemm, x, w, a, b, rows, active, num_active, **kw) -> torch.Tensor:
    y = torch.full((x.shape[0], w.shape[0]), float("nan"), dtype=x.dtype, device=DEVICE)
    g(y, x, w, a, b, *rows, active, num_active, **kw)
    return y


def _assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    err = (got.float() - want.float()).abs().max().item()
    scale = want.float().abs().max().item() + 1e-6
    assert err / scale < LIMIT[dtype], f"max abs err {err:.3g} vs max {scale:.3g}"


def _counters_zero(g: LoRAGemm) -> bool:
    return int(g.cnt.abs().sum()) == 0 and int(g.tile_cnt.abs().sum()) == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m,slices,k,block_n,split_w,a_splits,prefetch_b,popularity,none,pad", CASES,
                         ids=[f"m{c[0]}-s{len(c[1])}-k{c[2]}-bn{c[3]}-w{c[4]}-a{c[5]}-{'pf' if c[6] else 'nopf'}-{c[7]}"
                              for c in CASES])
def test_matches_reference(m, slices, k, block_n, split_w, a_splits, prefetch_b, popularity, none, pad, dtype):
    """y = x @ w^T + each row's own adapter per slice (none for slot -1), over tilings, K splits of both phases,
    B prefetched or not, and an active table padded past the step's adapters; the counters end at zero."""
    gen = torch.Generator().manual_seed(m * 1000 + k + len(slices))
    n = sum(slices)
    w, a, b = _weights(n, k, slices, dtype, gen)
    slots = token_slots(m, NUM_SLOTS, popularity, gen)
    slots = [-1 if i in none else (s + 2) % NUM_SLOTS for i, s in enumerate(slots)]  # slot 0 is not special
    # a step's active table may name an adapter no row uses (the case where every row is -1)
    active_slots = [5] if all(s < 0 for s in slots) else None
    max_active = len(active_slots or {s for s in slots if s >= 0}) + pad
    rows, active, num_active = _tables(slots, max_active, active_slots)
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    g = LoRAGemm(n, k, slices, RANK, m, max_active, DEVICE, block_n=block_n, block_k=32, split_w=split_w,
                 block_ka=32, a_splits=a_splits, prefetch_b=prefetch_b)
    assert g.block_m == (32 if m == 17 else 16)
    got = _run(g, x, w, a, b, rows, active, num_active)
    want = reference(x, w, a, b, torch.tensor(slots), slices, RANK)
    _assert_close(got, want, dtype)
    if any(s >= 0 for s in slots):  # the LoRA term is not vacuous
        assert (want - x.float() @ w.float().t()).abs().max() > 0.1
    assert _counters_zero(g), (g.cnt, g.tile_cnt)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rank,slices,m,popularity", [(32, QKV, 3, "zipf"), (64, GATE_UP, 5, "distinct"),
                                                      (64, O, 2, "identical")])
def test_ranks_above_one_chunk_match_reference(rank, slices, m, popularity, dtype):
    """Ranks past RANK_CHUNK: the expand adds each row's LoRA term a chunk of ranks at a time (B gathered after
    the K loop, the default there), and equals the reference."""
    gen = torch.Generator().manual_seed(rank + m)
    n, k = sum(slices), 64
    w, a, b = _weights(n, k, slices, dtype, gen, rank)
    slots = [(s + 1) % NUM_SLOTS for s in token_slots(m, NUM_SLOTS, popularity, gen)]
    slots[0] = -1 if m > 2 else slots[0]
    max_active = len({s for s in slots if s >= 0})
    rows, active, num_active = _tables(slots, max_active)
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    g = LoRAGemm(n, k, slices, rank, m, max_active, DEVICE, block_n=32, block_k=32, block_ka=16, a_splits=2)
    assert not g.prefetch_b and g.rank_chunk == 16
    got = _run(g, x, w, a, b, rows, active, num_active)
    want = reference(x, w, a, b, torch.tensor(slots), slices, rank)
    _assert_close(got, want, dtype)
    assert (want - x.float() @ w.float().t()).abs().max() > 0.1
    assert _counters_zero(g)
    with pytest.raises(ValueError, match="prefetch_b"):
        LoRAGemm(n, k, slices, rank, m, max_active, DEVICE, block_n=32, block_k=32, prefetch_b=True)


@pytest.mark.parametrize("split_w,a_splits", [(1, 1), (2, 3), (4, 2)])
def test_repeated_launches_agree_and_reset_counters(split_w, a_splits):
    """Launches of one LoRAGemm give the same bits each time, whatever ran between them, and every launch
    leaves cnt and tile_cnt at zero for the next."""
    dtype = DTYPES[-1]
    gen = torch.Generator().manual_seed(21)
    slices, k = QKV, 128
    w, a, b = _weights(sum(slices), k, slices, dtype, gen)
    steps = [[3, -1, 1, 3, 0], [-1, 2, 2, 2, 5]]
    tables = [_tables(slots, 4) for slots in steps]
    x = torch.randn(5, k, generator=gen).to(DEVICE, dtype)
    g = LoRAGemm(sum(slices), k, slices, RANK, 5, 4, DEVICE, block_n=32, block_k=32, split_w=split_w,
                 block_ka=32, a_splits=a_splits)
    first = [_run(g, x, w, a, b, *t) for t in tables]
    assert _counters_zero(g)
    for _ in range(2):
        for t, want in zip(tables, first):
            assert torch.equal(_run(g, x, w, a, b, *t), want)
            assert _counters_zero(g), (g.cnt, g.tile_cnt)
    for slots, got in zip(steps, first):
        _assert_close(got, reference(x, w, a, b, torch.tensor(slots), slices, RANK), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_step_without_adapters_is_plain_gemm(dtype):
    """num_active = 0 and every row -1: phase A's programs do nothing and y is x @ w^T."""
    gen = torch.Generator().manual_seed(3)
    slices, k = GATE_UP, 128
    w, a, b = _weights(sum(slices), k, slices, dtype, gen)
    x = torch.randn(4, k, generator=gen).to(DEVICE, dtype)
    rows, active, num_active = _tables([-1] * 4, 3)
    assert int(num_active) == 0
    g = LoRAGemm(sum(slices), k, slices, RANK, 4, 3, DEVICE, block_n=16, block_k=32, split_w=2, block_ka=32,
                 a_splits=3)
    _assert_close(_run(g, x, w, a, b, rows, active, num_active), x.float() @ w.float().t(), dtype)
    assert _counters_zero(g)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_max_active_zero_is_plain_gemm(dtype):
    """max_active = 0 (in the constructor or as the launch's override) has no LoRA phase: y is x @ w^T even
    where rows name adapters."""
    gen = torch.Generator().manual_seed(4)
    slices, k = QKV, 64
    w, a, b = _weights(sum(slices), k, slices, dtype, gen)
    x = torch.randn(3, k, generator=gen).to(DEVICE, dtype)
    tables = _tables([1, 4, -1], 2)
    want = x.float() @ w.float().t()
    for max_active, override in ((0, None), (2, 0)):
        g = LoRAGemm(sum(slices), k, slices, RANK, 3, max_active, DEVICE, block_n=32, block_k=32, split_w=2,
                     block_ka=32)
        _assert_close(_run(g, x, w, a, b, *tables, max_active=override), want, dtype)
        assert _counters_zero(g)


def test_block_n_must_divide_every_slice():
    """A tile must lie in one slice: block_n dividing N but not a slice width is refused, as is a bad N or K."""
    with pytest.raises(ValueError, match="block_n 32"):
        LoRAGemm(64, 64, (48, 16), RANK, 4, 2, "cpu", block_n=32, block_k=32)
    with pytest.raises(ValueError, match="block_n"):
        LoRAGemm(48, 64, (48,), RANK, 4, 2, "cpu", block_n=32, block_k=32)
    with pytest.raises(ValueError, match="block_k"):
        LoRAGemm(64, 80, (64,), RANK, 4, 2, "cpu", block_n=32, block_k=32)
    LoRAGemm(64, 64, (32, 32), RANK, 4, 2, "cpu", block_n=32, block_k=32)  # widths that divide are accepted
    for rank in (8, 24):  # the expand's tiles need a power of two >= 16
        with pytest.raises(ValueError, match=f"rank {rank}"):
            LoRAGemm(64, 64, (64,), rank, 4, 2, "cpu", block_n=32, block_k=32)


def test_launch_beyond_workspaces_is_refused():
    """More adapters than the workspaces were sized for, or more rows than the row block, raise ValueError."""
    w, a, b = _weights(32, 64, (32,), torch.float32, torch.Generator().manual_seed(3))
    g = LoRAGemm(32, 64, (32,), RANK, 4, 1, DEVICE, block_n=16, block_k=32, block_ka=32)
    rows, active, num_active = _tables([1, 2], 2)
    with pytest.raises(ValueError, match="adapters"):
        _run(g, torch.zeros(2, 64, device=DEVICE), w.float(), a.float(), b.float(), rows, active, num_active,
             max_active=2)
    rows, active, num_active = _tables([1] * 17, 1)
    with pytest.raises(ValueError, match="rows"):
        _run(g, torch.zeros(17, 64, device=DEVICE), w.float(), a.float(), b.float(), rows, active, num_active)
