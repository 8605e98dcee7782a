"""Units of the canary (lifecycle/canary.py): the weighted split is exact, sticky keys and a tester's
header decide before it, and the verdict rolls back on errors, latency or a dead engine, waits for
evidence, and promotes after the window."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest

from bitserve.errors import InvalidRequest
from bitserve.lifecycle.canary import (
    NO_HINTS,
    Canary,
    CanaryPolicy,
    RoutingHints,
    VersionSample,
    canary_verdict,
    routing_hints,
)

POLICY = CanaryPolicy(window_s=10.0, min_requests=4, max_error_rate=0.1, max_latency_ratio=1.5)


def fake_slot(
    *, finished: int = 0, failed: int = 0, ttft: tuple[float, int] = (0.0, 0), itl=(0.0, 0), alive=True
) -> Any:
    engine = SimpleNamespace(ttft_sum_s=ttft[0], ttft_count=ttft[1])
    return SimpleNamespace(
        num_finished=finished,
        num_failed=failed,
        engines=[engine],
        itl_totals=itl,
        has_live_replica=alive,
        version="v2",
        describe=lambda: {},
    )


def make_canary(weight: float = 0.1, slot: Any = None) -> Canary:
    return Canary(slot or fake_slot(), weight, POLICY, VersionSample(), VersionSample(), started_at=0.0)


@pytest.mark.parametrize("weight", [0.1, 0.25, 0.5, 0.03])
def test_the_weighted_split_is_exact(weight: float) -> None:
    canary = make_canary(weight)
    routed = [canary.routes_here("chat", NO_HINTS) for _ in range(1000)]
    assert sum(routed) == int(1000 * weight)
    first_hundred = sum(routed[:100])
    assert abs(first_hundred - 100 * weight) <= 1  # spread out, not bunched at the end


def test_sticky_keys_stay_on_one_side_and_split_by_weight() -> None:
    canary = make_canary(0.3)
    keys = [f"user-{i}" for i in range(2000)]
    sides = {key: canary.routes_here("chat", RoutingHints(sticky_key=key)) for key in keys}
    for key in keys[:50]:
        assert canary.routes_here("chat", RoutingHints(sticky_key=key)) is sides[key]
    assert 0.25 < sum(sides.values()) / len(keys) < 0.35
    assert canary.num_routed == 0  # keyed requests leave the counter alone


def test_a_testers_header_forces_the_route() -> None:
    canary = make_canary(0.0001)
    assert canary.routes_here("chat", routing_hints("alice", None, "Always")) is True
    assert make_canary(0.9999).routes_here("chat", routing_hints(None, None, "never")) is False
    assert routing_hints(None, "s-1", None) == RoutingHints("s-1", None)
    assert routing_hints("u", "s-1", None).sticky_key == "u"  # the body's user wins over the header
    with pytest.raises(InvalidRequest):
        routing_hints(None, None, "sometimes")


def test_a_dead_canary_rolls_back_at_once() -> None:
    decision, reason = canary_verdict(make_canary(slot=fake_slot(alive=False)), fake_slot(), now=0.0)
    assert decision == "rollback" and "died" in reason


def test_errors_over_the_stable_rate_roll_back() -> None:
    stable = fake_slot(finished=100, failed=5)
    decision, reason = canary_verdict(make_canary(slot=fake_slot(finished=10, failed=3)), stable, now=1.0)
    assert decision == "rollback" and "3 of 10 canary requests failed" in reason
    # the same errors as the stable version (a bad client, not a bad model) do not
    assert canary_verdict(make_canary(slot=fake_slot(finished=10, failed=1)), stable, now=1.0)[0] == "wait"
    # nor a failure before min_requests
    assert canary_verdict(make_canary(slot=fake_slot(finished=3, failed=3)), stable, now=1.0)[0] == "wait"


@pytest.mark.parametrize("which", ["ttft", "itl"])
def test_latency_over_the_ratio_rolls_back(which: str) -> None:
    stable = fake_slot(finished=50, ttft=(1.0, 50), itl=(1.0, 100))  # 20 ms TTFT, 10 ms ITL
    slow = {"ttft": {"ttft": (0.4, 10)}, "itl": {"itl": (0.2, 10)}}[which]  # 40 ms / 20 ms: 2x
    decision, reason = canary_verdict(make_canary(slot=fake_slot(finished=10, **slow)), stable, now=1.0)
    assert decision == "rollback" and "1.5x" in reason
    ok = {"ttft": {"ttft": (0.25, 10)}, "itl": {"itl": (0.12, 10)}}[which]  # 25 ms / 12 ms: within
    assert canary_verdict(make_canary(slot=fake_slot(finished=10, **ok)), stable, now=1.0)[0] == "wait"
    unjudged = Canary(
        fake_slot(finished=10, **slow),
        0.1,
        replace(POLICY, max_latency_ratio=None),
        VersionSample(),
        VersionSample(),
        started_at=0.0,
    )
    assert canary_verdict(unjudged, stable, now=1.0)[0] == "wait"  # the default: latency not judged


def test_promotion_needs_the_window_and_the_evidence() -> None:
    stable = fake_slot(finished=50)
    assert canary_verdict(make_canary(slot=fake_slot(finished=10)), stable, now=9.0)[0] == "wait"
    decision, reason = canary_verdict(make_canary(slot=fake_slot(finished=2)), stable, now=11.0)
    assert decision == "wait" and "2 of 4" in reason
    assert canary_verdict(make_canary(slot=fake_slot(finished=10)), stable, now=11.0)[0] == "promote"


def test_counts_are_taken_from_the_canarys_start() -> None:
    stable, slot = fake_slot(finished=100, failed=50), fake_slot(finished=20, failed=10)
    canary = Canary(slot, 0.1, POLICY, VersionSample.of(stable), VersionSample.of(slot), started_at=0.0)
    stable_sample, canary_sample = canary.samples(stable)
    assert (stable_sample.finished, canary_sample.failed) == (0, 0)
    assert canary_verdict(canary, stable, now=1.0)[0] == "wait"
