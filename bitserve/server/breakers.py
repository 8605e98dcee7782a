"""Circuit breakers around the server's network dependencies (the Redis rate limiter, the Batch API
database, the OTLP collector): after `failure_threshold` consecutive failures a breaker opens and callers
take their fallback at once instead of each waiting on a dead or hanging dependency; after `cooldown_s`
one probe call goes through (half-open): its success closes the breaker, its failure opens it again.

Thread-safe (the batch store calls it from worker threads, the span exporter from its own thread), and
never blocks or awaits, so it is as usable on the event loop. Imports no other bitserve server module.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from bitserve.errors import CircuitOpen
from bitserve.metrics.stats import BreakerStats

logger = logging.getLogger(__name__)

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"  # metrics/breakers.py names the same three
DEFAULT_FAILURE_THRESHOLD = 5
DEFAULT_COOLDOWN_S = 10.0


class CircuitBreaker:
    """closed -> open after `failure_threshold` consecutive failures -> half-open after `cooldown_s`,
    when one probe is let through -> closed on its success, open again on its failure.

    Callers ask `allow()` before a call and report its outcome with `record_success()` /
    `record_failure()`. A probe whose caller never reports (cancelled) is given up after another
    `cooldown_s`, so a lost probe cannot hold the breaker half-open for ever."""

    def __init__(
        self,
        name: str,
        *,
        failure_threshold: int = DEFAULT_FAILURE_THRESHOLD,
        cooldown_s: float = DEFAULT_COOLDOWN_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if failure_threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1, got {failure_threshold}")
        if not cooldown_s > 0:
            raise ValueError(f"cooldown_s must be > 0, got {cooldown_s}")
        self.name = name
        self.failure_threshold = failure_threshold
        self.cooldown_s = cooldown_s
        self.clock = clock
        self._lock = threading.Lock()
        self._state = CLOSED
        self._num_failures = 0  # consecutive; reset by a success
        self._opened_at: float | None = None
        self._probe_started_at: float | None = None  # half-open: when the probe in flight was let through
        self.transitions: Counter[str] = Counter()  # state entered -> times
        self.num_rejected = 0  # calls refused while open or while a probe was in flight
        self.num_dropped = 0  # what a caller dropped instead (the OTLP exporter: spans)

    @property
    def state(self) -> str:
        return self._state

    @property
    def num_failures(self) -> int:
        return self._num_failures

    def allow(self) -> bool:
        """Whether to make the call now: always when closed; when open, only once the cool-down is over
        (that call is the probe, and the breaker turns half-open); when half-open, only when no probe is
        in flight (or the last one was lost)."""
        with self._lock:
            if self._state == CLOSED:
                return True
            now = self.clock()
            if (
                self._state == OPEN
                and self._opened_at is not None
                and now - self._opened_at >= self.cooldown_s
            ):
                self._move(HALF_OPEN)
            if self._state == HALF_OPEN and (
                self._probe_started_at is None or now - self._probe_started_at >= self.cooldown_s
            ):
                self._probe_started_at = now
                return True
            self.num_rejected += 1
            return False

    def check(self) -> None:
        """`allow()`, raising CircuitOpen (a 503 with Retry-After) when the call must not be made."""
        if not self.allow():
            raise CircuitOpen(
                f"the {self.name} dependency is unavailable (circuit breaker open)",
                retry_after_s=self.retry_after_s(),
            )

    def record_success(self) -> None:
        with self._lock:
            self._num_failures = 0
            self._probe_started_at = None
            if self._state != CLOSED:
                self._opened_at = None
                self._move(CLOSED)

    def record_failure(self) -> None:
        with self._lock:
            self._num_failures += 1
            self._probe_started_at = None
            # a failed probe re-opens at once; a closed breaker opens at the threshold
            if self._state == HALF_OPEN or (
                self._state == CLOSED and self._num_failures >= self.failure_threshold
            ):
                self._opened_at = self.clock()
                self._move(OPEN)

    def record_dropped(self, count: int) -> None:
        """The caller dropped `count` items (spans) because the breaker refused the call."""
        with self._lock:
            self.num_dropped += count

    def retry_after_s(self) -> float:
        """Seconds until the next probe may go (0 when closed)."""
        with self._lock:
            if self._state == CLOSED or self._opened_at is None:
                return 0.0
            return max(0.0, self.cooldown_s - (self.clock() - self._opened_at))

    def _move(self, state: str) -> None:
        """Enter `state` (the lock is held). Transitions are logged: the calls between them are not."""
        level = logging.WARNING if state == OPEN else logging.INFO
        logger.log(
            level,
            "circuit breaker %s: %s -> %s (%d failure(s))",
            self.name,
            self._state,
            state,
            self._num_failures,
        )
        self._state = state
        self.transitions[state] += 1

    def describe(self) -> dict[str, Any]:
        """/health's view: {"state", "failures", "opened_seconds_ago" (None unless open or half-open)}."""
        with self._lock:
            opened = None if self._opened_at is None else round(self.clock() - self._opened_at, 3)
            return {"state": self._state, "failures": self._num_failures, "opened_seconds_ago": opened}

    def stats(self) -> BreakerStats:
        with self._lock:
            return BreakerStats(
                self.name, self._state, dict(self.transitions), self.num_rejected, self.num_dropped
            )


class Breakers:
    """The app's breakers by dependency name, all with the configured threshold and cool-down."""

    def __init__(
        self,
        failure_threshold: int = DEFAULT_FAILURE_THRESHOLD,
        cooldown_s: float = DEFAULT_COOLDOWN_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.failure_threshold = failure_threshold
        self.cooldown_s = cooldown_s
        self.clock = clock
        self._breakers: dict[str, CircuitBreaker] = {}

    def get(self, name: str) -> CircuitBreaker:
        """The breaker of `name`, made on first use (only dependencies that are configured get one)."""
        if name not in self._breakers:
            self._breakers[name] = CircuitBreaker(
                name, failure_threshold=self.failure_threshold, cooldown_s=self.cooldown_s, clock=self.clock
            )
        return self._breakers[name]

    def describe(self) -> dict[str, dict[str, Any]]:
        return {name: breaker.describe() for name, breaker in sorted(self._breakers.items())}

    def stats(self) -> list[BreakerStats]:
        return [breaker.stats() for _, breaker in sorted(self._breakers.items())]
