"""The Redis-shared limiter against a real `redis-server` (started here on a free port): two limiters
(two replicas) share one budget; refunds; when Redis goes away the limiter fails closed (503) or open
as configured, and counts it. Skips when redis-server is not installed, except under CI, where
.ci/run installs it and a skip would hide a gap."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
import security_testing as st
from conftest import IN_PROCESS_SERVER
from fastapi.testclient import TestClient
from http_testing import free_port
from redis_testing import REDIS_SERVER, ExternalRedis, RedisProcess, shared_redis

from bitserve.errors import LimiterUnavailable, RateLimited
from bitserve.server.security.config import SecurityConfig
from bitserve.server.security.principal import Limits, Principal
from bitserve.server.security.redis_limiter import RedisRateLimiter


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProcess | ExternalRedis]:
    yield from shared_redis(tmp_path_factory)


def principal(name: str, **limits: int) -> Principal:
    return Principal(name, frozenset({"inference"}), None, Limits(**limits))


def test_replicas_share_one_budget(redis_server: RedisProcess | ExternalRedis) -> None:
    async def run() -> None:
        first, second = RedisRateLimiter(redis_server.url), RedisRateLimiter(redis_server.url)
        caller = principal(f"shared-{time.time_ns()}", requests_per_minute=4, tokens_per_minute=100)
        states = [await limiter.admit(caller) for limiter in (first, second, first, second)]
        assert [state.requests.remaining for state in states] == [3, 2, 1, 0]  # type: ignore[union-attr]
        with pytest.raises(RateLimited) as refused:
            await first.admit(caller)
        assert 10 < refused.value.retry_after_s <= 15
        charged = await second.charge(caller, 70)
        assert charged.tokens is not None and charged.tokens.remaining == 30
        with pytest.raises(RateLimited):
            await first.charge(caller, 40)
        await first.refund(caller, 50)
        assert (await second.charge(caller, 40)).tokens.remaining == 40  # type: ignore[union-attr]
        await first.close()
        await second.close()

    asyncio.run(run())


def test_concurrent_charges_never_overspend(redis_server: RedisProcess | ExternalRedis) -> None:
    async def run() -> int:
        # a generous socket timeout: this test is about atomicity; on a loaded CI machine 100 concurrent
        # charges can wait past the production 0.5 s, which would fail them as "limiter unavailable"
        limiters = [
            RedisRateLimiter(redis_server.url, client=aioredis.from_url(redis_server.url, socket_timeout=30))
            for _ in range(4)
        ]
        caller = principal(f"race-{time.time_ns()}", tokens_per_day=1000)

        async def one(limiter: RedisRateLimiter) -> bool:
            try:
                await limiter.charge(caller, 30)
                return True
            except RateLimited:
                return False

        results = await asyncio.gather(*(one(limiters[i % 4]) for i in range(100)))
        for limiter in limiters:
            await limiter.close()
        return sum(results)

    assert asyncio.run(run()) == 33  # 33 * 30 <= 1000 < 34 * 30


@pytest.mark.parametrize("on_error", ["closed", "open"])
def test_a_redis_outage_fails_as_configured(tmp_path: Path, on_error: str) -> None:
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not installed")
    errors: list[str] = []
    server = RedisProcess(tmp_path)

    async def run() -> None:
        limiter = RedisRateLimiter(server.url, on_error=on_error, on_backend_error=errors.append)
        caller = principal("outage", requests_per_minute=10, tokens_per_minute=100)
        assert (await limiter.admit(caller)).requests is not None
        server.stop()
        if on_error == "closed":
            with pytest.raises(LimiterUnavailable):
                await limiter.admit(caller)
            with pytest.raises(LimiterUnavailable):
                await limiter.charge(caller, 10)
        else:
            assert (await limiter.admit(caller)).requests is None  # served, no limit, no headers
            assert (await limiter.charge(caller, 10)).tokens is None
        await limiter.close()

    try:
        asyncio.run(run())
    finally:
        server.stop()
    assert errors and set(errors) == {on_error}


@pytest.mark.parametrize("on_error", ["closed", "open"])
def test_the_server_fails_closed_or_open_and_counts_it(
    tmp_path: Path, synthetic_instance: object, on_error: str
) -> None:
    """Through the app: Redis unreachable (nothing listens on the port)."""
    from bitserve.server.app import build_app

    security = SecurityConfig(
        auth_file=str(st.write_auth_file(tmp_path / "auth.toml")),
        rate_limit_url=f"redis://127.0.0.1:{free_port()}/0",
        rate_limit_on_error=on_error,
    )
    app = build_app(IN_PROCESS_SERVER, instance=synthetic_instance, security=security)  # type: ignore[arg-type]
    with TestClient(app) as client:
        response = client.get("/v1/models", headers=st.bearer("limited"))
        if on_error == "closed":
            assert response.status_code == 503 and response.headers["retry-after"]
            assert response.json()["error"]["code"] == "rate_limiter_unavailable"
        else:
            assert response.status_code == 200 and "x-ratelimit-limit-requests" not in response.headers
        metrics = client.get("/metrics", headers=st.bearer("admin")).text
        assert f'bitserve_rate_limiter_errors_total{{on_error="{on_error}"}} 1.0' in metrics
