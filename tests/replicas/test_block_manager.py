"""BlockManager: allocation, ref counts, prefix reuse keyed by adapter, LRU eviction."""

from __future__ import annotations

import pytest

from lora_core.request import LoRARequest
from replicas.block_manager import BlockManager, num_blocks_for_budget
from replicas.sequence import Sequence

BS = 4


def seq(rid, tokens, lora_id=0):
    lora = LoRARequest(f"a{lora_id}", lora_id, "/x") if lora_id else None
    return Sequence(rid, list(tokens), lora_request=lora)


def computed(bm, s):
    """Pretend the model ran over every token of s."""
    s.num_computed_tokens = s.num_tokens
    bm.cache_full_blocks(s)


def test_allocate_and_free():
    bm = BlockManager(8, BS)
    a = seq("a", range(10))
    assert bm.can_allocate(a)
    bm.allocate(a)
    assert len(a.block_table) == 3 and bm.num_free_blocks == 5 and a.num_computed_tokens == 0
    assert all(bm.blocks[b].ref_count == 1 for b in a.block_table)
    bm.free(a)
    assert a.block_table == [] and bm.num_free_blocks == 8


def test_can_allocate_refuses_when_full():
    bm = BlockManager(3, BS)
    bm.allocate(seq("a", range(8)))
    assert not bm.can_allocate(seq("b", range(100, 109)))
    assert bm.can_allocate(seq("c", range(100, 104)))


def test_append_slot_grows_on_block_boundary():
    bm = BlockManager(4, BS)
    a = seq("a", range(4))
    bm.allocate(a)
    assert len(a.block_table) == 1
    a.append_token(99)
    assert bm.can_append_slot(a)
    bm.append_slot(a)
    assert len(a.block_table) == 2
    for t in range(3):
        a.append_token(t)
        bm.append_slot(a)
    assert len(a.block_table) == 2  # 8 tokens fit in 2 blocks


def test_prefix_shared_with_same_adapter_and_ref_counted():
    bm = BlockManager(16, BS)
    a = seq("a", range(10), lora_id=1)
    bm.allocate(a)
    computed(bm, a)
    b = seq("b", list(range(8)) + [50, 51, 52], lora_id=1)
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert b.num_computed_tokens == b.num_cached_tokens == 8
    assert [bm.blocks[i].ref_count for i in b.block_table[:2]] == [2, 2]
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in b.block_table[:2]] == [1, 1]
    bm.free(b)
    assert bm.num_free_blocks == 16


def test_same_tokens_under_other_adapter_never_share():
    bm = BlockManager(16, BS)
    a = seq("a", range(10), lora_id=1)
    bm.allocate(a)
    computed(bm, a)
    for rid, lid in (("base", 0), ("other", 2)):
        s = seq(rid, range(10), lora_id=lid)
        bm.allocate(s)
        assert s.num_computed_tokens == 0 and not set(s.block_table) & set(a.block_table)


def test_a_longrope_prompt_past_the_original_context_shares_only_with_its_kind():
    """long_rope_from 10: a prompt of more than 10 tokens is turned with longrope's long factors at every
    position, so its first blocks' KV differ from a shorter prompt's with the same tokens."""
    bm = BlockManager(32, BS, long_rope_from=10)
    short = seq("short", range(10))
    bm.allocate(short)
    computed(bm, short)
    first = seq("long", range(14))
    bm.allocate(first)
    assert first.num_computed_tokens == 0 and not set(first.block_table) & set(short.block_table)
    computed(bm, first)
    second = seq("long-2", list(range(12)) + [90, 91])
    bm.allocate(second)
    assert second.num_computed_tokens == 12 and second.block_table[:3] == first.block_table[:3]
    again = seq("short-2", list(range(8)) + [70])
    bm.allocate(again)
    assert again.num_computed_tokens == 8 and again.block_table[:2] == short.block_table[:2]


def test_prefix_not_shared_before_it_is_computed():
    bm = BlockManager(16, BS)
    a = seq("a", range(12))
    bm.allocate(a)
    b = seq("b", range(12))
    bm.allocate(b)
    assert b.num_computed_tokens == 0
    a.num_computed_tokens = 4  # first chunk done
    bm.cache_full_blocks(a)
    c = seq("c", range(12))
    bm.allocate(c)
    assert c.num_computed_tokens == 4 and c.block_table[0] == a.block_table[0]


def test_full_hit_still_computes_last_token():
    bm = BlockManager(16, BS)
    a = seq("a", range(8))
    bm.allocate(a)
    computed(bm, a)
    b = seq("b", range(8))
    bm.allocate(b)
    assert b.num_computed_tokens == 4 and b.num_uncomputed_tokens == 4


def test_freed_prefix_stays_cached_then_reused():
    bm = BlockManager(8, BS)
    a = seq("a", range(9))
    bm.allocate(a)
    computed(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 8 and bm.num_cached_free_blocks == 2
    b = seq("b", range(9))
    assert bm.can_allocate(b)
    bm.allocate(b)
    assert b.num_computed_tokens == 8 and bm.num_cached_free_blocks == 0


def test_lru_eviction_of_cached_free_blocks():
    bm = BlockManager(4, BS)
    old, new = seq("old", range(5)), seq("new", range(100, 105))
    for s in (old, new):  # each leaves one cached full block and one empty block behind
        bm.allocate(s)
        computed(bm, s)
        bm.free(s)
    assert bm.num_cached_free_blocks == 2
    filler = seq("filler", range(200, 209))  # needs 3 blocks: 2 empty + evict the oldest cached
    bm.allocate(filler)
    assert bm.num_cached_free_blocks == 1
    again_old, again_new = seq("o2", range(5)), seq("n2", range(100, 105))
    bm.free(filler)
    bm.allocate(again_new)
    assert again_new.num_computed_tokens == 4  # the most recently used survived
    bm.allocate(again_old)
    assert again_old.num_computed_tokens == 0  # the least recently used was evicted


def test_reusing_a_cached_free_block_counts_against_capacity():
    bm = BlockManager(3, BS)
    a = seq("a", range(9))
    bm.allocate(a)
    computed(bm, a)
    bm.free(a)  # 2 cached blocks + 1 empty block
    assert bm.can_allocate(seq("b", range(9)))  # 2 hits + 1 new
    assert not bm.can_allocate(seq("c", list(range(8)) + list(range(50, 55))))  # 2 hits + 2 new


def test_duplicate_block_stays_private():
    bm = BlockManager(8, BS)
    a, b = seq("a", range(5)), seq("b", range(5))
    bm.allocate(a)
    bm.allocate(b)  # neither computed yet: no sharing
    computed(bm, a)
    computed(bm, b)
    bm.free(b)
    assert bm.num_cached_free_blocks == 0  # b's copy of the block was never registered
    bm.free(a)
    assert bm.num_cached_free_blocks == 1


def test_reset_prefix_cache():
    bm = BlockManager(8, BS)
    a = seq("a", range(9))
    bm.allocate(a)
    computed(bm, a)
    bm.free(a)
    bm.reset_prefix_cache()
    assert bm.num_cached_free_blocks == 0 and bm.num_free_blocks == 8
    b = seq("b", range(9))
    bm.allocate(b)
    assert b.num_computed_tokens == 0


def test_prefix_caching_off():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a = seq("a", range(9))
    bm.allocate(a)
    computed(bm, a)
    b = seq("b", range(9))
    bm.allocate(b)
    assert b.num_computed_tokens == 0


def test_num_blocks_for_budget():
    # Llama-3-8B shape: 32 layers, 8 KV heads, head_dim 128, bf16, 16-token blocks -> 2 MiB per block.
    per_block = 2 * 32 * 16 * 8 * 128 * 2
    assert num_blocks_for_budget(10 * per_block + 1, 16, 32, 8, 128, 2) == 10
    assert num_blocks_for_budget(10 * per_block, 16, 32, 8, 128, 2, tp_size=2) == 20
    assert num_blocks_for_budget(10 * per_block, 16, 32, 8, 128, 2, tp_size=16) == 80  # one replicated head
    assert num_blocks_for_budget(100, 16, 32, 8, 128, 2) == 0
    with pytest.raises(ValueError, match="num_kv_heads"):
        num_blocks_for_budget(per_block, 16, 32, 6, 128, 2, tp_size=4)
