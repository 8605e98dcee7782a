"""The circuit breaker's state machine on a fake clock: opens after N consecutive failures, refuses
while open, lets one probe through after the cool-down, closes on its success and re-opens on its
failure; a lost probe is given up; counts for /health and /metrics."""

from __future__ import annotations

import pytest

from bitserve.config import EngineConfig, ServerConfig
from bitserve.errors import CircuitOpen
from bitserve.server.breakers import CLOSED, HALF_OPEN, OPEN, Breakers, CircuitBreaker
from bitserve.server.errors import error_headers, lookup


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_breaker(clock: FakeClock, threshold: int = 3, cooldown_s: float = 10.0) -> CircuitBreaker:
    return CircuitBreaker("redis", failure_threshold=threshold, cooldown_s=cooldown_s, clock=clock)


def fail(breaker: CircuitBreaker, times: int) -> None:
    for _ in range(times):
        assert breaker.allow()
        breaker.record_failure()


def test_opens_after_consecutive_failures_only() -> None:
    clock = FakeClock()
    breaker = make_breaker(clock)
    fail(breaker, 2)
    breaker.record_success()  # a success in between resets the count
    fail(breaker, 2)
    assert breaker.state == CLOSED and breaker.num_failures == 2
    fail(breaker, 1)
    assert breaker.state == OPEN
    assert not breaker.allow() and not breaker.allow()
    assert breaker.num_rejected == 2
    assert breaker.retry_after_s() == pytest.approx(10.0)
    clock.now += 4
    assert breaker.retry_after_s() == pytest.approx(6.0)
    assert not breaker.allow()


def test_one_probe_after_the_cooldown_then_close_on_success() -> None:
    clock = FakeClock()
    breaker = make_breaker(clock)
    fail(breaker, 3)
    clock.now += 10
    assert breaker.allow()  # the probe
    assert breaker.state == HALF_OPEN
    assert not breaker.allow()  # only one probe at a time
    breaker.record_success()
    assert breaker.state == CLOSED and breaker.num_failures == 0
    assert all(breaker.allow() for _ in range(5))
    assert breaker.stats().transitions == {OPEN: 1, HALF_OPEN: 1, CLOSED: 1}


def test_a_failed_probe_reopens_for_a_whole_cooldown() -> None:
    clock = FakeClock()
    breaker = make_breaker(clock)
    fail(breaker, 3)
    clock.now += 10
    assert breaker.allow()
    breaker.record_failure()
    assert breaker.state == OPEN
    clock.now += 9.9
    assert not breaker.allow()
    clock.now += 0.1
    assert breaker.allow() and breaker.state == HALF_OPEN
    assert breaker.stats().transitions == {OPEN: 2, HALF_OPEN: 2}


def test_a_lost_probe_is_given_up_after_a_cooldown() -> None:
    """A probe whose caller was cancelled never reports: another goes after a further cool-down."""
    clock = FakeClock()
    breaker = make_breaker(clock)
    fail(breaker, 3)
    clock.now += 10
    assert breaker.allow()
    clock.now += 5
    assert not breaker.allow()
    clock.now += 5
    assert breaker.allow()
    breaker.record_success()
    assert breaker.state == CLOSED


def test_check_raises_a_503_with_retry_after() -> None:
    clock = FakeClock()
    breaker = make_breaker(clock, threshold=1, cooldown_s=30.0)
    breaker.check()
    breaker.record_failure()
    clock.now += 3
    with pytest.raises(CircuitOpen) as refused:
        breaker.check()
    assert refused.value.retry_after_s == pytest.approx(27.0)
    spec = lookup(refused.value)
    assert (spec.status, spec.code) == (503, "dependency_unavailable")
    assert error_headers(refused.value, spec, None) == {"Retry-After": "27"}


def test_describe_and_stats_for_health_and_metrics() -> None:
    clock = FakeClock()
    breakers = Breakers(failure_threshold=2, cooldown_s=5.0, clock=clock)
    redis, otlp = breakers.get("redis"), breakers.get("otlp")
    assert breakers.get("redis") is redis
    fail(redis, 2)
    clock.now += 1.25
    assert not redis.allow()
    otlp.record_dropped(7)
    assert breakers.describe() == {
        "otlp": {"state": CLOSED, "failures": 0, "opened_seconds_ago": None},
        "redis": {"state": OPEN, "failures": 2, "opened_seconds_ago": 1.25},
    }
    by_name = {stats.name: stats for stats in breakers.stats()}
    assert by_name["redis"].state == OPEN and by_name["redis"].num_rejected == 1
    assert by_name["redis"].transitions == {OPEN: 1}
    assert by_name["otlp"].num_dropped == 7


@pytest.mark.parametrize(("threshold", "cooldown_s"), [(0, 1.0), (1, 0.0), (1, -1.0)])
def test_bad_settings_are_refused(threshold: int, cooldown_s: float) -> None:
    with pytest.raises(ValueError):
        CircuitBreaker("x", failure_threshold=threshold, cooldown_s=cooldown_s)
    with pytest.raises(ValueError, match="breaker_"):
        ServerConfig(breaker_failure_threshold=threshold, breaker_cooldown_s=cooldown_s)


def test_the_app_builds_its_breakers_from_the_server_config() -> None:
    from bitserve.server.app import build_state

    state = build_state(ServerConfig(breaker_failure_threshold=7, breaker_cooldown_s=2.5), EngineConfig())
    breaker = state.breakers.get("redis")
    assert (breaker.failure_threshold, breaker.cooldown_s) == (7, 2.5)
