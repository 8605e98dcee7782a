"""EngineLoop gives a prefill's freed activations back to the OS (glibc keeps them in the engine thread's
arena otherwise: ~90 MB resident after an 8-prompt 2B-4T prefill), and only after steps with a prefill."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

from bitserve.core.step_outputs import StepStats
from bitserve.engine import loop as loop_module
from bitserve.engine.loop import TRIM_AFTER_PREFILL_TOKENS, EngineLoop
from bitserve.engine.messages import Shutdown, StepResult


def _stats(num_prefill_tokens: int) -> StepStats:
    return StepStats(
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


@dataclass
class ScriptedEngine:
    """Steps through `prefill_tokens`, one step each; after the last, `on_done` (stops the loop)."""

    prefill_tokens: list[int]
    runner: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(device=torch.device("cpu")))
    on_done: Callable[[], None] = lambda: None

    def has_unfinished_requests(self) -> bool:
        return bool(self.prefill_tokens)

    def step(self) -> StepResult:
        result = StepResult(outputs=[], stats=_stats(self.prefill_tokens.pop(0)))
        if not self.prefill_tokens:
            self.on_done()
        return result


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_heap_is_trimmed_after_cpu_prefill_steps(monkeypatch: pytest.MonkeyPatch, device: str) -> None:
    """A CUDA replica's activations are on the device: nothing to trim in the host heap."""
    steps = [TRIM_AFTER_PREFILL_TOKENS, 0, 0, TRIM_AFTER_PREFILL_TOKENS - 1, 4 * TRIM_AFTER_PREFILL_TOKENS, 0]
    engine = ScriptedEngine(list(steps), runner=SimpleNamespace(device=torch.device(device)))
    published: list[int] = []
    trimmed_after: list[int] = []
    monkeypatch.setattr(loop_module, "release_freed_heap", lambda: trimmed_after.append(published[-1]))
    engine_loop = EngineLoop(
        engine,  # type: ignore[arg-type]
        publish=lambda result: published.append(result.stats.num_prefill_tokens),
        reject=lambda request_id, error: None,
        die=lambda error: pytest.fail(f"engine died: {error!r}"),
    )
    engine.on_done = lambda: engine_loop.inbox.put(Shutdown())
    engine_loop.run()
    assert published == steps
    expected = [TRIM_AFTER_PREFILL_TOKENS, 4 * TRIM_AFTER_PREFILL_TOKENS] if device == "cpu" else []
    assert trimmed_after == expected
