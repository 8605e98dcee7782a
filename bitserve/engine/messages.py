"""The engine seam: what the frontend sends to an engine (inbox commands) and what comes back.

Frozen, slotted, picklable dataclasses; no tensors, no asyncio objects, no text.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from bitserve.core.request import FinishReason, Priority, Request, RequestStatus
from bitserve.core.step_outputs import EngineOutput, KVCacheStats, StepStats, TokenLogprobs

if TYPE_CHECKING:
    from bitserve.sampling_params import SamplingParams

__all__ = [
    "AbortRequests",
    "AddRequest",
    "Embed",
    "EngineOutput",
    "EngineRequest",
    "FinishReason",
    "KVCacheStats",
    "Priority",
    "RequestStatus",
    "Shutdown",
    "StepResult",
    "StepStats",
    "TokenLogprobs",
]


@dataclass(frozen=True, slots=True)
class Embed:
    """Inbox command: embed each of `inputs` (token ids) with `pooling`, truncated to `dimensions`.
    The engine answers once, between steps, through its `embedded(request_id, vectors | error)`."""

    request_id: str
    inputs: tuple[tuple[int, ...], ...]
    pooling: str
    dimensions: int | None = None


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """A tokenised request for the engine.

    `arrival_time` and `deadline` are `time.monotonic()` seconds, the scheduler's clock; a request
    still unfinished at `deadline` ends with FinishReason.DEADLINE.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    priority: Priority = Priority.NORMAL
    arrival_time: float = field(default_factory=time.monotonic)
    deadline: float | None = None

    def to_request(self) -> Request:
        """The engine-internal, mutable `Request` for this message."""
        return Request(
            request_id=self.request_id,
            prompt_token_ids=tuple(self.prompt_token_ids),
            params=self.params,
            eos_token_ids=frozenset(self.eos_token_ids),
            priority=Priority(self.priority),
            arrival_time=self.arrival_time,
            deadline=self.deadline,
        )


@dataclass(frozen=True, slots=True)
class StepResult:
    """Everything one engine step reports: per-request outputs and the step's stats."""

    outputs: list[EngineOutput]
    stats: StepStats


@dataclass(frozen=True, slots=True)
class AddRequest:
    """Inbox command: queue a request."""

    request: EngineRequest


@dataclass(frozen=True, slots=True)
class AbortRequests:
    """Inbox command: finish these requests before the next step (unknown ids are ignored).

    `reason` is reported as the finish reason: ABORT for disconnects, STOP when the frontend matched
    a stop string, DEADLINE for an expired deadline.
    """

    request_ids: tuple[str, ...]
    reason: FinishReason = FinishReason.ABORT


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Inbox command: stop the engine loop after the current step."""
