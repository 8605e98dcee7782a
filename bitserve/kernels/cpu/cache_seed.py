"""A prebuilt numba kernel cache, copied into the writable cache before the first kernel loads.

Why: numba compiles every `cache=True` kernel on first use (~40 s on 2 cores) and will only use a cache
folder it can write (its locators test that with a temporary file and fall through to the next). A
container image runs on a read-only root with the cache on a tmpfs, so a cache compiled into the image
(deploy/docker/Dockerfile compiles one at build time) cannot be numba's cache folder itself. Instead
`bitserve serve --kernel-cache-seed` (`BITSERVE_KERNEL_CACHE_SEED`) names it, and each start copies the
files missing from `NUMBA_CACHE_DIR` (well under a second), so a pod is ready in seconds, not a minute.

The entries are machine code for the CPU that built them: numba keys each one by CPU name and features,
so on another CPU model they are simply not found and that machine compiles its own (logged below by the
warm-up). Entries of a different bitserve build are stale by numba_cache's package stamp.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

from numba.core import config as numba_config

logger = logging.getLogger(__name__)


def seed_numba_cache(seed: str, target: str | None = None) -> int:
    """Copy the files of `seed` that `target` (default numba's NUMBA_CACHE_DIR) lacks, keeping their
    relative paths; the number copied. Nothing to do (0) when either is empty, they are one folder, or
    the seed does not exist. Call it before the first kernel loads (`bitserve serve` does, before the
    model)."""
    target = target if target is not None else numba_config.CACHE_DIR
    if not seed or not target:
        return 0
    seed_dir, target_dir = Path(seed), Path(target)
    if not seed_dir.is_dir() or seed_dir.resolve() == target_dir.resolve():
        return 0
    started, copied, size = time.monotonic(), 0, 0
    for source in seed_dir.rglob("*"):
        destination = target_dir / source.relative_to(seed_dir)
        if source.is_file() and not destination.exists():
            destination.parent.mkdir(parents=True, exist_ok=True)
            partial = destination.with_name(destination.name + f".{os.getpid()}.partial")
            shutil.copyfile(source, partial)
            partial.replace(destination)  # atomic: a replica starting beside this one sees all or nothing
            copied, size = copied + 1, size + destination.stat().st_size
    if copied:
        logger.info(
            "kernel cache: copied %d prebuilt files (%.1f MB) from %s to %s in %.2f s",
            copied,
            size / 1e6,
            seed_dir,
            target_dir,
            time.monotonic() - started,
        )
    return copied
