"""BlockPool: the KV blocks of one cache, their ref counts, the free blocks and the prefix-cache map.

Bookkeeping only: block ids index the runner's K/V pages, which this module never touches.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from bitserve.core.block_hash import BlockHash

# NOTE: block 0 is reserved as the null block: never allocated, never freed, never cached. The
# runner pads block tables with 0 and may point padding slots (e.g. CUDA-graph padding) at it, so
# stray writes land in a page no request reads.
NULL_BLOCK_ID = 0


@dataclass(eq=False, slots=True)
class KVBlock:
    """One block of `block_size` token slots.

    Invariant: ref_count >= 0, and a block is free (ref_count == 0: in a free list, or never handed
    out) or in use (ref_count > 0, in no free list), never both. A free block may still hold `block_hash`:
    it stays findable for prefix hits until the allocator reuses it.
    """

    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    """All blocks of one KV cache.

    Free blocks sit in one of three places, and allocation takes them in this order:
    1. freed blocks holding no prefix, most recently freed first (a stack): their pages are resident
       and recently written, and reusing them loses nothing;
    2. freed blocks holding a cached prefix, least recently freed first (an insertion-ordered dict, so
       `touch` can pull a hit out of the middle in O(1)): reusing one evicts the LRU prefix;
    3. blocks never handed out, lowest id first.
    NOTE: resident before fresh. The K/V pages are zeroed lazily (runner/kv_cache.py), so a page costs
    RSS only once written: a server touches new pages only when the blocks it already touched are all
    in use, and its RSS follows the peak load it has seen, not the pool size (issue 10). The price: the
    prefix cache keeps at most the blocks of that peak, not the whole pool, under light load.
    """

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(block_id) for block_id in range(num_blocks)]
        self._free_uncached: list[int] = []  # a stack: the last freed is reused first
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # LRU order, head evicted first
        self._next_fresh_id = 1  # blocks from here on were never handed out
        self._cached_blocks: dict[BlockHash, KVBlock] = {}

    @property
    def num_usable_blocks(self) -> int:
        """Blocks requests can hold: all but the null block."""
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Free blocks, cached or not (a free cached block is evicted when allocated)."""
        return len(self._free_uncached) + len(self._free_cached) + self.num_fresh_blocks

    @property
    def num_fresh_blocks(self) -> int:
        """Blocks never handed out: their pages were never written."""
        return self.num_blocks - self._next_fresh_id

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached_blocks)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use, 0..1."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        """The block holding the KV of the prefix `block_hash` names, in use or free; None on a miss."""
        return self._cached_blocks.get(block_hash)

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take one more reference to each block (prefix hits); a free block leaves its free list."""
        for block in blocks:
            assert block.block_id != NULL_BLOCK_ID, "the null block is never referenced"
            if block.ref_count == 0:  # only cached blocks are found, so a free one is in _free_cached
                del self._free_cached[block.block_id]
            block.ref_count += 1

    def allocate(self, num_blocks: int) -> list[KVBlock]:
        """Take `num_blocks` free blocks in the class docstring's order, evicting their cached hashes.

        The caller checks `num_free_blocks` first; asking for more is a bug.
        """
        if num_blocks > self.num_free_blocks:
            raise RuntimeError(f"allocate({num_blocks}) with only {self.num_free_blocks} free blocks")
        allocated = []
        for _ in range(num_blocks):
            block = self.blocks[self._pop_free_id()]
            assert block.ref_count == 0, f"free block {block.block_id} has refs"
            self._evict(block)
            block.ref_count = 1
            allocated.append(block)
        return allocated

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference to each block, in the given order; blocks reaching 0 become free.

        Callers pass a sequence's blocks tail first, so its last (least shared) cached blocks are
        evicted before its prefix, and its first uncached block is reused first.
        """
        for block in blocks:
            assert block.ref_count > 0, f"block {block.block_id} freed with ref_count {block.ref_count}"
            block.ref_count -= 1
            if block.ref_count > 0:
                continue
            if block.block_hash is None:
                self._free_uncached.append(block.block_id)
            else:
                self._free_cached[block.block_id] = None

    def cache_block(self, block: KVBlock, block_hash: BlockHash) -> None:
        """Register a full, computed block under `block_hash` so later requests can hit it.

        If another block already holds this hash (two requests computed the same prefix at once),
        the first stays registered and `block` remains an ordinary block.
        """
        if not self.enable_prefix_caching or block.block_hash is not None:
            return
        assert block.ref_count > 0, "only blocks in use hold freshly computed KV"
        if block_hash in self._cached_blocks:
            return
        block.block_hash = block_hash
        self._cached_blocks[block_hash] = block

    def is_free(self, block_id: int) -> bool:
        return block_id != NULL_BLOCK_ID and self.blocks[block_id].ref_count == 0

    def free_block_ids(self) -> list[int]:
        """Free block ids in allocation order (next allocated first). For tests and debugging."""
        fresh = range(self._next_fresh_id, self.num_blocks)
        return [*reversed(self._free_uncached), *self._free_cached, *fresh]

    def _pop_free_id(self) -> int:
        if self._free_uncached:
            return self._free_uncached.pop()
        if self._free_cached:
            return self._free_cached.popitem(last=False)[0]
        self._next_fresh_id += 1
        return self._next_fresh_id - 1

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        if self._cached_blocks.get(block.block_hash) is block:
            del self._cached_blocks[block.block_hash]
        block.block_hash = None
