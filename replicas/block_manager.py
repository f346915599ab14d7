"""BlockManager: the paged KV cache's bookkeeping (pure Python, no torch).

The cache is num_blocks fixed-size blocks of block_size token slots. Each
sequence owns a block table (its blocks, in token order). With prefix
caching, every full block whose KV has been computed is registered under a
chain hash of (adapter id, the tokens of this block and of every block before
it); a later sequence with the same adapter and prefix shares those blocks
(ref counted). The adapter is part of the key because the same tokens under a
different adapter have different keys and values; so is, for a longrope model,
whether the prompt is longer than the original context (long_rope_from): such
a prompt's positions turn with other frequencies (replicas/layers/rotary.py).
A block whose last user left stays cached until its slot is needed: such
blocks are evicted LRU.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from replicas.sequence import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "block_hash", "namespace", "prev_hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.reset()

    def reset(self) -> None:
        self.block_hash: int | None = None
        self.namespace: int | tuple[int, str] = 0
        self.prev_hash: int | None = None
        self.token_ids: tuple[int, ...] = ()


def block_key_hash(prev_hash: int | None, namespace: int | tuple[int, str], token_ids: tuple[int, ...]) -> int:
    return hash((prev_hash, namespace, token_ids))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 long_rope_from: int | None = None) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"BlockManager needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.long_rope_from = long_rope_from
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._empty: deque[int] = deque(range(num_blocks))
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # ref 0 but reusable; oldest first
        self._hash_to_block: dict[int, int] = {}
        self._num_hashed: dict[str, int] = {}  # request id -> leading blocks already registered
        self.num_cache_hit_tokens = 0
        self.num_cache_queried_tokens = 0

    # -- capacity -------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._empty) + len(self._cached_free)

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self._cached_free)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix lookup --------------------------------------------------
    def _lookup(self, prev_hash: int | None, namespace: int | tuple[int, str], tokens: tuple[int, ...]) -> int | None:
        h = block_key_hash(prev_hash, namespace, tokens)
        block_id = self._hash_to_block.get(h)
        if block_id is None:
            return None
        b = self.blocks[block_id]
        # Python's hash can collide; a hit must match the whole key.
        if b.block_hash != h or b.prev_hash != prev_hash or b.namespace != namespace or b.token_ids != tokens:
            return None
        return block_id

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Blocks already holding a prefix of seq, for its adapter.

        The last token is never taken from the cache: the model must run on at
        least one token to produce the next token's logits. A sequence asking
        for prompt logprobs takes nothing: cached positions would have none.
        """
        if not self.enable_prefix_caching or seq.sampling_params.prompt_logprobs is not None:
            return []
        tokens = seq.all_token_ids
        bs, namespace = self.block_size, self._namespace(seq)
        hits: list[int] = []
        prev: int | None = None
        for i in range((len(tokens) - 1) // bs):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            block_id = self._lookup(prev, namespace, chunk)
            if block_id is None:
                break
            hits.append(block_id)
            prev = self.blocks[block_id].block_hash
        return hits

    # -- allocation -----------------------------------------------------
    def _namespace(self, seq: Sequence) -> int | tuple[int, str]:
        """What a block's key holds besides tokens: the adapter id, and a mark for a longrope prompt past the
        original context."""
        if self.long_rope_from is not None and seq.num_prompt_tokens > self.long_rope_from:
            return (seq.lora_int_id, "long rope")
        return seq.lora_int_id

    def can_allocate(self, seq: Sequence) -> bool:
        hits = self._cached_prefix(seq)
        reused_free = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        need_new = self.blocks_needed(seq.num_tokens) - len(hits)
        return need_new <= self.num_free_blocks - reused_free

    def allocate(self, seq: Sequence) -> None:
        """Give seq blocks for all its tokens, reusing cached prefix blocks.

        Sets seq.num_computed_tokens (and num_cached_tokens) to the tokens
        found in the cache. Call can_allocate first.
        """
        if seq.block_table:
            raise RuntimeError(f"{seq.request_id}: already holds blocks")
        if not self.can_allocate(seq):
            raise RuntimeError(f"{seq.request_id}: not enough free KV-cache blocks")
        hits = self._cached_prefix(seq)
        for block_id in hits:
            self._take(block_id)
        seq.block_table = list(hits)
        for _ in range(self.blocks_needed(seq.num_tokens) - len(hits)):
            seq.block_table.append(self._new_block())
        seq.num_computed_tokens = seq.num_cached_tokens = len(hits) * self.block_size
        self._num_hashed[seq.request_id] = len(hits)
        self.num_cache_queried_tokens += seq.num_tokens
        self.num_cache_hit_tokens += seq.num_cached_tokens

    def can_append_slot(self, seq: Sequence) -> bool:
        """Whether seq's next step has a slot for every token it holds."""
        return self.blocks_needed(seq.num_tokens) - len(seq.block_table) <= self.num_free_blocks

    def append_slot(self, seq: Sequence) -> None:
        """Grow seq's block table to cover all its tokens (after tokens were appended)."""
        while len(seq.block_table) < self.blocks_needed(seq.num_tokens):
            seq.block_table.append(self._new_block())

    def free(self, seq: Sequence) -> None:
        """Release seq's blocks; registered ones stay cached until evicted.

        Tail blocks are released first so they are evicted before the shared
        prefix blocks in front of them.
        """
        for block_id in reversed(seq.block_table):
            b = self.blocks[block_id]
            b.ref_count -= 1
            if b.ref_count == 0:
                if b.block_hash is not None and self._hash_to_block.get(b.block_hash) == block_id:
                    self._cached_free[block_id] = None
                else:
                    b.reset()
                    self._empty.append(block_id)
        seq.block_table = []
        self._num_hashed.pop(seq.request_id, None)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register seq's full blocks whose KV is now computed, so others can share them.

        Called after each model step; a block is never offered before its
        KV has been written.
        """
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        start = self._num_hashed.get(seq.request_id, 0)
        if start >= num_full:
            return
        prev = self.blocks[seq.block_table[start - 1]].block_hash if start else None
        tokens = _token_slice(seq, start * bs, num_full * bs)
        namespace = self._namespace(seq)
        for i in range(start, num_full):
            b = self.blocks[seq.block_table[i]]
            if b.block_hash is None:
                b.token_ids = tuple(tokens[(i - start) * bs : (i - start + 1) * bs])
                b.namespace, b.prev_hash = namespace, prev
                b.block_hash = block_key_hash(prev, b.namespace, b.token_ids)
                # A duplicate of a block someone else registered stays private.
                self._hash_to_block.setdefault(b.block_hash, b.block_id)
            prev = b.block_hash
        self._num_hashed[seq.request_id] = num_full

    def reset_prefix_cache(self) -> None:
        """Drop every cached-but-unused block (e.g. after an adapter was replaced)."""
        while self._cached_free:
            self._empty.append(self._evict_oldest())
        self._hash_to_block.clear()
        self._num_hashed.clear()
        for b in self.blocks:
            b.reset()

    # -- internals --------------------------------------------------------
    def _take(self, block_id: int) -> None:
        b = self.blocks[block_id]
        if b.ref_count == 0:
            del self._cached_free[block_id]
        b.ref_count += 1

    def _evict_oldest(self) -> int:
        block_id, _ = self._cached_free.popitem(last=False)
        b = self.blocks[block_id]
        self._hash_to_block.pop(b.block_hash, None)
        b.reset()
        return block_id

    def _new_block(self) -> int:
        if self._empty:
            block_id = self._empty.popleft()
        elif self._cached_free:
            block_id = self._evict_oldest()
        else:
            raise RuntimeError("out of KV-cache blocks")
        self.blocks[block_id].ref_count = 1
        return block_id


def _token_slice(seq: Sequence, start: int, end: int) -> list[int]:
    """seq.all_token_ids[start:end] without copying the whole sequence."""
    n = seq.num_prompt_tokens
    if end <= n:
        return seq.prompt_token_ids[start:end]
    if start >= n:
        return seq.output_token_ids[start - n : end - n]
    return seq.prompt_token_ids[start:] + seq.output_token_ids[: end - n]


def num_blocks_for_budget(
    memory_bytes: int,
    block_size: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype_bytes: int,
    tp_size: int = 1,
) -> int:
    """How many KV-cache blocks fit in memory_bytes on one TP rank.

    A block holds K and V for block_size tokens in every layer, for this
    rank's KV heads (num_kv_heads / tp_size; when there are fewer KV heads
    than ranks each rank keeps one replicated head).
    """
    if num_kv_heads >= tp_size and num_kv_heads % tp_size:
        raise ValueError(f"num_kv_heads={num_kv_heads} is not divisible by tensor_parallel_size={tp_size}")
    heads_per_rank = max(1, num_kv_heads // tp_size)
    bytes_per_block = 2 * num_layers * block_size * heads_per_rank * head_dim * dtype_bytes
    return max(0, int(memory_bytes) // bytes_per_block)
