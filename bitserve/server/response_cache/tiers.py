"""The response cache's two stores of `bytes` by key: MemoryTier (an LRU under a byte budget) and
DiskTier (one zlib-compressed file per entry under a folder, written atomically, with its own byte
budget; a damaged file is a miss and is removed). Both record when an entry was made, for the TTL.
MemoryTier is used on the event loop only; DiskTier from worker threads (its index has a lock)."""

from __future__ import annotations

import logging
import os
import struct
import threading
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

ENTRY_OVERHEAD_BYTES = 160  # key, tuple and dict slot of one memory entry, so tiny entries still count
DISK_MAGIC = b"BSRC1"  # bitserve response cache, file format 1
DISK_HEADER = struct.Struct(">5sd")  # magic, created (unix time)
DISK_SUFFIX = ".zlib"
COMPRESSION_LEVEL = 6


@dataclass(frozen=True, slots=True)
class Stored:
    created: float  # unix time the answer was made
    data: bytes


class MemoryTier:
    """Least recently used entries go first once their bytes pass `budget_bytes`."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.num_bytes = 0
        self.num_evictions = 0
        self._entries: OrderedDict[str, Stored] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def cost(stored: Stored) -> int:
        return len(stored.data) + ENTRY_OVERHEAD_BYTES

    def get(self, key: str) -> Stored | None:
        stored = self._entries.get(key)
        if stored is not None:
            self._entries.move_to_end(key)
        return stored

    def put(self, key: str, stored: Stored) -> None:
        """Keep `stored` (an entry over the whole budget is not kept), evicting the least recent."""
        self.remove(key)
        if self.cost(stored) > self.budget_bytes:
            return
        self._entries[key] = stored
        self.num_bytes += self.cost(stored)
        while self.num_bytes > self.budget_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.num_bytes -= self.cost(evicted)
            self.num_evictions += 1

    def remove(self, key: str) -> None:
        stored = self._entries.pop(key, None)
        if stored is not None:
            self.num_bytes -= self.cost(stored)


class DiskTier:
    """Files `<dir>/<key[:2]>/<key>.zlib`: a header (magic, created) then the zlib-compressed entry.
    Written to a temporary name and renamed, so a reader never sees half a file; the oldest files go
    first once the folder's entries pass `budget_bytes`. Existing files are indexed at start-up."""

    def __init__(self, directory: str | Path, budget_bytes: int) -> None:
        self.directory = Path(directory)
        self.budget_bytes = budget_bytes
        self.num_evictions = 0
        self.num_corrupt = 0
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> file bytes, least recent first
        self._num_bytes = 0  # the index's sum
        self.directory.mkdir(parents=True, exist_ok=True)
        self._scan()

    def _scan(self) -> None:
        found = []
        for path in self.directory.glob(f"??/*{DISK_SUFFIX}"):
            try:
                info = path.stat()
            except OSError:
                continue
            found.append((info.st_mtime, path.name[: -len(DISK_SUFFIX)], info.st_size))
        for _, key, size in sorted(found):
            self._index[key] = size
            self._num_bytes += size
        self._evict_over_budget()

    @property
    def num_bytes(self) -> int:
        return self._num_bytes

    def __len__(self) -> int:
        return len(self._index)

    def _path(self, key: str) -> Path:
        return self.directory / key[:2] / f"{key}{DISK_SUFFIX}"

    def get(self, key: str) -> Stored | None:
        """The entry, or None when absent or damaged (a damaged file is removed)."""
        with self._lock:
            if key not in self._index:
                return None
            self._index.move_to_end(key)
        try:
            raw = self._path(key).read_bytes()
        except OSError:
            self._forget(key)
            return None
        try:
            magic, created = DISK_HEADER.unpack_from(raw)
            if magic != DISK_MAGIC:
                raise ValueError("not a bitserve cache file")
            return Stored(created, zlib.decompress(raw[DISK_HEADER.size :]))
        except (struct.error, ValueError, zlib.error) as exc:
            logger.warning("response cache: ignoring the damaged entry %s (%s)", key[:16], exc)
            self.num_corrupt += 1
            self.remove(key)
            return None

    def put(self, key: str, stored: Stored) -> None:
        raw = DISK_HEADER.pack(DISK_MAGIC, stored.created) + zlib.compress(stored.data, COMPRESSION_LEVEL)
        if len(raw) > self.budget_bytes:
            return
        path = self._path(key)
        path.parent.mkdir(exist_ok=True)
        temporary = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            temporary.write_bytes(raw)
            os.replace(temporary, path)  # atomic: readers see the old file or the whole new one
        except OSError as exc:
            logger.warning("response cache: cannot write %s (%s)", path, exc)
            temporary.unlink(missing_ok=True)
            return
        with self._lock:
            self._num_bytes += len(raw) - self._index.pop(key, 0)
            self._index[key] = len(raw)
        self._evict_over_budget()

    def remove(self, key: str) -> None:
        self._forget(key)
        self._path(key).unlink(missing_ok=True)

    def _forget(self, key: str) -> None:
        with self._lock:
            self._num_bytes -= self._index.pop(key, 0)

    def _evict_over_budget(self) -> None:
        while True:
            with self._lock:
                if self._num_bytes <= self.budget_bytes or not self._index:
                    return
                key, size = self._index.popitem(last=False)
                self._num_bytes -= size
                self.num_evictions += 1
            self._path(key).unlink(missing_ok=True)
