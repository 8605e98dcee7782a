"""`bitserve_gc_pause_seconds`: how long this process's cyclic garbage collections stopped it, by
generation. A collection holds the GIL for its whole pass, so in the API process it delays every stream
and arrival at once (bitserve/heap.py says why the long-lived heap is frozen out of it); the pauses are
what an operator reads to see whether that holds. prometheus_client's own `python_gc_*` metrics count
collections and objects, not time.

One `gc.callbacks` hook per process (installed on first use) keeps cumulative sums and bucket counts;
each sink's registry exports them through a collector, so apps and tests that build several sinks never
add hooks or double-count."""

from __future__ import annotations

import bisect
import gc
import threading
import time
from collections.abc import Iterator

from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector

# 100 us (a young collection) .. 1 s (a full one over a large unfrozen heap)
PAUSE_BUCKETS_S = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
GENERATIONS = 3


class _PauseTracker:
    """Cumulative pause histograms per generation, fed by the gc callback (which runs with the GIL)."""

    def __init__(self) -> None:
        self.counts = [[0] * (len(PAUSE_BUCKETS_S) + 1) for _ in range(GENERATIONS)]
        self.sums = [0.0] * GENERATIONS
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        pause = time.perf_counter() - self._started
        generation = min(info.get("generation", 0), GENERATIONS - 1)
        self.counts[generation][bisect.bisect_left(PAUSE_BUCKETS_S, pause)] += 1
        self.sums[generation] += pause


_tracker: _PauseTracker | None = None
_install_lock = threading.Lock()


def pause_tracker() -> _PauseTracker:
    """This process's tracker, its gc hook installed on the first call."""
    global _tracker
    with _install_lock:
        if _tracker is None:
            _tracker = _PauseTracker()
            gc.callbacks.append(_tracker)
        return _tracker


class GCPauseCollector(Collector):
    """Exports the process's collection pauses as one histogram labelled by generation."""

    def __init__(self) -> None:
        self._tracker = pause_tracker()

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(
            "bitserve_gc_pause_seconds",
            "Time this process was stopped by cyclic garbage collections, by generation.",
            labels=["generation"],
        )
        for generation in range(GENERATIONS):
            counts = list(self._tracker.counts[generation])  # a copy: the hook may add while we read
            cumulative, buckets = 0, []
            for bound, count in zip((*PAUSE_BUCKETS_S, float("inf")), counts, strict=True):
                cumulative += count
                buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
            family.add_metric([str(generation)], buckets, self._tracker.sums[generation])
        yield family
