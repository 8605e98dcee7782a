"""ResponseCache: answers of deterministic requests by key (key.py), in memory and optionally on
disk, each served until its TTL passes; counters for /v1/stats and /metrics. Lives on the event
loop; disk reads and writes run in worker threads (writes in the background; `flush` awaits them)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from bitserve.config import ServerConfig
from bitserve.frontend.batch_stream import BatchStream
from bitserve.frontend.device_router import RoutedStream
from bitserve.lifecycle.slot import SlotInfo
from bitserve.metrics.stats import CacheTierStats, ResponseCacheStats
from bitserve.outputs import RequestOutput
from bitserve.server.protocol import GenerationRequest
from bitserve.server.response_cache.entry import CachedCompletion
from bitserve.server.response_cache.key import cache_key, is_deterministic
from bitserve.server.response_cache.streams import RecordingStream
from bitserve.server.response_cache.tiers import DiskTier, MemoryTier, Stored

logger = logging.getLogger(__name__)

CACHE_HEADER = "X-Cache"  # "hit" or "miss" on a response the cache looked up; absent otherwise


class ResponseCache:
    def __init__(
        self,
        memory_bytes: int,
        ttl_s: float,
        *,
        directory: str | None = None,
        disk_bytes: int = 0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.ttl_s = ttl_s
        self.memory = MemoryTier(memory_bytes)
        self.disk = DiskTier(directory, disk_bytes) if directory is not None else None
        self.clock = clock
        self.hits = {"memory": 0, "disk": 0}
        self.misses = self.stores = self.expired = self.corrupt = 0
        self._writes: set[asyncio.Future[None]] = set()

    @classmethod
    def from_config(cls, config: ServerConfig) -> ResponseCache | None:
        """The cache the settings ask for, or None when --response-cache is off."""
        if not config.response_cache:
            return None
        return cls(
            config.response_cache_bytes,
            config.response_cache_ttl_s,
            directory=config.response_cache_dir,
            disk_bytes=config.response_cache_disk_bytes,
        )

    async def get(self, key: str) -> CachedCompletion | None:
        """The live answer filed under `key` (a disk hit is copied into memory), else None."""
        tier, stored = "memory", self.memory.get(key)
        if stored is None and self.disk is not None:
            tier, stored = "disk", await asyncio.to_thread(self.disk.get, key)
        if stored is not None and self.clock() - stored.created >= self.ttl_s:
            self.expired += 1
            await self._remove(key)
            stored = None
        entry = self._decode(key, stored) if stored is not None else None
        if entry is None:
            self.misses += 1
            return None
        if tier == "disk":
            assert stored is not None
            self.memory.put(key, stored)
        self.hits[tier] += 1
        return entry

    def _decode(self, key: str, stored: Stored) -> CachedCompletion | None:
        try:
            return CachedCompletion.from_bytes(stored.data)
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            logger.warning("response cache: ignoring the unreadable entry %s (%s)", key[:16], exc)
            self.corrupt += 1
            self.memory.remove(key)
            if self.disk is not None:
                self._in_background(self.disk.remove, key)
            return None

    def put(self, key: str, entry: CachedCompletion) -> None:
        """Keep `entry` in memory now, and on disk in the background."""
        stored = Stored(self.clock(), entry.to_bytes())
        self.memory.put(key, stored)
        self.stores += 1
        if self.disk is not None:
            self._in_background(self.disk.put, key, stored)

    async def _remove(self, key: str) -> None:
        self.memory.remove(key)
        if self.disk is not None:
            await asyncio.to_thread(self.disk.remove, key)

    def _in_background(self, work: Callable[..., None], *args: Any) -> None:
        future = asyncio.get_running_loop().run_in_executor(None, work, *args)
        self._writes.add(future)
        future.add_done_callback(self._writes.discard)

    async def flush(self) -> None:
        """Wait for the disk writes under way (at shutdown, so a restart finds every stored answer)."""
        if self._writes:
            await asyncio.gather(*list(self._writes), return_exceptions=True)

    def stats(self) -> ResponseCacheStats:
        disk = None
        if self.disk is not None:
            disk = CacheTierStats(
                self.hits["disk"],
                len(self.disk),
                self.disk.num_bytes,
                self.disk.budget_bytes,
                self.disk.num_evictions,
            )
        memory = CacheTierStats(
            self.hits["memory"],
            len(self.memory),
            self.memory.num_bytes,
            self.memory.budget_bytes,
            self.memory.num_evictions,
        )
        return ResponseCacheStats(
            self.misses, self.stores, self.expired, self.corrupt + self._disk_corrupt(), memory, disk
        )

    def _disk_corrupt(self) -> int:
        return self.disk.num_corrupt if self.disk is not None else 0

    def describe(self) -> dict[str, Any]:
        """The /v1/stats section: counters, tiers and the hit ratio of cacheable lookups."""
        stats = self.stats()
        lookups = stats.hits + stats.misses
        return {
            "enabled": True,
            "ttl_s": self.ttl_s,
            "hits": stats.hits,
            "hit_ratio": round(stats.hits / lookups, 4) if lookups else None,
            **dataclasses.asdict(stats),
        }


@dataclasses.dataclass(frozen=True, slots=True)
class CacheLookup:
    """One request's look-up: its key, and the stored answer when there was one."""

    cache: ResponseCache
    key: str
    entry: CachedCompletion | None

    def recording(
        self, stream: RoutedStream | BatchStream, prompt_token_ids: list[list[int]]
    ) -> RecordingStream:
        """`stream`, storing its answer under this key once it completes."""

        def on_complete(result: RequestOutput) -> None:
            entry = CachedCompletion.of(prompt_token_ids, result)
            if entry is not None:
                self.cache.put(self.key, entry)

        return RecordingStream(stream, on_complete)


async def look_up(
    cache: ResponseCache | None, endpoint: str, body: GenerationRequest, info: SlotInfo
) -> CacheLookup | None:
    """None when there is no cache or the request is not deterministic (sampled without a seed)."""
    if cache is None or not is_deterministic(body.to_sampling_params()):
        return None
    key = cache_key(endpoint, body, info)
    return CacheLookup(cache, key, await cache.get(key))
