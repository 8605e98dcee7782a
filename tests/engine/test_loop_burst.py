"""An idle engine gathers a burst of arriving requests into its first step (SchedulerConfig.burst_gap_s):
stepping on the first arrival made that step wait for the GIL behind the event loop's parsing of the rest,
and prefilled them a step later. Only an idle engine waits."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

from bitserve.core.scheduling_config import SchedulerConfig
from bitserve.core.step_outputs import StepStats
from bitserve.engine.loop import EngineLoop
from bitserve.engine.messages import AddRequest, Shutdown, StepResult

STATS = StepStats(
    num_running=0,
    num_waiting=0,
    num_preempted_total=0,
    kv_usage=0.0,
    num_batched_tokens=1,
    num_prefill_tokens=0,
    num_decode_tokens=1,
    num_prefix_hit_tokens=0,
    num_prefix_query_tokens=0,
)


@dataclass
class CountingEngine:
    """Each added request needs one step; records how many requests each step saw."""

    config: SchedulerConfig
    pending: int = 0
    steps: list[int] = field(default_factory=list)
    runner: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(device=torch.device("cuda")))

    @property
    def scheduler(self) -> SimpleNamespace:
        return SimpleNamespace(config=self.config)

    def add_request(self, request: object) -> None:
        self.pending += 1

    def has_unfinished_requests(self) -> bool:
        return self.pending > 0

    def step(self) -> StepResult:
        self.steps.append(self.pending)
        self.pending = 0
        return StepResult(outputs=[], stats=STATS)


def _run_burst(config: SchedulerConfig, num_requests: int, spacing_s: float) -> list[int]:
    """Requests put one every spacing_s into an idle loop; the requests each step saw."""
    engine = CountingEngine(config)
    engine_loop = EngineLoop(
        engine,  # type: ignore[arg-type]
        publish=lambda result: None,
        reject=lambda request_id, error: None,
        die=lambda error: pytest.fail(f"engine died: {error!r}"),
    )
    thread = threading.Thread(target=engine_loop.run)
    thread.start()
    for _ in range(num_requests):
        engine_loop.inbox.put(AddRequest(object()))  # type: ignore[arg-type]
        time.sleep(spacing_s)
    time.sleep(config.burst_gap_s + 0.5)  # the last gap ends and the loop steps before Shutdown
    engine_loop.inbox.put(Shutdown())
    thread.join(timeout=30)
    assert not thread.is_alive()
    return engine.steps


def test_an_idle_engine_prefills_a_burst_in_one_step() -> None:
    # arrivals 20 ms apart, inside a 0.3 s gap: one step for all five
    config = SchedulerConfig(burst_gap_s=0.3, burst_wait_max_s=30.0)
    assert _run_burst(config, num_requests=5, spacing_s=0.02) == [5]


def test_the_wait_is_capped() -> None:
    # a steady trickle never leaves a gap: the cap starts the step with what has arrived
    config = SchedulerConfig(burst_gap_s=0.3, burst_wait_max_s=0.05)
    steps = _run_burst(config, num_requests=4, spacing_s=0.1)
    assert steps[0] < 4 and sum(steps) == 4


def test_without_a_gap_the_first_arrival_steps_at_once() -> None:
    config = SchedulerConfig(burst_gap_s=0.0)
    assert _run_burst(config, num_requests=3, spacing_s=0.1) == [1, 1, 1]


@pytest.mark.parametrize("value", [-0.1, float("nan"), float("inf")])
def test_burst_settings_are_validated(value: float) -> None:
    with pytest.raises(ValueError, match="burst_gap_s"):
        SchedulerConfig(burst_gap_s=value)
