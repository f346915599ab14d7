"""Paged KV cache layout, per-step attention metadata, and the plain-torch reference attention.

Cache layout, per layer (this TP rank's kv heads only):
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
Token p of a sequence lives in slot ``block_table[p // block_size] * block_size
+ p % block_size``; slot s is row s of ``cache.view(-1, num_kv_heads, head_dim)``.

A step's batch mixes prefill chunks and decode tokens: sequence i contributes
query_lens[i] new tokens (1 for a decode) at positions
[seq_lens[i] - query_lens[i], seq_lens[i]), which attend to every cached token
of the sequence before them and causally among themselves.

An attention backend is a callable with the signature of ``reference_attention``;
the CPU path uses it, a GPU backend (Triton) plugs into ``Attention(backend=...)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn


TABLE_WIDTH_ALIGN = 16


@dataclass
class AttentionMetadata:
    """One step's batch layout, shared by every layer.

    query_start_loc: [num_seqs + 1] int32, sequence i's new tokens are rows
        query_start_loc[i]:query_start_loc[i+1] of q / k / v (sequences are contiguous).
    seq_lens: [num_seqs] int32, context length of each sequence INCLUDING its new tokens.
    block_tables: [num_seqs, width] int32, physical block ids of each sequence; width is the most blocks a
        sequence holds rounded up to TABLE_WIDTH_ALIGN (padding arbitrary).
    slot_mapping: [num_tokens] int64, cache slot for each new token's K/V; -1 = do not write (padding).
    max_query_len / max_seq_len: host-side maxima (kernel launch sizes).
    query_lens_host / seq_lens_host: host copies, so the reference path never syncs with the device.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    query_lens_host: tuple[int, ...]
    seq_lens_host: tuple[int, ...]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens_host)

    @classmethod
    def build(cls, query_lens: Sequence[int], seq_lens: Sequence[int], block_tables: Sequence[Sequence[int]],
              block_size: int, device: torch.device | str = "cpu") -> "AttentionMetadata":
        """Metadata for sequences with ``query_lens`` new tokens each, ``seq_lens`` context each (new included)."""
        if not len(query_lens) == len(seq_lens) == len(block_tables):
            raise ValueError("query_lens, seq_lens and block_tables must have one entry per sequence")
        slots, starts = [], [0]
        for q_len, s_len, table in zip(query_lens, seq_lens, block_tables):
            if not 0 <= q_len <= s_len or len(table) * block_size < s_len:
                raise ValueError(f"sequence with {q_len} new of {s_len} tokens does not fit {len(table)} blocks")
            slots += [table[p // block_size] * block_size + p % block_size for p in range(s_len - q_len, s_len)]
            starts.append(starts[-1] + q_len)
        # Width padded to a multiple of TABLE_WIDTH_ALIGN: Triton compiles a kernel variant per class of each
        # integer argument (1, a multiple of 16, other), and the table's row stride is one. Unpadded, a prefill
        # step's width fell in a class the engine's warm-up had not met (0.5-1 s compile stalls mid-serving,
        # bench/engine.py on a fresh Triton cache).
        width = -(-max((len(t) for t in block_tables), default=0) // TABLE_WIDTH_ALIGN) * TABLE_WIDTH_ALIGN
        tables = [list(t) + [0] * (width - len(t)) for t in block_tables]

        def tensor(data, dtype):
            return torch.tensor(data, dtype=dtype).to(device, non_blocking=True)

        return cls(query_start_loc=tensor(starts, torch.int32), seq_lens=tensor(list(seq_lens), torch.int32),
                   block_tables=tensor(tables, torch.int32).reshape(len(tables), width),
                   slot_mapping=tensor(slots, torch.int64), max_query_len=max(query_lens, default=0),
                   max_seq_len=max(seq_lens, default=0), query_lens_host=tuple(query_lens),
                   seq_lens_host=tuple(seq_lens))


# EngineArgs.kv_cache_dtype: "auto" keeps the model's dtype; "fp8" stores K and V in float8 e4m3 with a scale of
# 1 (vLLM's default for an uncalibrated cache): half the bytes of bfloat16, so twice the tokens in the same memory
# and half the cache read per decode step. Values past +-448 saturate.
KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}
FP8_KV_MAX = 448.0


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """EngineArgs.kv_cache_dtype -> the caches' torch dtype (ValueError for another name)."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")
    return KV_CACHE_DTYPES[name] or model_dtype


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as the cache stores it: an FP8 cache saturates at +-448 (a plain cast would make those NaN)."""
    if dtype == torch.float8_e4m3fn:
        x = x.float().clamp(-FP8_KV_MAX, FP8_KV_MAX)
    return x.to(dtype)


def store_in_cache(cache: torch.Tensor, slot_mapping: torch.Tensor, x: torch.Tensor) -> None:
    """cache.view(-1, H_kv, D)[slot_mapping[t]] = x[t] as the cache stores it (index_copy_; an FP8 cache's bytes
    through a uint8 view, as torch has no index_copy_ for float8 on CPU)."""
    x = to_cache_dtype(x, cache.dtype)
    if cache.dtype == torch.float8_e4m3fn:
        cache, x = cache.view(torch.uint8), x.view(torch.uint8)
    cache.view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping, x)


def allocate_kv_caches(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype, device: torch.device | str = "cpu"
                       ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (k_cache, v_cache) pair per layer, each [num_blocks, block_size, num_kv_heads, head_dim], zeroed."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(num_layers)]


def kv_cache_block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                         dtype: torch.dtype) -> int:
    """Bytes one block costs across all layers (K and V): divide a memory budget by this for num_blocks."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k_cache.view(-1, H_kv, D)[slot_mapping[t]] = k[t] (same for v); k, v: [T, H_kv, D]; slot -1 skipped."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    store_in_cache(k_cache, slot_mapping, k)
    store_in_cache(v_cache, slot_mapping, v)


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                        scale: float, sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Causal attention of q [T, H, D] over the paged cache (already holding this step's K/V) -> [T, H, D].

    Query j of sequence i sits at position p = seq_lens[i] - query_lens[i] + j
    and attends to keys at positions k <= p (and k > p - sliding_window when
    set). GQA: query head h reads kv head h // (H / H_kv). softcap: scores
    become softcap * tanh(score / softcap) before the mask (Gemma 2). Scores and
    softmax in float32; one loop iteration per sequence (a reference, not a kernel).
    """
    out = torch.empty_like(q)
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    start = 0
    for i, (q_len, s_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
        if q_len == 0:
            continue
        blocks = meta.block_tables[i, : -(-s_len // block_size)].long()
        k = k_cache[blocks].flatten(0, 1)[:s_len].float().repeat_interleave(group, dim=1)  # [L, H, D]
        v = v_cache[blocks].flatten(0, 1)[:s_len].float().repeat_interleave(group, dim=1)
        qi = q[start : start + q_len].float()
        scores = torch.einsum("qhd,khd->hqk", qi, k) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(s_len - q_len, s_len, device=q.device).unsqueeze(1)
        k_pos = torch.arange(s_len, device=q.device).unsqueeze(0)
        allowed = k_pos <= q_pos
        if sliding_window is not None:
            allowed &= k_pos > q_pos - sliding_window
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
        out[start : start + q_len] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
        start += q_len
    return out


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                        sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """The CPU backend: write this step's k, v [T, H_kv, D] into the cache, then attend; q [T, H, D] -> [T, H, D]."""
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    return paged_attention_ref(q, k_cache, v_cache, meta, scale, sliding_window, softcap)


AttentionBackend = Callable[..., torch.Tensor]  # signature of reference_attention


class Attention(nn.Module):
    """Paged multi-head attention for one layer's local heads (no parameters).

    forward(q [T, H*D], k [T, H_kv*D], v [T, H_kv*D], kv_cache=(k_cache, v_cache), meta) -> [T, H*D]
    """

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float,
                 sliding_window: int | None = None, backend: AttentionBackend | None = None,
                 softcap: float | None = None) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} kv heads")
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale, self.sliding_window = scale, sliding_window
        # passed only where set: a backend that takes no soft cap serves every model without one
        self.extra = {"softcap": softcap} if softcap is not None else {}
        self.backend = backend or reference_attention
        # An FP8 checkpoint's calibrated cache scales (its kv_cache_scheme): an FP8 cache stores k / k_scale and
        # v / v_scale. Host floats, read once at load.
        self.k_scale = self.v_scale = 1.0

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        t = q.shape[0]
        scale, v_scale = self.scale, 1.0
        if kv_cache[0].dtype == torch.float8_e4m3fn and (self.k_scale != 1.0 or self.v_scale != 1.0):
            # q . (k_q k_scale) = (q . k_q) k_scale: the softmax scale takes k's; the output, a mix of v_q, v's
            k, v, scale, v_scale = k / self.k_scale, v / self.v_scale, scale * self.k_scale, self.v_scale
        out = self.backend(q.reshape(t, self.num_heads, self.head_dim),
                           k.reshape(t, self.num_kv_heads, self.head_dim),
                           v.reshape(t, self.num_kv_heads, self.head_dim),
                           kv_cache[0], kv_cache[1], meta, scale, self.sliding_window, **self.extra)
        if v_scale != 1.0:
            out = out * v_scale
        return out.reshape(t, self.num_heads * self.head_dim)
