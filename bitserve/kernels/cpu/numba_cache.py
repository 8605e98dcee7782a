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

install() also makes every cache of this package's kernels stale when any of the package's sources changes,
not only the kernel's own file. Numba checks a cached function against its own file's stamp alone, but the
machine code it caches holds the callees it inlined or linked from other files: after an edit to int8dot.py,
decode_step.py's cached one-call step still ran the old GEMM (measured 2026-12-07: a benchmark of the new
kernels timed the old ones until the cache was deleted). The index's stamp becomes (numba's own stamp, a
SHA-256 of the package's sources), so a checkout that changes any kernel file recompiles them all.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import itertools
import logging
from pathlib import Path
from typing import Any

from numba.core import caching

logger = logging.getLogger(__name__)
_HELPERS = ("_load_index", "_save_index", "_save_data", "_data_name")  # numba's own, used as they are
PACKAGE_DIR = Path(__file__).resolve().parent  # every cache=True kernel of bitserve lives here
# where numba puts this package's caches: beside the sources, or under NUMBA_CACHE_DIR at their path
_CACHE_SUFFIXES = (("bitserve", "kernels", "cpu", "__pycache__"), ("bitserve", "kernels", "cpu"))


def sources_fingerprint(directory: Path) -> str:
    """SHA-256 over the names and bytes of `directory`'s .py files, in name order."""
    digest = hashlib.sha256()
    for path in sorted(directory.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


@functools.cache
def package_fingerprint() -> str:
    return sources_fingerprint(PACKAGE_DIR)


def is_kernel_cache(cache_path: str) -> bool:
    """Whether numba's cache folder `cache_path` holds this package's kernels."""
    parts = Path(cache_path).parts
    return any(parts[-len(suffix) :] == suffix for suffix in _CACHE_SUFFIXES)


_numba_init = caching.IndexDataCacheFile.__init__


def _init_with_package_stamp(self: Any, cache_path: str, filename_base: str, source_stamp: Any) -> None:
    """IndexDataCacheFile.__init__ with this package's fingerprint in the stamp of its kernels' caches."""
    if is_kernel_cache(cache_path):
        source_stamp = (source_stamp, package_fingerprint())
    _numba_init(self, cache_path, filename_base, source_stamp)


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
    """Patch numba's cache writer and stamp once per process; False where this numba's cache differs."""
    cache_file = caching.IndexDataCacheFile
    if cache_file.save is _locked_save:
        return True
    if not all(callable(getattr(cache_file, name, None)) for name in _HELPERS):
        logger.warning("this numba's cache writer is not the one bitserve locks: left unlocked")
        return False
    cache_file.save = _locked_save
    cache_file.__init__ = _init_with_package_stamp
    return True
