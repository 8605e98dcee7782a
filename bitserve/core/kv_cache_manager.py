"""KVCacheManager: per-request block tables over a BlockPool, prefix-cache lookups, allocate / free.

Decides which KV blocks each request holds; the runner turns the block ids into page writes.
"""

from __future__ import annotations

from collections.abc import Sequence

from bitserve.core.block_hash import extend_block_hashes, root_hash
from bitserve.core.block_pool import BlockPool, KVBlock
from bitserve.core.request import Request


class KVCacheManager:
    """Block tables of the live requests of one KV cache.

    Invariant: a request's table holds ceil(tokens / block_size) blocks for the tokens it has been
    given slots for; the first `_num_cached_blocks[id]` of them are registered in the prefix cache.
    """

    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        enable_prefix_caching: bool = True,
        extra_key: str | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self._root_hash = root_hash(extra_key)
        self._block_tables: dict[str, list[KVBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_usable_blocks(self) -> int:
        return self.pool.num_usable_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_resident_blocks(self) -> int:
        """Blocks handed out at least once (their K/V pages are resident); the rest were never written."""
        return self.pool.num_usable_blocks - self.pool.num_fresh_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` token slots."""
        return -(-num_tokens // self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        """The request's whole block table as ids (empty if it holds none)."""
        return [block.block_id for block in self._block_tables.get(request_id, ())]

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest run of cached full blocks matching the start of the request's tokens.

        Called before a waiting request is first (or again) scheduled; changes no state. Returns the
        blocks and the number of tokens they cover. Never the whole sequence: at least one token is
        left to compute so the step has logits to sample, so hits stop at (num_tokens - 1) rounded
        down to a block.
        """
        if not self.enable_prefix_caching:
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        self._ensure_block_hashes(request, max_hit_blocks)
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVBlock] = (),
        num_lookahead_tokens: int = 0,
    ) -> list[int] | None:
        """Give the request slots for `num_new_tokens` more tokens, first adopting prefix hits.

        `new_computed_blocks` (from `get_computed_blocks`, only for a request holding no blocks)
        cover tokens counted beyond `request.num_computed_tokens`. `num_lookahead_tokens` more slots
        are reserved past the new tokens (a runner that launches the next decode step before this one
        ends writes there). Returns the whole block table, or None, allocating nothing, when the free
        blocks cannot cover it.
        """
        table = self._block_tables.get(request.request_id)
        assert not (table and new_computed_blocks), "prefix hits only for a request without blocks"
        num_held = len(table) if table else 0
        num_hit_tokens = len(new_computed_blocks) * self.block_size
        num_total_tokens = (
            request.num_computed_tokens + num_hit_tokens + num_new_tokens + num_lookahead_tokens
        )
        num_required = self.num_blocks_for(num_total_tokens)
        num_new_blocks = max(0, num_required - num_held - len(new_computed_blocks))
        # A hit on a free cached block takes it out of the free list, so it counts against the free
        # blocks just like a fresh allocation.
        num_evictable_hits = sum(1 for block in new_computed_blocks if block.ref_count == 0)
        if num_new_blocks + num_evictable_hits > self.pool.num_free_blocks:
            return None
        if table is None:
            table = self._block_tables[request.request_id] = []
            self._num_cached_blocks[request.request_id] = 0
        if new_computed_blocks:
            # Touch before allocating, so the allocator cannot evict a block we are adopting.
            self.pool.touch(new_computed_blocks)
            table.extend(new_computed_blocks)
            self._num_cached_blocks[request.request_id] = len(new_computed_blocks)
        table.extend(self.pool.allocate(num_new_blocks))
        return [block.block_id for block in table]

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's newly full, computed blocks in the prefix cache.

        Called after a step advanced `request.num_computed_tokens`: a block is cached once all of
        its slots hold computed KV, never earlier.
        """
        if not self.enable_prefix_caching:
            return
        table = self._block_tables.get(request.request_id)
        if not table:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(table))
        num_cached = self._num_cached_blocks[request.request_id]
        if num_full <= num_cached:
            return
        self._ensure_block_hashes(request, num_full)
        for index in range(num_cached, num_full):
            self.pool.cache_block(table[index], request.block_hashes[index])
        self._num_cached_blocks[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Release every block the request holds (finish, abort, preemption). No-op if none."""
        table = self._block_tables.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        if table:
            # Tail first: a sequence's last blocks are the least likely to be shared, so they sit
            # nearer the head of the LRU queue and are evicted before its prefix blocks.
            self.pool.free(reversed(table))

    def _ensure_block_hashes(self, request: Request, num_blocks: int) -> None:
        if len(request.block_hashes) < num_blocks:
            extend_block_hashes(
                request.block_hashes, request.all_token_ids, self.block_size, num_blocks, self._root_hash
            )
