"""Per-principal limits as token buckets: requests per minute, tokens per minute, tokens per day.

A bucket holds up to its limit and refills continuously (limit / window per second), so a principal may
burst to its limit and then runs at the average rate. Requests take 1 at admission; a generation takes
prompt + max_tokens (its most) at admission and gets back what it did not produce when it ends.
`MemoryRateLimiter` keeps the buckets in this process; `redis_limiter.RedisRateLimiter` shares them
across replicas. Both answer with a RateState, the source of the x-ratelimit-* headers.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from bitserve.errors import RateLimited
from bitserve.server.security.principal import Limits, Principal

MINUTE_S = 60.0
DAY_S = 86_400.0
# Buckets of principals idle this long are full again: dropped to bound memory.
MAX_NUM_BUCKETS = 100_000


@dataclass(frozen=True, slots=True)
class BucketSpec:
    """One budget: `capacity` units refilled over `window_s`."""

    kind: str  # "requests" | "tokens_minute" | "tokens_day"
    capacity: int
    window_s: float

    @property
    def rate_per_s(self) -> float:
        return self.capacity / self.window_s


@dataclass(frozen=True, slots=True)
class BucketState:
    limit: int
    remaining: int
    reset_s: float  # seconds until the bucket is full again


@dataclass(slots=True)
class RateState:
    """What the x-ratelimit-* headers report: requests, and the tightest token bucket."""

    requests: BucketState | None = None
    tokens: BucketState | None = None

    def headers(self) -> list[tuple[bytes, bytes]]:
        found: list[tuple[bytes, bytes]] = []
        for name, bucket in (("requests", self.requests), ("tokens", self.tokens)):
            if bucket is None:
                continue
            found += [
                (f"x-ratelimit-limit-{name}".encode(), str(bucket.limit).encode()),
                (f"x-ratelimit-remaining-{name}".encode(), str(bucket.remaining).encode()),
                (f"x-ratelimit-reset-{name}".encode(), duration_text(bucket.reset_s).encode()),
            ]
        return found


def duration_text(seconds: float) -> str:
    """OpenAI's reset format: "20ms", "1s", "6m0s", "1h2m3s"."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    whole = math.ceil(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


def request_specs(limits: Limits) -> list[BucketSpec]:
    if limits.requests_per_minute is None:
        return []
    return [BucketSpec("requests", limits.requests_per_minute, MINUTE_S)]


def token_specs(limits: Limits) -> list[BucketSpec]:
    specs = []
    if limits.tokens_per_minute is not None:
        specs.append(BucketSpec("tokens_minute", limits.tokens_per_minute, MINUTE_S))
    if limits.tokens_per_day is not None:
        specs.append(BucketSpec("tokens_day", limits.tokens_per_day, DAY_S))
    return specs


def bucket_state(spec: BucketSpec, level: float) -> BucketState:
    level = max(0.0, min(float(spec.capacity), level))
    return BucketState(spec.capacity, int(level), (spec.capacity - level) / spec.rate_per_s)


def tightest(states: list[BucketState]) -> BucketState | None:
    """The bucket the caller runs out of first (fewest remaining)."""
    return min(states, key=lambda state: state.remaining, default=None)


def rate_limited(what: str, cost: int, specs: list[BucketSpec], wait_s: float) -> RateLimited:
    if any(cost > spec.capacity for spec in specs):
        limit = min(spec.capacity for spec in specs)
        return RateLimited(
            f"this request needs {cost} {what}, more than the limit of {limit}",
            retry_after_s=wait_s,
            hint="lower max_tokens (or the prompt): this request can never fit the limit",
        )
    return RateLimited(f"{what} rate limit reached", retry_after_s=wait_s)


class RateLimiter(Protocol):
    """Per-principal buckets. `admit` takes one request; `charge` takes tokens (both all or nothing,
    raising RateLimited with the wait); `refund` gives tokens back."""

    async def admit(self, principal: Principal) -> RateState: ...

    async def charge(self, principal: Principal, num_tokens: int) -> RateState: ...

    async def refund(self, principal: Principal, num_tokens: int) -> None: ...

    async def close(self) -> None: ...


@dataclass(slots=True)
class _Bucket:
    level: float
    updated: float


@dataclass
class MemoryRateLimiter:
    """Buckets in this process (one replica). Runs on the event loop: no locks needed."""

    clock: Callable[[], float] = time.monotonic
    _buckets: dict[tuple[str, str], _Bucket] = field(default_factory=dict)

    def _level(self, principal: Principal, spec: BucketSpec, now: float) -> _Bucket:
        key = (principal.name, spec.kind)
        bucket = self._buckets.get(key)
        if bucket is None:
            if len(self._buckets) >= MAX_NUM_BUCKETS:
                self._evict_full(now)
            bucket = self._buckets[key] = _Bucket(float(spec.capacity), now)
        bucket.level = min(float(spec.capacity), bucket.level + (now - bucket.updated) * spec.rate_per_s)
        bucket.updated = now
        return bucket

    def _evict_full(self, now: float) -> None:
        """Drop buckets idle for a day (full by then whatever their window)."""
        for key in [key for key, bucket in self._buckets.items() if now - bucket.updated > DAY_S]:
            del self._buckets[key]

    def _take(self, principal: Principal, specs: list[BucketSpec], cost: int, what: str) -> list[BucketState]:
        now = self.clock()
        buckets = [self._level(principal, spec, now) for spec in specs]
        wait_s = max(
            ((cost - b.level) / s.rate_per_s for s, b in zip(specs, buckets, strict=True) if b.level < cost),
            default=0.0,
        )
        if wait_s > 0:
            raise rate_limited(what, cost, specs, wait_s)
        for bucket in buckets:
            bucket.level -= cost
        return [bucket_state(spec, bucket.level) for spec, bucket in zip(specs, buckets, strict=True)]

    async def admit(self, principal: Principal) -> RateState:
        state = RateState()
        specs = request_specs(principal.limits)
        if specs:
            state.requests = self._take(principal, specs, 1, "requests")[0]
        tokens = token_specs(principal.limits)
        if tokens:
            now = self.clock()
            state.tokens = tightest([bucket_state(s, self._level(principal, s, now).level) for s in tokens])
        return state

    async def charge(self, principal: Principal, num_tokens: int) -> RateState:
        specs = token_specs(principal.limits)
        if not specs:
            return RateState()
        return RateState(tokens=tightest(self._take(principal, specs, num_tokens, "tokens")))

    async def refund(self, principal: Principal, num_tokens: int) -> None:
        now = self.clock()
        for spec in token_specs(principal.limits):
            bucket = self._level(principal, spec, now)
            bucket.level = min(float(spec.capacity), bucket.level + num_tokens)

    async def close(self) -> None:
        self._buckets.clear()
