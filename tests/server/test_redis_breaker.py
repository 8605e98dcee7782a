"""The Redis limiter's circuit breaker over real sockets: a `bitserve serve` process whose Redis is stopped
mid-run (requests keep their latency once the breaker opens; the breaker closes on a half-open probe when
Redis returns, and limits apply again), and a Redis that accepts connections and never answers (once
the breaker is open, requests no longer wait out the socket timeout). /health and /metrics show it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import security_testing as st
from http_testing import ServerProcess
from redis_testing import REDIS_SERVER, HangingServer, RedisProcess

from bitserve.server.security.redis_limiter import SOCKET_TIMEOUT_S

THRESHOLD = 2  # --breaker-failure-threshold
# well under the socket timeout, well over a /v1/models answer on a loaded 2-core machine (~10 ms)
FAST_S = SOCKET_TIMEOUT_S / 2
LIMITED = st.bearer("limited")  # requests_per_minute = 3


def serve(tmp_path: Path, redis_url: str, cooldown_s: float) -> ServerProcess:
    """`bitserve serve` limited through `redis_url`, failing open, with a breaker of THRESHOLD failures."""
    server = ServerProcess(
        tmp_path / "server.log",
        *("--auth-file", str(st.write_auth_file(tmp_path / "auth.toml"))),
        *("--rate-limit-url", redis_url, "--rate-limit-on-error", "open"),
        *("--breaker-failure-threshold", str(THRESHOLD), "--breaker-cooldown-s", str(cooldown_s)),
    )
    try:
        server.wait_ready()
    except BaseException:
        server.stop()
        raise
    return server


def timed_get(client: httpx.Client, path: str = "/v1/models") -> tuple[httpx.Response, float]:
    started = time.perf_counter()
    response = client.get(path, headers=LIMITED)
    return response, time.perf_counter() - started


def redis_breaker(client: httpx.Client) -> dict[str, object]:
    body = client.get("/health", headers=st.bearer("ops")).json()
    return body["components"]["breakers"]["redis"]  # type: ignore[no-any-return]


@pytest.fixture
def stopped_redis_server(tmp_path: Path, smollm2_path: Path) -> Iterator[tuple[ServerProcess, RedisProcess]]:
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not installed")
    redis = RedisProcess(tmp_path)
    try:
        server = serve(tmp_path, redis.url, cooldown_s=1.0)
    except BaseException:
        redis.stop()
        raise
    yield server, redis
    server.stop()
    redis.stop()


def test_a_stopped_redis_opens_the_breaker_and_its_return_closes_it(
    stopped_redis_server: tuple[ServerProcess, RedisProcess], tmp_path: Path
) -> None:
    server, redis = stopped_redis_server
    with httpx.Client(base_url=server.url, timeout=10.0) as client:
        response, _ = timed_get(client)
        assert response.headers["x-ratelimit-remaining-requests"] == "2"
        assert redis_breaker(client)["state"] == "closed"
        redis.stop()
        for _ in range(THRESHOLD):  # these reach the stopped Redis (refused) and are served unlimited
            response, _ = timed_get(client)
            assert response.status_code == 200 and "x-ratelimit-limit-requests" not in response.headers
        assert redis_breaker(client)["state"] == "open"
        latencies = []
        for _ in range(6):
            response, seconds = timed_get(client)
            assert response.status_code == 200 and "x-ratelimit-limit-requests" not in response.headers
            latencies.append(seconds)
        assert max(latencies) < FAST_S, latencies
        redis = RedisProcess(tmp_path, port=redis.port)  # back where the server expects it, empty
        try:
            time.sleep(1.2)  # past the cool-down: the next call is the half-open probe
            remaining = [timed_get(client)[0].headers.get("x-ratelimit-remaining-requests") for _ in range(3)]
            assert remaining == ["2", "1", "0"]  # the probe closed the breaker; limits apply again
            assert timed_get(client)[0].status_code == 429
            breaker = redis_breaker(client)
            assert breaker == {"state": "closed", "failures": 0, "opened_seconds_ago": None}
            metrics = client.get("/metrics", headers=st.bearer("ops")).text
        finally:
            redis.stop()
    assert 'bitserve_breaker_state{breaker="redis",state="closed"} 1.0' in metrics
    for state in ("open", "half_open", "closed"):
        line = f'bitserve_breaker_transitions_total{{breaker="redis",state="{state}"}}'
        assert any(text.startswith(line) and float(text.split()[-1]) >= 1 for text in metrics.splitlines())


@pytest.fixture
def hanging_redis_server(tmp_path: Path, smollm2_path: Path) -> Iterator[tuple[ServerProcess, HangingServer]]:
    hanging = HangingServer()
    try:
        server = serve(tmp_path, hanging.url, cooldown_s=60.0)  # no probe during the test
    except BaseException:
        hanging.stop()
        raise
    yield server, hanging
    server.stop()
    hanging.stop()


def test_a_hanging_redis_costs_its_timeout_only_until_the_breaker_opens(
    hanging_redis_server: tuple[ServerProcess, HangingServer],
) -> None:
    server, hanging = hanging_redis_server
    with httpx.Client(base_url=server.url, timeout=30.0) as client:
        slow = [timed_get(client) for _ in range(THRESHOLD)]
        # each waited out the socket timeout before failing open
        assert all(r.status_code == 200 and s >= SOCKET_TIMEOUT_S for r, s in slow), slow
        assert hanging.num_accepted >= 1
        fast = [timed_get(client) for _ in range(6)]
        assert all(r.status_code == 200 and "x-ratelimit-limit-requests" not in r.headers for r, _ in fast)
        latencies = [seconds for _, seconds in fast]
        assert max(latencies) < FAST_S, latencies
        breaker = redis_breaker(client)
        metrics = client.get("/metrics", headers=st.bearer("ops")).text
    assert breaker["state"] == "open" and breaker["failures"] == THRESHOLD
    assert 0 <= float(breaker["opened_seconds_ago"]) < 60  # type: ignore[arg-type]
    assert 'bitserve_breaker_state{breaker="redis",state="open"} 1.0' in metrics
    assert 'bitserve_breaker_transitions_total{breaker="redis",state="open"} 1.0' in metrics
    rejected = 'bitserve_breaker_rejected_total{breaker="redis"}'
    assert float(next(line for line in metrics.splitlines() if line.startswith(rejected)).split()[-1]) >= 6
    # every request still took the fail-open path and was counted as a limiter error
    assert 'bitserve_rate_limiter_errors_total{on_error="open"} 8.0' in metrics
