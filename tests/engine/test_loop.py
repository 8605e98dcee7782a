"""EngineLoop's memory and batching policies, on scripted engines (no model):
- a CPU replica gives a prefill's freed activations back to the OS (glibc keeps them in the engine thread's
  arena otherwise: ~90 MB resident after an 8-prompt 2B-4T prefill), and only after steps with a prefill;
- an idle engine gathers a burst of arriving requests into its first step (SchedulerConfig.burst_gap_s):
  stepping on the first arrival made that step wait for the GIL behind the event loop's parsing of the
  rest, and prefilled them a step later. Only an idle engine waits.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

from bitserve.core.scheduling_config import SchedulerConfig
from bitserve.core.step_outputs import StepStats
from bitserve.engine import loop as loop_module
from bitserve.engine.loop import TRIM_AFTER_PREFILL_TOKENS, EngineLoop
from bitserve.engine.messages import AddRequest, Shutdown, StepResult


def _result(num_prefill_tokens: int = 0) -> StepResult:
    stats = StepStats(
        num_running=1,
        num_waiting=0,
        num_preempted_total=0,
        kv_usage=0.0,
        num_batched_tokens=num_prefill_tokens + 1,
        num_prefill_tokens=num_prefill_tokens,
        num_decode_tokens=1,
        num_prefix_hit_tokens=0,
        num_prefix_query_tokens=0,
    )
    return StepResult(outputs=[], stats=stats)


def _runner(device: str) -> SimpleNamespace:
    return SimpleNamespace(device=torch.device(device))


def _loop(engine: object, publish: Callable[[StepResult], None] = lambda result: None) -> EngineLoop:
    return EngineLoop(
        engine,  # type: ignore[arg-type]
        publish=publish,
        reject=lambda request_id, error: None,
        die=lambda error: pytest.fail(f"engine died: {error!r}"),
    )


# ----------------------------------------------------------------------------- heap trim after prefill
@dataclass
class ScriptedEngine:
    """Steps through `prefill_tokens`, one step each; after the last, `on_done` (stops the loop)."""

    prefill_tokens: list[int]
    runner: SimpleNamespace = field(default_factory=lambda: _runner("cpu"))
    on_done: Callable[[], None] = lambda: None

    def has_unfinished_requests(self) -> bool:
        return bool(self.prefill_tokens)

    def step(self) -> StepResult:
        result = _result(self.prefill_tokens.pop(0))
        if not self.prefill_tokens:
            self.on_done()
        return result


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_heap_is_trimmed_after_cpu_prefill_steps(monkeypatch: pytest.MonkeyPatch, device: str) -> None:
    """A CUDA replica's activations are on the device: nothing to trim in the host heap."""
    steps = [TRIM_AFTER_PREFILL_TOKENS, 0, 0, TRIM_AFTER_PREFILL_TOKENS - 1, 4 * TRIM_AFTER_PREFILL_TOKENS, 0]
    engine = ScriptedEngine(list(steps), runner=_runner(device))
    published: list[int] = []
    trimmed_after: list[int] = []
    monkeypatch.setattr(loop_module, "release_freed_heap", lambda: trimmed_after.append(published[-1]))
    engine_loop = _loop(engine, publish=lambda result: published.append(result.stats.num_prefill_tokens))
    engine.on_done = lambda: engine_loop.inbox.put(Shutdown())
    engine_loop.run()
    assert published == steps
    expected = [TRIM_AFTER_PREFILL_TOKENS, 4 * TRIM_AFTER_PREFILL_TOKENS] if device == "cpu" else []
    assert trimmed_after == expected


# ----------------------------------------------------------------------------- burst gathering
@dataclass
class CountingEngine:
    """Each added request needs one step; records how many requests each step saw."""

    config: SchedulerConfig
    pending: int = 0
    steps: list[int] = field(default_factory=list)
    runner: SimpleNamespace = field(default_factory=lambda: _runner("cuda"))

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
        return _result()


def _run_burst(config: SchedulerConfig, num_requests: int, spacing_s: float) -> list[int]:
    """Requests put one every spacing_s into an idle loop; the requests each step saw."""
    engine = CountingEngine(config)
    engine_loop = _loop(engine)
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
