"""The prefix cache's bookkeeping without a model: chain hashes, reference counts, LRU eviction, the
last partial block never shared, a hit never covering the last token, waiting for a block another
prompt is computing, and read-only shared blocks."""

from __future__ import annotations

import pytest
import torch

from engines.errors import CacheCapacityError
from engines.kv_cache import BlockAllocator, PagedKVCache, hash_block

BS = 4


def cache(num_blocks: int = 16, lookahead: int = 0) -> PagedKVCache:
    kv = PagedKVCache(1, 1, 2, num_blocks, BS, torch.float32, "cpu", enable_prefix_caching=True)
    kv.lookahead = lookahead
    return kv


def source(tokens: list[int]):
    return lambda start, end: tokens[start:end]


def run(kv: PagedKVCache, seq: str, tokens: list[int], computed: int | None = None) -> list[int]:
    """Admit `seq` with its cache hit, 'compute' the rest, cache its full blocks; returns the hit blocks."""
    hit, pending = kv.match(seq, source(tokens), len(tokens))
    assert not pending
    kv.attach(seq, hit, len(tokens))
    kv.allocate(seq, len(tokens))
    kv.cache_blocks(seq, source(tokens), len(tokens) - 1 if computed is None else computed, len(tokens))
    return hit


def test_chain_hash_depends_on_the_parent_and_every_token():
    h = hash_block(None, [1, 2, 3, 4])
    assert h == hash_block(None, [1, 2, 3, 4])  # stable (BLAKE2b, not Python's salted hash)
    assert h != hash_block(None, [1, 2, 3, 5]) and h != hash_block(h, [1, 2, 3, 4])
    assert hash_block(h, [5, 6, 7, 8]) != hash_block(hash_block(None, [9, 2, 3, 4]), [5, 6, 7, 8])


def test_allocator_counts_references_and_evicts_least_recently_freed_first():
    alloc = BlockAllocator(4)
    a = alloc.allocate(3)
    for i, b in enumerate(a):
        alloc.cache(b, 100 + i)
    alloc.touch(a[:2])  # shared by a second sequence
    alloc.free(a)
    assert alloc.num_free == 2 and alloc.ref_counts[a[0]] == 1  # a[2] is cached and free, a[0:2] still held
    alloc.free(a[:2])
    assert alloc.num_free == 4 and alloc.num_cached == 3
    # the empty block goes first, then cached ones least recently freed first: a sequence's blocks are
    # freed last-first, so its tail (a[2], freed alone earlier, then a[1]) goes before its head
    assert alloc.allocate(1) not in a
    assert alloc.allocate(1) == [a[2]] and 102 not in alloc.cached
    assert alloc.allocate(1) == [a[1]] and alloc.cached == {100: a[0]}
    alloc.touch([a[0]])  # a hit takes the cached block back off the eviction list
    with pytest.raises(CacheCapacityError):
        alloc.allocate(1)
    with pytest.raises(RuntimeError, match="freed more often"):
        alloc.free([a[2], a[2]])


def test_a_second_block_with_a_cached_hash_stays_private():
    alloc = BlockAllocator(2)
    a, b = alloc.allocate(2)
    alloc.cache(a, 7)
    alloc.cache(b, 7)
    assert alloc.cached == {7: a} and alloc.block_hash[b] is None
    alloc.free([b])
    assert alloc.num_free == 1 and alloc.cached == {7: a}


def test_a_hit_covers_full_blocks_only_and_never_the_last_token():
    kv = cache()
    tokens = list(range(100, 118))  # 18 tokens: 4 full blocks and a partial one
    assert run(kv, "a", tokens) == []
    assert kv.allocator.num_cached == 4  # 17 computed tokens: blocks 0-3; the partial block 4 is never cached
    # the same prompt hits blocks 0-3; a 16-token prompt only blocks 0-2 (its last token must be computed)
    assert run(kv, "b", tokens) == kv.block_tables["a"][:4]
    hit, _ = kv.match("c", source(tokens[:16]), 16)
    assert hit == kv.block_tables["a"][:3]
    assert kv.allocator.ref_counts[kv.block_tables["a"][0]] == 2
    # a different first token shares nothing; a different 6th token shares only block 0
    assert kv.match("d", source([0, *tokens[1:]]), 18)[0] == []
    assert kv.match("e", source([*tokens[:5], 0, *tokens[6:]]), 18)[0] == kv.block_tables["a"][:1]


def test_freed_blocks_stay_cached_until_the_pool_needs_them():
    kv = cache(num_blocks=6)
    first = list(range(20))  # 5 blocks
    run(kv, "a", first)
    kv.free("a")
    assert kv.allocator.num_free == 6 and kv.allocator.num_cached == 4
    again, _ = kv.match("b", source(first), 20)
    assert len(again) == 4  # a later request (a conversation's next turn) still finds them
    run(kv, "c", list(range(50, 70)))  # 5 blocks: the empty ones first, then evicts the LRU cached blocks
    assert kv.allocator.num_evicted == 3
    assert len(kv.match("d", source(first), 20)[0]) == 1  # only the first block survived (evicted last)


def test_admission_accounts_for_cached_blocks_no_one_holds():
    kv = cache(num_blocks=5)
    tokens = list(range(17))
    run(kv, "a", tokens)
    kv.free("a")
    hit, _ = kv.match("b", source(tokens), 17)
    assert len(hit) == 4 and kv.allocator.num_free == 5
    assert kv.can_allocate_with("b", hit, 17)  # 4 cached + 1 new
    assert not kv.can_allocate_with("b", hit, 21)  # 4 cached + 2 new > 5
    assert kv.can_allocate_with("b", [], 20) and not kv.can_allocate_with("b", [], 21)


def test_a_prompt_sees_the_blocks_another_prompt_is_computing():
    kv = cache()
    tokens = list(range(30))
    hit, _ = kv.match("a", source(tokens), 30)
    kv.attach("a", hit, 30)
    kv.allocate("a", 16)  # its first chunk
    assert kv.match("b", source(tokens), 30) == ([], 7)  # a computes blocks 0-6 (7 full blocks of 29 tokens)
    assert kv.match("c", source([*tokens[:8], 9, *tokens[9:]]), 30) == ([], 2)  # shares blocks 0-1 only
    kv.cache_blocks("a", source(tokens), 16, 30)  # a's first chunk done: blocks 0-3 cached
    hit, pending = kv.match("b", source(tokens), 30)
    assert len(hit) == 4 and pending == 3
    kv.free("a")  # a went away (aborted, preempted): nothing to wait for
    hit, pending = kv.match("b", source(tokens), 30)
    assert len(hit) == 4 and pending == 0


def test_lookahead_hashes_cover_the_next_token():
    plain, ahead = cache(), cache(lookahead=1)
    a = list(range(13))
    b = a[:8] + [99] * 5  # diverges exactly at block 2's first token
    for kv in (plain, ahead):
        run(kv, "a", a)
    assert len(plain.match("b", source(b), 13)[0]) == 2
    assert len(ahead.match("b", source(b), 13)[0]) == 1  # block 1's hash covers token 8, which differs
    assert len(ahead.match("a2", source(a), 13)[0]) == 3


def test_shared_and_cached_blocks_are_read_only():
    kv = cache()
    tokens = list(range(18))
    run(kv, "a", tokens)
    run(kv, "b", tokens)
    kv.check_writable("b", 16)  # its own partial block and past it
    with pytest.raises(RuntimeError, match="shared or cached"):
        kv.check_writable("b", 15)  # block 3 is shared with a
    kv.free("b")
    with pytest.raises(RuntimeError, match="shared or cached"):
        kv.check_writable("a", 12)  # cached (findable) though a alone holds it now


def test_counters_and_reset():
    kv = cache()
    kv.record_lookup(20, 16)
    kv.record_lookup(10, 0)
    st = kv.prefix_stats
    assert (st.queries, st.hits, st.requests, st.hit_requests) == (30, 16, 2, 1)
    assert st.hit_rate == pytest.approx(16 / 30)
    run(kv, "a", list(range(18)))
    kv.reset_prefix_cache()
    assert kv.allocator.num_cached == 0 and kv.match("b", source(list(range(18))), 18)[0] == []
