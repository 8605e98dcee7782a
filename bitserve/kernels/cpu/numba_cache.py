"""Numba's on-disk kernel cache, made safe for processes that compile at the same time.

Why: every kernel is `cache=True`, and replicas started together on a fresh install (or a benchmark beside
a test run) compile the same functions at once. Numba's IndexDataCacheFile.save reads the index, picks the
first free data-file number, writes the index, then the data, with no lock: two processes saving two
specializations of one function (e.g. `_interleaved_body` for two block kinds) both pick number N, the
last index written lists one key and the last data written may be the other's code. Every later process
then loads machine code compiled for another signature and segfaults (measured here: every block GEMV of
a new process crashed until the caches were deleted). Writing the index before the data has the same
hazard inside one process's save when the source changed: a reader sees the new index entry while data
file N still holds the previous source's code.

install() replaces save() with one that holds an exclusive fcntl lock on `<index>.lock` for the whole
read-modify-write and writes the data file before the index that names it (each write is numba's own
atomic temp-file-and-rename). A reader then finds either no entry (and compiles) or an entry whose data
is complete. Loads take no lock: they never see a half-written file. Applied when the cpu backend's
kernel package is imported, before any kernel compiles; a numba whose cache class lacks the private
helpers this relies on is left as it is (logged once).
"""

from __future__ import annotations

import fcntl
import itertools
import logging
from typing import Any

from numba.core import caching

logger = logging.getLogger(__name__)
_HELPERS = ("_load_index", "_save_index", "_save_data", "_data_name")  # numba's own, used as they are


def _locked_save(self: Any, key: Any, data: Any) -> None:
    """IndexDataCacheFile.save under the index's lock, data before index. Where the lock file cannot be
    made (numba chose a directory it can write, so this is rare), the same order without the lock."""
    try:
        lock = open(self._index_path + ".lock", "ab")  # noqa: SIM115 - held across the save below
    except OSError:
        _save_data_first(self, key, data)
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            _save_data_first(self, key, data)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _save_data_first(cache: Any, key: Any, data: Any) -> None:
    """Numba's save (its own helpers), the data file written before the index entry that names it."""
    overloads = cache._load_index()
    data_name = overloads.get(key)
    if data_name is None:
        existing = set(overloads.values())
        data_name = next(name for name in map(cache._data_name, itertools.count(1)) if name not in existing)
    cache._save_data(data_name, data)
    if overloads.get(key) != data_name:
        overloads[key] = data_name
        cache._save_index(overloads)


def install() -> bool:
    """Patch numba's cache writer once per process; False where this numba's cache differs."""
    cache_file = caching.IndexDataCacheFile
    if cache_file.save is _locked_save:
        return True
    if not all(callable(getattr(cache_file, name, None)) for name in _HELPERS):
        logger.warning("this numba's cache writer is not the one bitserve locks: left unlocked")
        return False
    cache_file.save = _locked_save
    return True
