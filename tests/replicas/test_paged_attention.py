"""Triton paged attention (interpreter on CPU, real kernel on GPU) against dense attention per sequence."""

from __future__ import annotations

import math

import pytest
import torch

from replicas.kernels.paged_attention import paged_attention

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"


def _dense(q, k, v, context_len, scale, window=None, softcap=None):
    """q [n, H, D] at positions context_len.., k/v [L, KVH, D] for positions 0..L-1."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1).float()
    v = v.repeat_interleave(group, dim=1).float()
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    pos_q = context_len + torch.arange(q.shape[0])
    pos_k = torch.arange(k.shape[0])[None, :]
    mask = pos_k <= pos_q[:, None]
    if window:
        mask &= pos_k > pos_q[:, None] - window
    scores = scores.masked_fill(~mask.to(scores.device), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32] if ON_GPU else [torch.float32])
# softcap 0.5 caps the scores hard (they spread over about +-1 here): Gemma 2's attention soft cap
@pytest.mark.parametrize("window,softcap", [(None, None), (20, None), (20, 0.5)])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 32), (4, 4, 64), (8, 1, 48)])
@pytest.mark.parametrize("fp8_cache", [False, True], ids=["cache-in-dtype", "fp8-cache"])
def test_mixed_batch_matches_dense(heads, kv_heads, head_dim, dtype, window, softcap, fp8_cache):
    g = torch.Generator().manual_seed(heads * 7 + head_dim)
    block_size, num_blocks = 16, 64
    # (context already cached, new tokens): decode, prefill with and without context, long decode
    seqs = [(0, 1), (37, 1), (0, 23), (20, 40), (70, 1), (5, 3)]
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    free = torch.randperm(num_blocks, generator=g).tolist()
    max_blocks = max(math.ceil((c + n) / block_size) for c, n in seqs)
    tables = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
    for i, (c, n) in enumerate(seqs):
        for j in range(math.ceil((c + n) / block_size)):
            tables[i, j] = free.pop()
    starts = [0]
    for _, n in seqs:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], heads, head_dim, generator=g)
    scale = head_dim ** -0.5
    cache = torch.float8_e4m3fn if fp8_cache else dtype  # an FP8 cache is read in q's dtype
    out = paged_attention(
        q.to(DEVICE, dtype), k_cache.to(DEVICE, cache), v_cache.to(DEVICE, cache),
        torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        torch.tensor([c + n for c, n in seqs], dtype=torch.int32, device=DEVICE),
        tables.to(DEVICE), scale, max(n for _, n in seqs), sliding_window=window, softcap=softcap).float().cpu()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for i, (c, n) in enumerate(seqs):
        blocks = tables[i, : math.ceil((c + n) / block_size)].long()
        k = k_cache[blocks].reshape(-1, kv_heads, head_dim)[: c + n].to(cache).float()
        v = v_cache[blocks].reshape(-1, kv_heads, head_dim)[: c + n].to(cache).float()
        want = _dense(q[starts[i]: starts[i + 1]].to(dtype).float(), k, v, c, scale, window, softcap)
        got = out[starts[i]: starts[i + 1]]
        assert (got - want).abs().max().item() < tol * max(1.0, want.abs().max().item()), f"sequence {i}"


def test_bad_shapes_are_refused():
    q = torch.zeros(1, 3, 16)
    cache = torch.zeros(2, 16, 2, 16)
    one = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="kv heads"):
        paged_attention(q, cache, cache, torch.tensor([0, 1], dtype=torch.int32), one + 1,
                        torch.zeros(1, 1, dtype=torch.int32), 1.0, 1)
    with pytest.raises(ValueError, match="block_size"):
        paged_attention(torch.zeros(1, 2, 16), torch.zeros(2, 12, 2, 16), torch.zeros(2, 12, 2, 16),
                        torch.tensor([0, 1], dtype=torch.int32), one + 1, torch.zeros(1, 1, dtype=torch.int32), 1.0, 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32] if ON_GPU else [torch.float32])
@pytest.mark.parametrize("window,softcap", [(None, None), (20, None), (None, 0.5)])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 32), (8, 1, 48), (32, 8, 128)])
@pytest.mark.parametrize("fp8_cache", [False, True], ids=["cache-in-dtype", "fp8-cache"])
def test_pure_decode_step_matches_dense(heads, kv_heads, head_dim, dtype, window, softcap, fp8_cache):
    """One token per sequence takes the GQA-grouped decode kernel: contexts of 1 to 150 tokens."""
    g = torch.Generator().manual_seed(heads + head_dim)
    block_size, num_blocks = 16, 64
    lens = [1, 16, 17, 64, 65, 150]
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    free = torch.randperm(num_blocks, generator=g).tolist()
    max_blocks = max(math.ceil(n / block_size) for n in lens)
    tables = torch.zeros(len(lens), max_blocks, dtype=torch.int32)
    for i, n in enumerate(lens):
        for j in range(math.ceil(n / block_size)):
            tables[i, j] = free.pop()
    q = torch.randn(len(lens), heads, head_dim, generator=g)
    scale = head_dim ** -0.5
    cache = torch.float8_e4m3fn if fp8_cache else dtype  # an FP8 cache is read in q's dtype
    out = paged_attention(
        q.to(DEVICE, dtype), k_cache.to(DEVICE, cache), v_cache.to(DEVICE, cache),
        torch.arange(len(lens) + 1, dtype=torch.int32, device=DEVICE),
        torch.tensor(lens, dtype=torch.int32, device=DEVICE), tables.to(DEVICE), scale, 1,
        sliding_window=window, softcap=softcap).float().cpu()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for i, n in enumerate(lens):
        blocks = tables[i, : math.ceil(n / block_size)].long()
        k = k_cache[blocks].reshape(-1, kv_heads, head_dim)[:n].to(cache).float()
        v = v_cache[blocks].reshape(-1, kv_heads, head_dim)[:n].to(cache).float()
        want = _dense(q[i : i + 1].to(dtype).float(), k, v, n - 1, scale, window, softcap)
        torch.testing.assert_close(out[i : i + 1], want, atol=tol, rtol=tol)


@pytest.mark.parametrize("fused_write", ["1", "0"])
def test_backend_writes_the_cache_and_attends_like_the_reference(monkeypatch, fused_write):
    """triton_attention (KV write, fused or index_copy_, then the kernel) against reference_attention."""
    from replicas.attention import AttentionMetadata, reference_attention
    from replicas.kernels.paged_attention import triton_attention

    monkeypatch.setenv("LORAFLEET_FUSED_OPS", fused_write)
    g = torch.Generator().manual_seed(11)
    heads, kv_heads, head_dim, block_size, num_blocks = 4, 2, 32, 16, 12
    query_lens, seq_lens = [1, 5, 1], [9, 5, 33]
    tables = [[3], [7], [0, 5, 10]]
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, device=DEVICE)
    q = torch.randn(sum(query_lens), heads, head_dim, generator=g).to(DEVICE)
    k = torch.randn(sum(query_lens), kv_heads, head_dim, generator=g).to(DEVICE)
    v = torch.randn(sum(query_lens), kv_heads, head_dim, generator=g).to(DEVICE)
    caches = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g).to(DEVICE)
    ref_k, ref_v = caches[0].clone(), caches[1].clone()
    got_k, got_v = caches[0].clone(), caches[1].clone()
    want = reference_attention(q, k, v, ref_k, ref_v, meta, head_dim ** -0.5)
    got = triton_attention(q, k, v, got_k, got_v, meta, head_dim ** -0.5)
    assert torch.equal(got_k, ref_k) and torch.equal(got_v, ref_v)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("blocks", [[1], [1, 3], [16], [17, 2], [5, 32]])
def test_block_table_width_is_aligned_so_one_kernel_variant_serves_every_step(blocks):
    """The table's row stride is a kernel argument that Triton specializes (1, multiple of 16, other): a width
    rounded up to TABLE_WIDTH_ALIGN keeps every step in the class that warm-up compiled."""
    from replicas.attention import TABLE_WIDTH_ALIGN, AttentionMetadata

    block_size = 16
    tables = [list(range(100 * i, 100 * i + n)) for i, n in enumerate(blocks)]
    lens = [n * block_size for n in blocks]
    meta = AttentionMetadata.build(lens, lens, tables, block_size)
    width = meta.block_tables.shape[1]
    assert TABLE_WIDTH_ALIGN == 16 and width % 16 == 0 and max(blocks) <= width < max(blocks) + 16
    assert meta.block_tables.stride(0) == width
    for row, table in zip(meta.block_tables.tolist(), tables):
        assert row[: len(table)] == table
