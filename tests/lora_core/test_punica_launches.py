"""How the Triton punica kernels launch and what they read, against the plain-torch reference: decode paths
(BGMV and SGMV, K splits), programs dealt over real tiles, reads bounded by ranks and rows, and under
programmatic dependent launch the wait for the kernels before them.

On CPU the kernels run under TRITON_INTERPRET=1 (tests/conftest.py); the semantics of each op are
tests/lora_core/test_punica.py's, whose helpers these share.
"""

from __future__ import annotations

import pytest
import torch

from lora_core.mapping import LoRAMapping
from lora_core.punica import PunicaWrapper
from lora_core.punica.metadata import adapter_bound, max_tiles
from tests.lora_core.punica_cases import lora_linear_both, stacked_weights, token_slots
from tests.lora_core.test_punica import DEVICE, DTYPES, HIDDEN, NUM_SLOTS, ON_GPU, SLICES, _assert_close, _mapping


def _pair(mapping: LoRAMapping, ids: list[int], max_rows: int, bgmv_max_tokens: int | None = None,
          num_slots: int = NUM_SLOTS) -> tuple[PunicaWrapper, PunicaWrapper]:
    """(torch reference, Triton) wrappers with the step's metadata; bgmv_max_tokens for Triton (None: default)."""
    extra = {} if bgmv_max_tokens is None else {"bgmv_max_tokens": bgmv_max_tokens}
    ref = PunicaWrapper(max_rows, num_slots, DEVICE, backend="torch")
    tri = PunicaWrapper(max_rows, num_slots, DEVICE, backend="triton", **extra)
    for w in (ref, tri):
        w.update_metadata(mapping, ids)
    return ref, tri


def _linear_both(ref: PunicaWrapper, tri: PunicaWrapper, x, a, b, y0, slices, ranks, scale: float) -> torch.Tensor:
    """add_lora_linear onto copies of y0 through both backends (torch in float32): they agree; Triton's result."""
    want, got = y0.float().clone(), y0.clone()
    ref.add_lora_linear(want, x.float(), a.float(), b.float(), None, scale, slices, ranks)
    tri.add_lora_linear(got, x, a, b, None, scale, slices, ranks)
    _assert_close(got, want, y0.dtype)
    return got


@pytest.mark.parametrize("bgmv_max_tokens", [0, 32], ids=["sgmv", "bgmv"])
@pytest.mark.parametrize("num_tokens,popularity", [(1, "identical"), (9, "distinct"), (40, "zipf")])
def test_reads_stop_at_the_rank_rounded_up_to_the_mask_group(num_tokens, popularity, bgmv_max_tokens):
    """The expands mask B by each rank rounded up to triton_kernels.RANK_MASK_GROUP (loads along the rank then
    vectorize; the slots hold zeros there), the shrinks A by the exact rank: garbage (NaN) further on in either
    is never read. Ranks 4, 12 and 1 end inside a group."""
    from lora_core.punica.triton_kernels import RANK_MASK_GROUP

    dtype, group, ranks_by_slot = DTYPES[0], RANK_MASK_GROUP.value, [4, 12, 1, 16, 8, 12]
    g = torch.Generator().manual_seed(num_tokens)
    slices = SLICES[3]
    a, b, ranks = stacked_weights(NUM_SLOTS, 16, HIDDEN, slices, ranks_by_slot, dtype, DEVICE, g)
    slots = token_slots(num_tokens, NUM_SLOTS, popularity, g, none_fraction=0.2 if num_tokens > 1 else 0.0)
    ids = [11, 12, 13, 14, 15, 16]
    ref, tri = _pair(_mapping(slots, ids, False), ids, 1024, bgmv_max_tokens)
    x = torch.randn(num_tokens, HIDDEN, generator=g).to(DEVICE, dtype)
    y0 = torch.randn(num_tokens, sum(slices), generator=g).to(DEVICE, dtype)
    want = y0.float().clone()
    ref.add_lora_linear(want, x.float(), a.float(), b.float(), None, 0.5, slices, ranks)
    a_bad, b_bad = a.clone(), b.clone()
    for slot, r in enumerate(ranks_by_slot):
        a_bad[:, slot, r:] = float("nan")
        b_bad[slot, :, -(-r // group) * group:] = float("nan")
    got = y0.clone()
    tri.add_lora_linear(got, x, a_bad, b_bad, None, 0.5, slices, ranks)
    assert torch.isfinite(got).all()
    _assert_close(got, want, dtype)


@pytest.mark.parametrize("bgmv_max_tokens", [0, 32], ids=["sgmv", "bgmv"])
@pytest.mark.parametrize("rank", [16, 64])
@pytest.mark.parametrize("num_tokens", [1, 5])
def test_decode_paths_split_k(num_tokens, rank, bgmv_max_tokens):
    """Decode shapes with a hidden size large enough that the shrink splits K over programs."""
    dtype = DTYPES[-1]
    hidden = 1024
    g = torch.Generator().manual_seed(rank + num_tokens)
    slices = SLICES[3]
    a, b, ranks = stacked_weights(NUM_SLOTS, rank, hidden, slices, [rank, rank // 4], dtype, DEVICE, g)
    slots = token_slots(num_tokens, NUM_SLOTS, "distinct", g)
    ids = [1, 2, 3, 4, 5, 6]
    ref, tri = _pair(_mapping(slots, ids, False), ids, 64, bgmv_max_tokens)
    x = torch.randn(num_tokens, hidden, generator=g).to(DEVICE, dtype)
    want = torch.zeros(num_tokens, sum(slices), device=DEVICE)
    got = torch.zeros(num_tokens, sum(slices), device=DEVICE, dtype=dtype)
    ref.add_lora_linear(want, x.float(), a.float(), b.float(), None, 1.0, slices, ranks)
    tri.add_lora_linear(got, x, a, b, None, 1.0, slices, ranks)
    _assert_close(got, want, dtype)


@pytest.mark.parametrize("bgmv_max_tokens", [0, 64], ids=["sgmv", "bgmv"])
@pytest.mark.parametrize("num_tokens", [6, 40])
def test_untargeted_slices_leave_y_as_it_was(num_tokens, bgmv_max_tokens):
    """A slot of rank 0 on a slice (its adapter does not target that module: lm_head, or v_proj under a q/k
    adapter) adds nothing: its expand programs leave before reading B or y, and y keeps its bits there."""
    dtype = DTYPES[-1]
    g = torch.Generator().manual_seed(num_tokens + bgmv_max_tokens)
    slices = SLICES[3]
    a, b, ranks = stacked_weights(NUM_SLOTS, 16, HIDDEN, slices, [16, 8], dtype, DEVICE, g)
    untargeted = [(2, 0), (2, 1), (2, 2), (0, 3), (1, 3), (2, 3)]  # (slice, slot): v of slots 0-2, all of 3
    offsets = [0, *torch.tensor(slices).cumsum(0).tolist()]
    for k, slot in untargeted:
        ranks[k, slot] = 0
        a[k, slot] = 0
        b[slot, offsets[k]:offsets[k + 1]] = 0
    slots = token_slots(num_tokens, NUM_SLOTS, "uniform", g, none_fraction=0.2)
    ids = [1, 2, 3, 4, 5, 6]
    ref, tri = _pair(_mapping(slots, ids, False), ids, 64, bgmv_max_tokens)
    y0 = torch.randn(num_tokens, sum(slices), generator=g).to(DEVICE, dtype)
    got = _linear_both(ref, tri, torch.randn(num_tokens, HIDDEN, generator=g).to(DEVICE, dtype), a, b, y0, slices,
                       ranks, 1.0)
    kept = [(t, k) for t, slot in enumerate(slots) for k in range(3) if slot < 0 or (k, slot) in untargeted]
    assert len(kept) > 0 and len(kept) < 3 * num_tokens
    for t, k in kept:
        assert torch.equal(got[t, offsets[k]:offsets[k + 1]], y0[t, offsets[k]:offsets[k + 1]])


@pytest.mark.parametrize("bgmv_max_tokens", [0, 32], ids=["sgmv", "bgmv"])
def test_shrink_reads_at_most_the_rows_it_holds(bgmv_max_tokens):
    """A fully-sharded A holds max_rank / tp rows while ranks keep the full rank: no row past R is read."""
    g = torch.Generator().manual_seed(4)
    full = torch.randn(1, 2, 16, HIDDEN, generator=g)
    half = full[:, :, :8].contiguous()  # what TP rank 0 holds
    ranks = torch.full((1, 2), 16, dtype=torch.int32)
    ids = [1, 2]
    x = torch.randn(4, HIDDEN, generator=g)
    outs = []
    for backend in ("torch", "triton"):
        w = PunicaWrapper(8, 2, "cpu" if not ON_GPU else DEVICE, backend=backend, bgmv_max_tokens=bgmv_max_tokens)
        w.update_metadata(LoRAMapping([1, 2, 2, 1], [1]), ids)
        buf = torch.zeros(1, 4, 8, device=w.device)
        w.add_shrink(buf, x.to(w.device), half.to(w.device), 1.0, ranks.to(w.device))
        outs.append(buf.cpu())
    want = torch.stack([x[i] @ full[0, s, :8].t() for i, s in enumerate([0, 1, 1, 0])])
    _assert_close(outs[0][0], want, torch.float32)
    # On a GPU, Triton's float32 tl.dot runs in TF32.
    _assert_close(outs[1][0], want, torch.float16 if ON_GPU else torch.float32)


@pytest.mark.parametrize("num_tokens,used,popularity",
                         [(48, 3, "uniform"), (256, 16, "uniform"), (300, 1, "identical")])
def test_programs_are_dealt_over_the_real_tiles(num_tokens, used, popularity):
    """Fewer real tiles than the grid's bound (the step's adapters, rounded up to a power of four, plus a
    partial tile each): the device gives the idle programs to the real tiles as extra K splits and
    column chunks. Results must not change."""
    dtype = DTYPES[-1]
    hidden, slots_total = 4096, 32
    g = torch.Generator().manual_seed(num_tokens)
    slices = SLICES[3]
    a, b, ranks = stacked_weights(slots_total, 16, hidden, slices, [16, 8], dtype, DEVICE, g)
    slots = token_slots(num_tokens, used, popularity, g, none_fraction=0.1)
    ids = list(range(1, slots_total + 1))
    mapping = _mapping(slots, ids, num_tokens > 16)
    ref, tri = _pair(mapping, ids, 512, 0, slots_total)
    meta = tri.token_meta
    real = sum(-(-slots.count(s) // meta.block_m) for s in set(slots) - {-1})
    bound = adapter_bound(len(set(slots) - {-1}), slots_total)
    assert int(meta.num_tiles) == real < meta.max_tiles == max_tiles(num_tokens, bound, meta.block_m)
    from lora_core.punica import triton_ops

    _, grid_splits, cap = triton_ops.shrink_config(meta, hidden, len(slices), 16)
    if meta.block_m < 32:  # latency-bound tiles, a grid planned for more of them: the device splits K finer
        assert min(cap, meta.max_tiles * grid_splits // real) > grid_splits
    else:  # tall tiles: K splits stop at the plan's cap, and the device deals the expand's column chunks only
        assert cap == grid_splits == triton_ops.SGMV_TALL_MAX_SPLITS
    x = torch.randn(num_tokens, hidden, generator=g).to(DEVICE, dtype)
    _linear_both(ref, tri, x, a, b, torch.randn(num_tokens, sum(slices), generator=g).to(DEVICE, dtype), slices,
                 ranks, 0.5)


@pytest.mark.parametrize("hidden", [14336, 4096])
@pytest.mark.parametrize("rank", [16, 64])
def test_decode_lora_over_llama_inputs(rank, hidden):
    """One decode row over down_proj's 14,336 inputs (the widest one-step shrink tiles) and the 4,096 of the
    other sites (the partials cap's fewer splits at rank 64) equals the reference."""
    dtype = DTYPES[-1]
    g = torch.Generator().manual_seed(rank)
    slices = (32,)
    a, b, ranks = stacked_weights(4, rank, hidden, slices, [rank], dtype, DEVICE, g)
    ids = [1, 2, 3, 4]
    mapping = _mapping([2], ids, False)
    x = torch.randn(1, hidden, generator=g).to(DEVICE, dtype)
    y0 = torch.randn(1, sum(slices), generator=g).to(DEVICE, dtype)
    want, got, w = lora_linear_both(mapping, ids, x, a, b, y0, slices, ranks)
    assert w.token_meta.use_bgmv
    _assert_close(got, want, dtype)


@pytest.mark.parametrize("bgmv_max_tokens", [0, 32], ids=["sgmv", "bgmv"])
@pytest.mark.parametrize("split_k", [1, 2, 4], ids=["4-steps", "2-steps", "1-step"])
def test_shrink_any_number_of_k_steps(split_k, bgmv_max_tokens):
    """The shrinks load their first A tile ahead of the loop only for one or two K steps per
    program (triton_ops.shrink decides on the host); every split of K must give the same partials."""
    from lora_core.punica import triton_ops

    dtype = DTYPES[-1]
    g = torch.Generator().manual_seed(split_k)
    slices = SLICES[2]
    a, _, ranks = stacked_weights(NUM_SLOTS, 16, HIDDEN, slices, [16, 8], dtype, DEVICE, g)
    slots = [3, -1, 0, 5]
    ids = [1, 2, 3, 4, 5, 6]
    tri = PunicaWrapper(64, NUM_SLOTS, DEVICE, backend="triton", bgmv_max_tokens=bgmv_max_tokens)
    tri.update_metadata(_mapping(slots, ids, False), ids)
    assert tri.token_meta.use_bgmv == (bgmv_max_tokens > 0)
    x = torch.randn(len(slots), HIDDEN, generator=g).to(DEVICE, dtype)
    parts = torch.full((split_k, len(slices), len(slots), 16), float("nan"), device=DEVICE)
    triton_ops.shrink(parts, x, a, ranks, tri.token_meta, 0.5, accumulate=False, split_k=split_k,
                      block_k=HIDDEN // 4)
    got = parts[:, :, [0, 2, 3]].sum(0)
    want = torch.stack([0.5 * x[i].float() @ a[:, s].float().transpose(1, 2) for i, s in [(0, 3), (2, 0), (3, 5)]], 1)
    _assert_close(got, want, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("last", ["y", "x"], ids=["y-written-last", "x-written-last"])
@pytest.mark.parametrize("num_tokens,popularity", [(1, "identical"), (24, "distinct"), (48, "identical")])
def test_lora_waits_for_the_kernels_that_write_x_and_y(num_tokens, popularity, last):
    """Under programmatic dependent launch the shrink starts while the kernel before it still runs
    and the expand while the shrink does. Here a slow GEMM writes y (or x) right before
    add_lora_linear, in a CUDA graph replayed on new inputs: the LoRA must see its result."""
    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(num_tokens)
    slices = SLICES[3]
    a, b, ranks = stacked_weights(NUM_SLOTS, 16, HIDDEN, slices, [16, 8], dtype, DEVICE, g)
    slots = token_slots(num_tokens, NUM_SLOTS, popularity, g)
    ids = [1, 2, 3, 4, 5, 6]
    tri = PunicaWrapper(64, NUM_SLOTS, DEVICE, backend="triton")
    ref = PunicaWrapper(64, NUM_SLOTS, DEVICE, backend="torch")
    for w in (tri, ref):
        w.update_metadata(_mapping(slots, ids, False), ids)
    assert tri.use_pdl == (torch.cuda.get_device_capability()[0] >= 9)
    deep = 1 << 16  # a long reduction: these GEMMs take far longer than a LoRA kernel's start-up
    p = torch.randn(num_tokens, deep, device=DEVICE, dtype=dtype)
    q = torch.randn(deep, HIDDEN, device=DEVICE, dtype=dtype) / deep ** 0.5
    w_base = torch.randn(HIDDEN, deep, device=DEVICE, dtype=dtype) / HIDDEN ** 0.5
    w_out = torch.randn(deep, sum(slices), device=DEVICE, dtype=dtype) / deep ** 0.5
    x = torch.zeros(num_tokens, HIDDEN, device=DEVICE, dtype=dtype)
    x_base = torch.randn(num_tokens, HIDDEN, device=DEVICE, dtype=dtype)  # y's input when x is written last

    def step() -> torch.Tensor:
        if last == "y":
            torch.mm(p, q, out=x)
            y = (x @ w_base) @ w_out
        else:
            y = (x_base @ w_base) @ w_out
            torch.mm(p, q, out=x)
        tri.add_lora_linear(y, x, a, b, None, 1.0, slices, ranks)
        return y

    def expected() -> torch.Tensor:
        xs = p @ q
        want = (((xs if last == "y" else x_base) @ w_base) @ w_out).float()
        ref.add_lora_linear(want, xs.float(), a.float(), b.float(), None, 1.0, slices, ranks)
        return want

    _assert_close(step(), expected(), dtype)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = step()
    for _ in range(3):
        p.copy_(torch.randn(num_tokens, deep, generator=g).to(DEVICE, dtype))
        graph.replay()
        _assert_close(y, expected(), dtype)
