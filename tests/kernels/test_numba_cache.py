"""kernels/cpu/numba_cache.py: numba's cache index and data stay consistent when processes save at once.

Several processes save distinct keys (one function's specializations) into one cache file at the same
time, as replicas compiling together do; afterwards every key must load exactly its own data. Numba's
unlocked save lets two processes take the same data-file number, so one key's index entry names another
key's code (the segfault this module exists for); with the lock each key keeps its own file.
"""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest
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


def _step_cache(folder: Path) -> caching.IndexDataCacheFile:
    return caching.IndexDataCacheFile(str(folder), "decode_step._step-1.py311", source_stamp=(1.0, 10))


def test_a_kernel_cache_is_stale_once_any_source_of_the_package_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cached step holds the GEMM it linked from another file: an edit there must recompile it too."""
    import bitserve.kernels.cpu  # noqa: F401  (installs it)

    folder = tmp_path / "bitserve" / "kernels" / "cpu" / "__pycache__"
    folder.mkdir(parents=True)
    _step_cache(folder).save("key", "code")
    assert _step_cache(folder).load("key") == "code"
    # the step's own file stamp unchanged, another file of the package edited
    edited = tmp_path / "edited"
    edited.mkdir()
    (edited / "int8dot.py").write_text("# another GEMM\n")
    monkeypatch.setattr(numba_cache, "PACKAGE_DIR", edited)
    numba_cache.package_fingerprint.cache_clear()
    try:
        assert _step_cache(folder).load("key") is None
    finally:
        numba_cache.package_fingerprint.cache_clear()


def test_other_caches_keep_numbas_own_stamp(tmp_path: Path) -> None:
    import bitserve.kernels.cpu  # noqa: F401  (installs it)

    assert numba_cache.is_kernel_cache("/site/bitserve/kernels/cpu/__pycache__")
    assert numba_cache.is_kernel_cache("/numba-cache/site/bitserve/kernels/cpu")  # under NUMBA_CACHE_DIR
    assert not numba_cache.is_kernel_cache(str(tmp_path))
    assert caching.IndexDataCacheFile(str(tmp_path), "other", source_stamp=("stamp", 1))._source_stamp == (
        "stamp",
        1,
    )


def test_the_fingerprint_follows_every_source_file(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "b.py").write_text("y = 2\n")
    before = numba_cache.sources_fingerprint(tmp_path)
    (tmp_path / "b.py").write_text("y = 3\n")
    assert numba_cache.sources_fingerprint(tmp_path) != before
