"""kernels/cpu/numba_cache.py: numba's cache index and data stay consistent when processes save at once.

Several processes save distinct keys (one function's specializations) into one cache file at the same
time, as replicas compiling together do; afterwards every key must load exactly its own data. Numba's
unlocked save lets two processes take the same data-file number, so one key's index entry names another
key's code (the segfault this module exists for); with the lock each key keeps its own file.
"""

from __future__ import annotations

import multiprocessing
from pathlib import Path

from numba.core import caching

from bitserve.kernels.cpu import numba_cache

WRITERS, KEYS_EACH = 4, 25


def _writer(folder: str, writer: int) -> None:
    numba_cache.install()
    cache = caching.IndexDataCacheFile(folder, "kernel", source_stamp=("stamp", 1))
    for index in range(KEYS_EACH):
        cache.save((writer, index), f"code of {writer}/{index}")


def test_concurrent_saves_keep_every_key_on_its_own_data(tmp_path: Path) -> None:
    context = multiprocessing.get_context("fork")
    workers = [context.Process(target=_writer, args=(str(tmp_path), w)) for w in range(WRITERS)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
        assert worker.exitcode == 0
    cache = caching.IndexDataCacheFile(str(tmp_path), "kernel", source_stamp=("stamp", 1))
    for writer in range(WRITERS):
        for index in range(KEYS_EACH):
            assert cache.load((writer, index)) == f"code of {writer}/{index}"


def test_install_is_idempotent_and_active_in_the_cpu_backend() -> None:
    import bitserve.kernels.cpu  # noqa: F401  (installs it)

    assert numba_cache.install()
    assert caching.IndexDataCacheFile.save is numba_cache._locked_save
