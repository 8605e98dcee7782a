"""DeviceRouter's choice, on fake replicas: the lowest predicted completion time (queue depth in batch
rounds × measured step time), the device hint, and what it skips (dead, draining, wedged, saturated)."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from bitserve.errors import EngineDead, InvalidRequest, ModelUnavailable, QueueFull
from bitserve.frontend.device_router import (
    UNMEASURED_STEP_TIME_S,
    DeviceRouter,
    Replica,
    predicted_completion_s,
)
from bitserve.sampling_params import SamplingParams

MAX_NUM_SEQS = 4


@dataclass
class FakeEngine:
    """The AsyncEngine surface the router reads; `submit` records the request (or refuses it as
    admission would)."""

    mean_step_time_s: float | None = 0.01
    num_active_requests: int = 0
    is_alive: bool = True
    is_draining: bool = False
    seconds_since_progress: float = 0.0
    max_num_waiting: int = 100
    wait_s: float = 1.0
    submitted: list[str] = field(default_factory=list)

    def has_room(self, num_prompt_tokens: int, priority: Any = None) -> bool:
        return self.num_active_requests < self.max_num_waiting

    def expected_wait_s(self) -> float:
        return self.wait_s

    def submit(self, prompt_token_ids: list[int], params: SamplingParams, **options: Any) -> Any:
        if not self.is_alive:
            raise EngineDead("dead")
        if not self.has_room(len(prompt_token_ids)):
            raise QueueFull("full", retry_after_s=self.wait_s)
        self.submitted.append(options["request_id"])
        self.num_active_requests += 1
        return SimpleNamespace(request_id=options["request_id"])


def replica(device: str, **engine: Any) -> Replica:
    instance = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=MAX_NUM_SEQS))
    return Replica(device, instance, FakeEngine(**engine))  # type: ignore[arg-type]


def route(router: DeviceRouter, hint: str | None = None, request_id: str = "r") -> str:
    stream = router.submit([1, 2, 3], SamplingParams(max_tokens=4), request_id=request_id, device=hint)
    return stream.device


def test_the_lowest_predicted_completion_time_wins() -> None:
    slow, fast = replica("cpu", mean_step_time_s=0.050), replica("cuda:0", mean_step_time_s=0.005)
    router = DeviceRouter([slow, fast])
    assert route(router) == "cuda:0"
    # queue depth counts in batch rounds: 4 active requests on the fast replica (one full batch) make
    # it 2 x 5 ms = 10 ms, still ahead of 50 ms; at 40 active (11 rounds, 55 ms) the slow one wins
    fast.engine.num_active_requests = 40  # type: ignore[attr-defined]
    assert predicted_completion_s(fast, 0.0) == pytest.approx(0.055)
    assert [r.device for r in router.rank(router.replicas)] == ["cpu", "cuda:0"]
    assert route(router) == "cpu"
    # the slow replica's own queue now counts: 1.25 rounds x 50 ms = 62.5 ms, so the fast one is next
    assert route(router) == "cuda:0"


def test_unmeasured_replicas_borrow_the_fastest_measured_step_time_and_ties_keep_the_listed_order() -> None:
    new, measured = replica("cuda:1", mean_step_time_s=None), replica("cuda:0", mean_step_time_s=0.02)
    router = DeviceRouter([measured, new])
    assert route(router) == "cuda:0"  # equal estimates: the first listed
    measured.engine.num_active_requests = 1  # type: ignore[attr-defined]
    assert route(router) == "cuda:1"
    nothing_measured = DeviceRouter([replica("cpu", mean_step_time_s=None)])
    assert predicted_completion_s(nothing_measured.replicas[0], UNMEASURED_STEP_TIME_S) > 0


def test_a_device_hint_is_honoured_and_a_missing_device_is_a_400_naming_the_devices() -> None:
    router = DeviceRouter(
        [replica("cuda:0", mean_step_time_s=0.001), replica("cuda:1"), replica("cpu", mean_step_time_s=1.0)]
    )
    assert route(router, "cpu") == "cpu"  # pinned, although it is the slowest
    assert route(router, "CUDA:1") == "cuda:1"
    assert route(router, "cuda") == "cuda:0"  # any GPU replica; the fastest
    assert route(router, "cuda:01") == "cuda:1"  # spelled as the device vocabulary allows
    assert route(router, "auto") == "cuda:0"  # the router's choice, as without a hint
    for hint in ("cuda:7", "gpu"):
        with pytest.raises(InvalidRequest) as caught:
            route(router, hint)
        assert caught.value.param == "device" and repr(hint) in caught.value.message
        assert "this model runs on: cuda:0, cuda:1, cpu" in str(caught.value.hint)


def test_dead_draining_wedged_and_saturated_replicas_are_skipped() -> None:
    best = replica("cuda:0", mean_step_time_s=0.001)
    router = DeviceRouter([best, replica("cpu", mean_step_time_s=0.1)], max_stall_s=10.0)
    for trouble in ({"is_alive": False}, {"is_draining": True}, {"seconds_since_progress": 11.0}):
        best.engine = FakeEngine(mean_step_time_s=0.001, **trouble)  # type: ignore[arg-type]
        assert route(router) == "cpu", trouble
    best.engine = FakeEngine(mean_step_time_s=0.001, num_active_requests=2, max_num_waiting=2)
    assert route(router) == "cpu"  # saturated: admission would refuse it
    assert best.engine.submitted == []  # type: ignore[attr-defined]


def test_when_no_replica_takes_the_request_the_error_says_why() -> None:
    first = replica("cuda:0", num_active_requests=1, max_num_waiting=1, wait_s=9.0)
    second = replica("cpu", num_active_requests=1, max_num_waiting=1, wait_s=2.0)
    router = DeviceRouter([first, second])
    with pytest.raises(QueueFull) as caught:  # the one that frees up first refuses it
        route(router)
    assert caught.value.retry_after_s == 2.0
    for engine in (first.engine, second.engine):
        engine.is_draining = True  # type: ignore[attr-defined]
    with pytest.raises(ModelUnavailable, match="draining"):
        route(router)
    for engine in (first.engine, second.engine):
        engine.is_alive = False  # type: ignore[attr-defined]
    with pytest.raises(EngineDead, match="failed on cuda:0, cpu"):
        route(router)
