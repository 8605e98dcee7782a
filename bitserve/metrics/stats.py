"""Stats records and the StatsSink protocol. Plain dataclasses; anyone may import this module.

The production sink is `metrics/prometheus.py` (only the server app imports it); tests and the
offline LLM use NullStatsSink.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from bitserve.core.step_outputs import StepStats


@dataclass(frozen=True, slots=True)
class RequestStats:
    """One finished client request (all its choices), recorded by the AsyncEngine of the replica that
    served it."""

    model: str
    device: str  # the replica's device ("cpu", "cuda:0")
    quant_format: str  # the projections' GGUF type ("I2_S", "Q4_1"): the version's weight format
    finish_reason: str
    num_prompt_tokens: int
    num_output_tokens: int
    e2e_s: float
    ttft_s: float | None
    mean_itl_s: float | None
    queue_s: float | None = None


# the lifecycle actions counted as bitserve_model_swaps_total (the others: ..._lifecycle_events_total)
SWAP_ACTIONS = ("swap", "rollback", "auto_rollback", "canary", "canary_promote", "canary_rollback")


@dataclass(frozen=True, slots=True)
class LifecycleEvent:
    """One finished model-lifecycle action, recorded by the ModelManager."""

    action: str  # load | unload | evict, or one of SWAP_ACTIONS
    alias: str
    version: str
    result: str  # success | rejected
    duration_s: float | None = None  # load actions: seconds to load and validate


@dataclass(frozen=True, slots=True)
class SlotLabels:
    """The version an alias serves now (the model info gauge's labels)."""

    alias: str
    version: str
    file_name: str
    architecture: str


@dataclass(frozen=True, slots=True)
class CacheTierStats:
    """One tier of the response cache now: its hits, entries, bytes and evictions so far."""

    hits: int
    entries: int
    bytes: int
    budget_bytes: int
    evictions: int


@dataclass(frozen=True, slots=True)
class ResponseCacheStats:
    """The response cache's counters (server/response_cache), read by /v1/stats and each scrape."""

    misses: int  # lookups of cacheable requests that found nothing (they were generated)
    stores: int  # complete answers kept
    expired: int  # entries found past their TTL (dropped, counted as misses)
    corrupt: int  # damaged disk entries ignored and removed (counted as misses)
    memory: CacheTierStats
    disk: CacheTierStats | None  # None without --response-cache-dir

    @property
    def hits(self) -> int:
        return self.memory.hits + (self.disk.hits if self.disk is not None else 0)


@dataclass(frozen=True, slots=True)
class BatchStats:
    """The Batch API now: batches by status and open requests by state (read from the database, every
    process sharing it together, as of the worker's last pass), and the requests this process's worker
    ended or retried since it started."""

    by_status: dict[str, int]
    num_pending: int
    num_running: int
    num_completed: int
    num_failed: int
    num_retried: int


@dataclass(frozen=True, slots=True)
class BreakerStats:
    """One circuit breaker (server/breakers.py) for /metrics: its state (closed | open | half_open), the
    times it entered each state, the calls it refused, and what its dependency dropped while open."""

    name: str
    state: str
    transitions: dict[str, int]
    num_rejected: int
    num_dropped: int = 0  # spans the OTLP exporter dropped (the other breakers drop nothing)


class StatsSink(Protocol):
    def record_step(self, model: str, device: str, quant_format: str, stats: StepStats) -> None:
        """One engine step of `model`'s replica on `device` (serving weights of `quant_format`)."""
        ...

    def record_request(self, stats: RequestStats) -> None: ...

    def record_rejected(self, reason: str) -> None: ...

    def record_aborted(self, reason: str) -> None: ...

    def record_lifecycle(self, event: LifecycleEvent) -> None: ...

    def set_served_models(self, models: list[SlotLabels]) -> None: ...

    def forget_model(self, model: str, device: str | None = None) -> None:
        """`model` is gone (unloaded), or (with `device`) no longer runs there: drop those gauges so
        they report no stale load."""
        ...


class NullStatsSink:
    def record_step(self, model: str, device: str, quant_format: str, stats: StepStats) -> None:
        return None

    def record_request(self, stats: RequestStats) -> None:
        return None

    def record_rejected(self, reason: str) -> None:
        return None

    def record_aborted(self, reason: str) -> None:
        return None

    def record_lifecycle(self, event: LifecycleEvent) -> None:
        return None

    def set_served_models(self, models: list[SlotLabels]) -> None:
        return None

    def forget_model(self, model: str, device: str | None = None) -> None:
        return None
