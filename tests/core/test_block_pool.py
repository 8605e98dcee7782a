"""BlockPool: ref counts, the null block, LRU eviction of free cached blocks; chained block hashes."""

from __future__ import annotations

import pytest

from bitserve.core.block_hash import extend_block_hashes, hash_block, root_hash
from bitserve.core.block_pool import NULL_BLOCK_ID, BlockPool


def test_null_block_is_never_allocated() -> None:
    pool = BlockPool(5)
    assert pool.num_usable_blocks == pool.num_free_blocks == 4
    blocks = pool.allocate(4)
    assert NULL_BLOCK_ID not in [b.block_id for b in blocks]
    assert pool.num_free_blocks == 0 and pool.usage == 1.0
    with pytest.raises(RuntimeError):
        pool.allocate(1)


def test_allocate_free_round_trip_and_ref_counts() -> None:
    pool = BlockPool(6)
    a, b = pool.allocate(2)
    assert (a.ref_count, b.ref_count) == (1, 1)
    pool.touch([a])  # a second holder (a prefix hit)
    pool.free([a, b])
    assert a.ref_count == 1 and b.ref_count == 0
    assert not pool.is_free(a.block_id) and pool.is_free(b.block_id)
    pool.free([a])
    assert pool.num_free_blocks == 5 and pool.usage == 0.0


def test_ref_count_never_goes_negative() -> None:
    pool = BlockPool(3)
    (block,) = pool.allocate(1)
    pool.free([block])
    with pytest.raises(AssertionError):
        pool.free([block])
    assert block.ref_count == 0


def test_uncached_freed_blocks_are_reused_last_freed_first_before_fresh_ones() -> None:
    pool = BlockPool(8)
    blocks = pool.allocate(4)
    assert [b.block_id for b in blocks] == [1, 2, 3, 4]  # fresh blocks: lowest id first
    pool.free([blocks[2], blocks[0], blocks[3], blocks[1]])
    assert pool.free_block_ids() == [2, 4, 1, 3, 5, 6, 7]
    # The last freed come back first, and no fresh block is touched while a freed one is left.
    assert [b.block_id for b in pool.allocate(5)] == [2, 4, 1, 3, 5]
    assert pool.num_fresh_blocks == 2


def test_cached_blocks_are_reused_before_fresh_ones_lru_first() -> None:
    pool = BlockPool(8)
    a, b, c = pool.allocate(3)
    pool.cache_block(a, hash_block(root_hash(), [1]))
    pool.cache_block(b, hash_block(root_hash(), [2]))
    pool.free([b, a, c])  # b least recently freed, c holds no prefix
    assert pool.free_block_ids() == [c.block_id, b.block_id, a.block_id, 4, 5, 6, 7]
    first, second = pool.allocate(2)
    assert (first, second) == (c, b) and b.block_hash is None  # b's prefix evicted, a's kept
    assert pool.get_cached_block(hash_block(root_hash(), [1])) is a
    assert pool.num_fresh_blocks == 4  # resident pages reused: RSS does not grow (issue 10)


def test_light_load_touches_only_its_peak_of_blocks() -> None:
    pool = BlockPool(1000)
    for step in range(500):  # one request at a time: 3 blocks, the first two cached
        blocks = pool.allocate(3)
        pool.cache_block(blocks[0], hash_block(root_hash(), [step, 0]))
        pool.cache_block(blocks[1], hash_block(root_hash(), [step, 1]))
        pool.free(blocks[::-1])
    assert pool.num_usable_blocks - pool.num_fresh_blocks == 3
    assert pool.num_free_blocks == pool.num_usable_blocks and pool.usage == 0.0


def test_free_cached_block_stays_findable_until_reused_then_evicted_lru() -> None:
    pool = BlockPool(4)
    old, new, other = pool.allocate(3)
    h_old, h_new = hash_block(root_hash(), [1, 2]), hash_block(root_hash(), [3, 4])
    pool.cache_block(old, h_old)
    pool.cache_block(new, h_new)
    pool.free([old])  # freed first: least recently used
    pool.free([new])
    assert pool.get_cached_block(h_old) is old and pool.get_cached_block(h_new) is new
    pool.free([other])
    # `other` holds no prefix and goes first; then `old`, the least recently freed cached block, whose
    # hash is evicted, not `new`'s.
    uncached, reused = pool.allocate(2)
    assert uncached is other and reused is old and reused.block_hash is None
    assert pool.get_cached_block(h_old) is None
    assert pool.get_cached_block(h_new) is new


def test_touch_takes_a_free_cached_block_out_of_the_free_queue() -> None:
    pool = BlockPool(4)
    block, _ = pool.allocate(2)
    block_hash = hash_block(root_hash(), [9])
    pool.cache_block(block, block_hash)
    pool.free([block])
    assert pool.is_free(block.block_id)
    pool.touch([pool.get_cached_block(block_hash)])
    assert block.ref_count == 1 and not pool.is_free(block.block_id)
    assert block.block_id not in pool.free_block_ids()
    # Still cached while in use, and allocation cannot hand it out.
    assert pool.get_cached_block(block_hash) is block
    assert block not in pool.allocate(pool.num_free_blocks)


def test_duplicate_hash_keeps_the_first_block() -> None:
    pool = BlockPool(4)
    first, second = pool.allocate(2)
    block_hash = hash_block(root_hash(), [5, 6])
    pool.cache_block(first, block_hash)
    pool.cache_block(second, block_hash)
    assert pool.get_cached_block(block_hash) is first and second.block_hash is None
    assert pool.num_cached_blocks == 1


def test_prefix_caching_disabled_caches_nothing() -> None:
    pool = BlockPool(4, enable_prefix_caching=False)
    (block,) = pool.allocate(1)
    block_hash = hash_block(root_hash(), [1])
    pool.cache_block(block, block_hash)
    assert pool.get_cached_block(block_hash) is None


def test_block_hashes_are_chained_and_keyed() -> None:
    tokens = list(range(12))
    hashes: list[bytes] = []
    extend_block_hashes(hashes, tokens, 4, 2, root_hash())
    extend_block_hashes(hashes, tokens, 4, 3, root_hash())  # extends, never recomputes
    assert len(hashes) == 3 and len(set(hashes)) == 3
    assert hashes[1] == hash_block(hash_block(root_hash(), tokens[:4]), tokens[4:8])
    # Same block content behind a different prefix is a different hash.
    other: list[bytes] = []
    extend_block_hashes(other, [99, 1, 2, 3] + tokens[4:8], 4, 2, root_hash())
    assert other[1] != hashes[1]
    # An extra key (model revision, adapter) separates caches.
    keyed: list[bytes] = []
    extend_block_hashes(keyed, tokens, 4, 1, root_hash("adapter-a"))
    assert keyed[0] != hashes[0]
    with pytest.raises(ValueError):
        extend_block_hashes([], tokens, 4, 4, root_hash())  # only 3 full blocks
