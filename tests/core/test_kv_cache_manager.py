"""KVCacheManager: block tables, exhaustion, prefix hits (capped), caching of full blocks, eviction order."""

from __future__ import annotations

from bitserve.core.kv_cache_manager import KVCacheManager
from bitserve.core.request import Request
from bitserve.sampling_params import SamplingParams


def _request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, tuple(tokens), SamplingParams(max_tokens=8))


def _compute(kv: KVCacheManager, request: Request, num_tokens: int) -> None:
    """What a step does: allocate, then (after the forward) advance progress and cache full blocks."""
    hits, num_hit = kv.get_computed_blocks(request) if request.num_computed_tokens == 0 else ([], 0)
    assert kv.allocate_slots(request, num_tokens, hits) is not None
    request.num_computed_tokens += num_hit + num_tokens
    kv.cache_full_blocks(request)


def test_allocate_slots_grows_the_table_by_whole_blocks() -> None:
    kv = KVCacheManager(block_size=4, num_blocks=9)
    request = _request("a", list(range(10)))
    first = kv.allocate_slots(request, 5)
    assert first is not None and len(first) == 2 and 0 not in first
    request.num_computed_tokens = 5
    # 3 more tokens fit in the second block: no new block.
    assert kv.allocate_slots(request, 3) == first
    request.num_computed_tokens = 8
    grown = kv.allocate_slots(request, 2)
    assert grown is not None and grown[:2] == first and len(grown) == 3
    assert kv.block_ids("a") == grown and kv.num_free_blocks == 8 - 3


def test_exhaustion_returns_none_and_allocates_nothing() -> None:
    kv = KVCacheManager(block_size=4, num_blocks=4)  # 3 usable blocks
    big = _request("big", list(range(20)))
    assert kv.allocate_slots(big, 13) is None
    assert kv.num_free_blocks == 3 and kv.block_ids("big") == []
    assert kv.allocate_slots(big, 12) is not None and kv.num_free_blocks == 0
    kv.free(big)
    assert kv.num_free_blocks == 3 and kv.block_ids("big") == []
    kv.free(big)  # freeing twice is a no-op, not a double decrement
    assert all(block.ref_count == 0 for block in kv.pool.blocks)


def test_prefix_hit_reuses_blocks_and_is_capped_below_the_whole_prompt() -> None:
    kv = KVCacheManager(block_size=4, num_blocks=17)
    prompt = list(range(100, 112))  # exactly 3 full blocks
    first = _request("first", prompt)
    _compute(kv, first, len(prompt))
    assert kv.pool.num_cached_blocks == 3
    second = _request("second", prompt)
    hits, num_hit = kv.get_computed_blocks(second)
    # 12 tokens: at most (12 - 1) // 4 = 2 blocks hit, so one token is left to produce logits.
    assert num_hit == 8 and [b.block_id for b in hits] == kv.block_ids("first")[:2]
    table = kv.allocate_slots(second, len(prompt) - num_hit, hits)
    assert table is not None and table[:2] == kv.block_ids("first")[:2]
    assert table[2] != kv.block_ids("first")[2]  # the recomputed last block is its own
    assert [kv.pool.blocks[i].ref_count for i in table[:2]] == [2, 2]
    # A longer prompt sharing the prefix hits all three blocks.
    longer = _request("longer", prompt + [7, 8])
    assert kv.get_computed_blocks(longer)[1] == 12


def test_hit_stops_at_the_first_mismatching_block() -> None:
    kv = KVCacheManager(block_size=4, num_blocks=17)
    _compute(kv, _request("a", list(range(12)) + [0]), 13)
    changed = list(range(12)) + [0]
    changed[5] = 999  # second block differs, so the third cannot match either (chained hashes)
    hits, num_hit = kv.get_computed_blocks(_request("b", changed))
    assert num_hit == 4 and len(hits) == 1


def test_blocks_are_cached_only_when_full_and_computed() -> None:
    kv = KVCacheManager(block_size=4, num_blocks=9)
    request = _request("a", list(range(10)))
    assert kv.allocate_slots(request, 10) is not None
    kv.cache_full_blocks(request)  # nothing computed yet
    assert kv.pool.num_cached_blocks == 0
    request.num_computed_tokens = 6
    kv.cache_full_blocks(request)
    assert kv.pool.num_cached_blocks == 1
    request.num_computed_tokens = 10
    kv.cache_full_blocks(request)
    assert kv.pool.num_cached_blocks == 2  # the third block holds 2 of 4 tokens: not cached


def test_hit_on_free_cached_blocks_counts_against_free_blocks() -> None:
    kv = KVCacheManager(block_size=4, num_blocks=5)  # 4 usable blocks
    prompt = list(range(9))
    first = _request("first", prompt)
    _compute(kv, first, 9)  # 3 blocks, 2 cached
    kv.free(first)
    assert kv.num_free_blocks == 4
    second = _request("second", prompt + list(range(50, 57)))  # 16 tokens = 4 blocks
    hits, num_hit = kv.get_computed_blocks(second)
    assert num_hit == 8
    # 2 hit blocks come out of the free queue, 2 more are allocated: exactly fits.
    assert kv.allocate_slots(second, 8, hits) is not None
    assert kv.num_free_blocks == 0
    third = _request("third", prompt)
    hits, _ = kv.get_computed_blocks(third)
    assert len(hits) == 2 and all(b.ref_count == 1 for b in hits)
    # In-use hits cost nothing, but the new block does: no room.
    assert kv.allocate_slots(third, 1, hits) is None
    assert all(b.ref_count == 1 for b in hits)


def test_eviction_takes_the_oldest_freed_blocks_and_a_sequence_tail_first() -> None:
    kv = KVCacheManager(block_size=2, num_blocks=7)  # 6 usable
    old = _request("old", [1, 2, 3, 4, 5, 6])
    new = _request("new", [7, 8, 9, 10, 11, 12])
    _compute(kv, old, 6)
    _compute(kv, new, 6)
    old_ids, new_ids = kv.block_ids("old"), kv.block_ids("new")
    kv.free(old)
    kv.free(new)
    assert kv.pool.free_block_ids() == old_ids[::-1] + new_ids[::-1]
    # Reusing 2 blocks evicts old's tail (blocks 3, then 2); old's first block and all of new survive.
    filler = _request("filler", [50, 51, 52, 53])
    assert kv.allocate_slots(filler, 4) == [old_ids[2], old_ids[1]]
    assert kv.get_computed_blocks(_request("o", [1, 2, 3, 4, 5, 6, 0]))[1] == 2
    assert kv.get_computed_blocks(_request("n", [7, 8, 9, 10, 11, 12, 0]))[1] == 6


def test_prefix_caching_disabled_never_hits() -> None:
    kv = KVCacheManager(block_size=4, num_blocks=9, enable_prefix_caching=False)
    prompt = list(range(12))
    _compute(kv, _request("a", prompt), 12)
    assert kv.get_computed_blocks(_request("b", prompt)) == ([], 0)
