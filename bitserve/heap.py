"""The cyclic garbage collector around a server's long-lived heap.

A serving process holds a few hundred thousand objects for its whole life (the tokenizer's vocabulary,
the app, pydantic models, the model's modules), and every oldest-generation collection walks all of them:
under a 256-stream burst the API process spent ~1 s of 24 in collections, the longest 222 ms (2-vCPU VM,
2026-12-07), long enough to hold a whole step's tokens and a wave of arrivals behind it. `gc.freeze()`
after loading moves what is alive then into the permanent generation, which collections skip (vLLM's API
server and engine core do the same after startup).

Freezing is a policy of a process that owns its heap: `bitserve serve` turns it on (`manage_heap`), the
engine process always freezes after its one model is loaded, and a library user or a test's process is
left alone. A swap frees a model whose objects may sit in frozen reference cycles: `refreeze` thaws
everything, collects once (one full pause, at a load or an unload only) and freezes what survives.
"""

from __future__ import annotations

import gc
import logging
import time

logger = logging.getLogger(__name__)

_managed = False  # `bitserve serve` owns this process's heap


def manage_heap() -> None:
    """This process is a server: freeze its long-lived heap after each model load or unload."""
    global _managed
    _managed = True


def freeze(where: str) -> None:
    """Collect, then freeze every object alive now (they are never scanned again)."""
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
    logger.info(
        "%s: %d long-lived objects frozen out of the garbage collector's scans (%.0f ms)",
        where,
        gc.get_freeze_count(),
        (time.perf_counter() - started) * 1e3,
    )


def refreeze(where: str) -> None:
    """In a managed process: thaw, collect (reclaiming a freed model's cycles), freeze the survivors."""
    if not _managed:
        return
    gc.unfreeze()
    freeze(where)
