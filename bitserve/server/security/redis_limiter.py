"""RedisRateLimiter: the token buckets of rate_limits.py shared by every replica through Redis. One
Lua script reads, refills, checks and takes all of a principal's buckets atomically (Redis runs a
script alone), timed by Redis's own clock so replicas with skewed clocks agree.

When Redis fails (down, slow, refusing), `on_error` decides: "closed" refuses the request with 503
(LimiterUnavailable), "open" serves it unlimited; each failure is counted (`on_backend_error`). A circuit
breaker (server/breakers.py) stops asking a Redis that failed N times in a row: while it is open the
`on_error` path is taken at once, so a hanging Redis no longer costs each request its socket timeout.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from bitserve.errors import CircuitOpen, LimiterUnavailable
from bitserve.server.breakers import CircuitBreaker
from bitserve.server.security.principal import Principal
from bitserve.server.security.rate_limits import (
    BucketSpec,
    RateState,
    bucket_state,
    rate_limited,
    request_specs,
    tightest,
    token_specs,
)

logger = logging.getLogger(__name__)

KEY_PREFIX = "bitserve:rl:"
# A limiter must answer fast or not at all: a slow Redis must not hold every request.
SOCKET_TIMEOUT_S = 0.5
MILLI = 1000

# KEYS: bucket keys; ARGV: cost, then capacity and refill-per-second per bucket. cost > 0 takes it from
# every bucket or from none; cost < 0 gives it back (capped at capacity); 0 only reads.
# Returns {allowed (1/0), wait ms, level*1000 per bucket}.
BUCKET_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local cost = tonumber(ARGV[1])
local levels = {}
local wait = 0
for i = 1, #KEYS do
  local cap = tonumber(ARGV[2 * i])
  local rate = tonumber(ARGV[2 * i + 1])
  local v = redis.call('HMGET', KEYS[i], 'level', 'ts')
  local level = tonumber(v[1]) or cap
  local ts = tonumber(v[2]) or now
  level = math.min(cap, level + math.max(0, now - ts) * rate)
  levels[i] = level
  if cost > 0 and level < cost then
    wait = math.max(wait, (cost - level) / rate)
  end
end
local allowed = wait == 0
local out = {allowed and 1 or 0, math.ceil(wait * 1000)}
for i = 1, #KEYS do
  local cap = tonumber(ARGV[2 * i])
  local rate = tonumber(ARGV[2 * i + 1])
  local level = levels[i]
  if allowed then level = math.min(cap, level - cost) end
  redis.call('HSET', KEYS[i], 'level', tostring(level), 'ts', tostring(now))
  redis.call('PEXPIRE', KEYS[i], math.ceil(cap / rate * 1000) + 1000)
  out[#out + 1] = math.floor(level * 1000)
end
return out
"""


class RedisRateLimiter:
    def __init__(
        self,
        url: str,
        *,
        on_error: str = "closed",
        on_backend_error: Callable[[str], None] | None = None,
        client: Any = None,
        breaker: CircuitBreaker | None = None,
    ) -> None:
        self.on_error = on_error
        self.on_backend_error = on_backend_error
        self.breaker = breaker or CircuitBreaker("redis")
        self.client = client or aioredis.from_url(
            url, socket_timeout=SOCKET_TIMEOUT_S, socket_connect_timeout=SOCKET_TIMEOUT_S
        )
        self._script = self.client.register_script(BUCKET_SCRIPT)

    async def _run(
        self, principal: Principal, specs: list[BucketSpec], cost: int
    ) -> tuple[bool, float, list[float]]:
        """One script call through the breaker: CircuitOpen without touching Redis while it is open. (A
        call cancelled with its request reports nothing; a lost probe is given up after a cool-down.)"""
        self.breaker.check()
        try:
            result = await self._call(principal, specs, cost)
        except (RedisError, OSError, asyncio.TimeoutError):
            self.breaker.record_failure()
            raise
        self.breaker.record_success()
        return result

    async def _call(
        self, principal: Principal, specs: list[BucketSpec], cost: int
    ) -> tuple[bool, float, list[float]]:
        keys = [f"{KEY_PREFIX}{spec.kind}:{principal.name}" for spec in specs]
        args: list[float] = [cost]
        for spec in specs:
            args += [spec.capacity, spec.rate_per_s]
        result = await self._script(keys=keys, args=args)
        allowed, wait_ms, *levels = (int(value) for value in result)
        return bool(allowed), wait_ms / MILLI, [level / MILLI for level in levels]

    def _failed(self, exc: BaseException) -> None:
        """Count the failure; raise LimiterUnavailable when failing closed."""
        if not isinstance(exc, CircuitOpen):  # an open breaker logged its opening once, not every call
            logger.warning("rate limiter backend failed (%s): failing %s", type(exc).__name__, self.on_error)
        if self.on_backend_error is not None:
            self.on_backend_error(self.on_error)
        if self.on_error == "closed":
            raise LimiterUnavailable(
                "the rate limiter is unavailable", hint="retry after the number of seconds in Retry-After"
            ) from None

    async def _take(
        self, principal: Principal, specs: list[BucketSpec], cost: int, what: str
    ) -> list[float] | None:
        try:
            allowed, wait_s, levels = await self._run(principal, specs, cost)
        except (RedisError, OSError, asyncio.TimeoutError, CircuitOpen) as exc:
            self._failed(exc)
            return None  # failing open: no limit, no headers
        if not allowed:
            raise rate_limited(what, cost, specs, wait_s)
        return levels

    async def admit(self, principal: Principal) -> RateState:
        state = RateState()
        specs = request_specs(principal.limits)
        if specs:
            levels = await self._take(principal, specs, 1, "requests")
            if levels is not None:
                state.requests = bucket_state(specs[0], levels[0])
        tokens = token_specs(principal.limits)
        if tokens:
            levels = await self._take(principal, tokens, 0, "tokens")
            if levels is not None:
                state.tokens = tightest(
                    [bucket_state(s, level) for s, level in zip(tokens, levels, strict=True)]
                )
        return state

    async def charge(self, principal: Principal, num_tokens: int) -> RateState:
        specs = token_specs(principal.limits)
        levels = await self._take(principal, specs, num_tokens, "tokens") if specs else None
        if levels is None:
            return RateState()
        return RateState(
            tokens=tightest([bucket_state(s, level) for s, level in zip(specs, levels, strict=True)])
        )

    async def refund(self, principal: Principal, num_tokens: int) -> None:
        specs = token_specs(principal.limits)
        if not specs or num_tokens <= 0:
            return
        try:
            await self._run(principal, specs, -num_tokens)
        except (RedisError, OSError, asyncio.TimeoutError, CircuitOpen) as exc:
            # A lost refund only under-serves the principal until its bucket refills; never refuse.
            if not isinstance(exc, CircuitOpen):
                logger.warning("rate limiter refund failed (%s)", type(exc).__name__)
            if self.on_backend_error is not None:
                self.on_backend_error(self.on_error)

    async def close(self) -> None:
        await self.client.aclose()
