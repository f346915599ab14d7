"""Paged attention for a mixed batch (prefill chunks and decode tokens) in one Triton launch.

Semantics, per sequence s with q_len new tokens and seq_len tokens in all
(context_len = seq_len - q_len already cached, the new tokens' K/V already
written to the cache):

    out[t, h] = softmax(q[t, h] . K[s, :p_t + 1, kvh]^T * scale) @ V[s, :p_t + 1, kvh]

(scores soft-capped first where softcap is set: softcap * tanh(score / softcap), as Gemma 2 does).

where p_t = context_len + (t - query_start_loc[s]) is the token's position and
kvh = h // (num_heads / num_kv_heads) (GQA). K/V of sequence s live in the
blocks block_tables[s, :]; k_cache / v_cache are [num_blocks, block_size,
num_kv_heads, head_dim].

One program handles BLOCK_Q query tokens of one sequence for one query head
and streams the sequence's cache blocks with an online softmax (flash
attention), so a decode token and a 500-token prefill chunk share a launch.
The grid depends only on host-known sizes (number of sequences, the step's
longest query), so a decode step can be captured in a CUDA graph. A pure
decode step (one token per sequence) takes a second kernel that reads each
K/V block once per GQA group instead of once per query head.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from replicas.attention import store_in_cache
from replicas.kernels import fused


@triton.jit
def _attend(q, k, v, allowed, m_i, l_i, acc, scale, softcap, IEEE: tl.constexpr, SOFTCAP: tl.constexpr,
            PRECISE: tl.constexpr):
    """One online-softmax step of flash attention over a tile of keys: the new (max, sum, accumulator).
    SOFTCAP: scores become softcap * tanh(score / softcap) first (Gemma 2)."""
    if IEEE:  # float32 caches get float32 products (Triton's default for them is TF32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
    else:
        s = tl.dot(q, tl.trans(k)).to(tl.float32) * scale
    if SOFTCAP:
        s = softcap * fused.tanh(s / softcap, PRECISE)
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # A row may see only masked keys so far (sliding window): keep its sums at 0, not NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
    return m_new, l_i, acc


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    query_start_ptr, seq_lens_ptr, block_tables_ptr,
    scale, softcap,
    sq_t, sq_h,
    sk_b, sk_s, sk_h,
    so_t, so_h,
    sbt_s,
    QUERIES_PER_KV: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr, WINDOW: tl.constexpr, IEEE: tl.constexpr,
    SOFTCAP: tl.constexpr, PRECISE: tl.constexpr,
):
    seq = tl.program_id(0)
    q_block = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    if q_block * BLOCK_Q >= q_len:
        return
    kv_head = head // QUERIES_PER_KV
    context_len = seq_len - q_len
    offs_q = q_block * BLOCK_Q + tl.arange(0, BLOCK_Q)
    q_mask = offs_q < q_len
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q = tl.load(q_ptr + (q_start + offs_q)[:, None].to(tl.int64) * sq_t + head * sq_h + offs_d[None, :],
                mask=q_mask[:, None] & d_mask[None, :], other=0.0)
    pos_q = context_len + offs_q
    m_i = tl.full((BLOCK_Q,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_Q,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_Q, BLOCK_D), dtype=tl.float32)
    # Keys past the last query's position are never needed (causal).
    kv_end = tl.minimum(seq_len, context_len + (q_block + 1) * BLOCK_Q)
    kv_begin = 0
    if WINDOW > 0:  # keys older than the first query's window are never needed either
        kv_begin = tl.maximum(context_len + q_block * BLOCK_Q - WINDOW + 1, 0) // BLOCK_SIZE * BLOCK_SIZE
    offs_n = tl.arange(0, BLOCK_SIZE)
    for start in range(kv_begin, kv_end, BLOCK_SIZE):
        block = tl.load(block_tables_ptr + seq * sbt_s + start // BLOCK_SIZE).to(tl.int64)
        pos_k = start + offs_n
        k_mask = pos_k < seq_len
        kv_off = block * sk_b + offs_n[:, None] * sk_s + kv_head * sk_h + offs_d[None, :]
        # an FP8 cache's K and V in q's dtype (a no-op for a cache in it)
        k = tl.load(k_cache_ptr + kv_off, mask=k_mask[:, None] & d_mask[None, :], other=0.0).to(q.dtype)
        v = tl.load(v_cache_ptr + kv_off, mask=k_mask[:, None] & d_mask[None, :], other=0.0).to(q.dtype)
        allowed = (pos_k[None, :] <= pos_q[:, None]) & k_mask[None, :]
        if WINDOW > 0:
            allowed = allowed & (pos_k[None, :] > pos_q[:, None] - WINDOW)
        m_i, l_i, acc = _attend(q, k, v, allowed, m_i, l_i, acc, scale, softcap, IEEE, SOFTCAP, PRECISE)
    acc = acc / l_i[:, None]
    tl.store(out_ptr + (q_start + offs_q)[:, None].to(tl.int64) * so_t + head * so_h + offs_d[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=q_mask[:, None] & d_mask[None, :])


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    seq_lens_ptr, block_tables_ptr,
    scale, softcap,
    sq_t, sq_h,
    sk_b, sk_s, sk_h,
    so_t, so_h,
    sbt_s,
    QUERIES_PER_KV: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, WINDOW: tl.constexpr, IEEE: tl.constexpr,
    SOFTCAP: tl.constexpr, PRECISE: tl.constexpr,
):
    """A pure decode step (token i = sequence i): one program per (sequence, kv head).

    The program holds every query head of its GQA group as the rows of one
    tile, so each K/V block is read once for the group (not once per query
    head), and it streams BLOCK_N keys (several cache blocks) per iteration.
    """
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    offs_g = tl.arange(0, BLOCK_G)
    g_mask = offs_g < QUERIES_PER_KV
    heads = kv_head * QUERIES_PER_KV + offs_g
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q = tl.load(q_ptr + seq.to(tl.int64) * sq_t + heads[:, None] * sq_h + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    pos_q = seq_len - 1
    kv_begin = 0
    if WINDOW > 0:
        kv_begin = tl.maximum(pos_q - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
    m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(kv_begin, seq_len, BLOCK_N):
        pos_k = start + offs_n
        k_mask = pos_k < seq_len
        block = tl.load(block_tables_ptr + seq * sbt_s + pos_k // BLOCK_SIZE, mask=k_mask, other=0).to(tl.int64)
        kv_off = block[:, None] * sk_b + (pos_k % BLOCK_SIZE)[:, None] * sk_s + kv_head * sk_h + offs_d[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=k_mask[:, None] & d_mask[None, :], other=0.0).to(q.dtype)
        v = tl.load(v_cache_ptr + kv_off, mask=k_mask[:, None] & d_mask[None, :], other=0.0).to(q.dtype)
        allowed = k_mask[None, :]
        if WINDOW > 0:
            allowed = allowed & (pos_k[None, :] > pos_q - WINDOW)
        m_i, l_i, acc = _attend(q, k, v, allowed, m_i, l_i, acc, scale, softcap, IEEE, SOFTCAP, PRECISE)
    acc = acc / l_i[:, None]
    tl.store(out_ptr + seq.to(tl.int64) * so_t + heads[:, None] * so_h + offs_d[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float, max_query_len: int,
                    out: torch.Tensor | None = None, sliding_window: int | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    """q [T, num_heads, head_dim] -> out [T, num_heads, head_dim]; see the module docstring.

    query_start_loc [S + 1] and seq_lens [S] are int32 on the device;
    max_query_len (host int) sizes the grid: 1 for a pure decode step.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} kv heads")
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 16 for the Triton path, got {block_size}")
    out = torch.empty_like(q) if out is None else out
    num_seqs = seq_lens.shape[0]
    block_d = max(16, triton.next_power_of_2(head_dim))
    if max_query_len == 1 and num_tokens == num_seqs:  # pure decode: the GQA-grouped kernel
        group = num_heads // num_kv_heads
        _paged_decode_kernel[(num_seqs, num_kv_heads)](
            q, k_cache, v_cache, out, seq_lens, block_tables, float(scale), float(softcap or 1.0),
            q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            out.stride(0), out.stride(1),
            block_tables.stride(0),
            QUERIES_PER_KV=group, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_SIZE=block_size,
            BLOCK_N=max(64, block_size), HEAD_DIM=head_dim, BLOCK_D=block_d, WINDOW=sliding_window or 0,
            IEEE=q.dtype == torch.float32, SOFTCAP=softcap is not None, PRECISE=q.is_cuda,
            num_warps=4, num_stages=2,
        )
        return out
    block_q = 16 if max_query_len <= 16 else 32 if max_query_len <= 64 else 64
    grid = (num_seqs, triton.cdiv(max(max_query_len, 1), block_q), num_heads)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out,
        query_start_loc, seq_lens, block_tables,
        float(scale), float(softcap or 1.0),
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1),
        block_tables.stride(0),
        QUERIES_PER_KV=num_heads // num_kv_heads, BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
        BLOCK_D=block_d, BLOCK_Q=block_q, WINDOW=sliding_window or 0,
        IEEE=q.dtype == torch.float32, SOFTCAP=softcap is not None, PRECISE=q.is_cuda,
        num_warps=4, num_stages=2,
    )
    return out


def triton_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, meta, scale: float, sliding_window: int | None = None,
                     softcap: float | None = None) -> torch.Tensor:
    """The GPU attention backend (same signature as replicas.attention.reference_attention).

    Writes this step's k, v [T, H_kv, D] into the cache (one fused launch when
    replicas.kernels.fused is on, else two index_copy_; no padding slots, so
    no host check), then runs the paged kernel.
    """
    if fused.enabled():
        fused.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
    else:
        store_in_cache(k_cache, meta.slot_mapping, k)
        store_in_cache(v_cache, meta.slot_mapping, v)
    return paged_attention(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale,
                           meta.max_query_len, sliding_window=sliding_window, softcap=softcap)
