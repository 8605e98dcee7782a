"""Request: the engine-internal, mutable state of one generation, plus its status and finish enums.

A `Request` never leaves the engine thread; the frontend sees only `EngineOutput`s.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bitserve.core.block_hash import BlockHash
    from bitserve.core.ngram_draft import DraftState
    from bitserve.sampling_params import SamplingParams


class Priority(enum.IntEnum):
    """Scheduling class of a request; a lower value is more urgent."""

    HIGH = 0
    NORMAL = 1
    LOW = 2


class FinishReason(str, enum.Enum):
    """Why a request ended. The values are the strings reported to clients and metrics."""

    STOP = "stop"  # EOS, a stop token id, or (frontend) a stop string
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # client disconnect, explicit abort, shutdown
    DEADLINE = "deadline"  # the request's deadline passed before it finished


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request inside the scheduler. Every FINISHED_* value sorts after the live ones."""

    WAITING = 0  # queued, never scheduled
    RUNNING = 1  # holds KV blocks and takes part in steps
    PREEMPTED = 2  # queued again after its blocks were taken back (resumes by recompute)
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_DEADLINE = 6


_STATUS_FOR_REASON: dict[FinishReason, RequestStatus] = {
    FinishReason.STOP: RequestStatus.FINISHED_STOPPED,
    FinishReason.LENGTH: RequestStatus.FINISHED_LENGTH,
    FinishReason.ABORT: RequestStatus.FINISHED_ABORTED,
    FinishReason.DEADLINE: RequestStatus.FINISHED_DEADLINE,
}
_REASON_FOR_STATUS: dict[RequestStatus, FinishReason] = {s: r for r, s in _STATUS_FOR_REASON.items()}


def finished_status(reason: FinishReason) -> RequestStatus:
    """The terminal status that records `reason`."""
    return _STATUS_FOR_REASON[reason]


@dataclass(eq=False, slots=True)
class Request:
    """One generation's scheduling state.

    Invariant: 0 <= num_computed_tokens <= num_tokens. `num_computed_tokens` is the one progress
    counter: the number of leading tokens of `all_token_ids` whose KV is in the cache. Between steps
    a decoding request has num_computed_tokens == num_tokens - 1 (its last sampled token is fed next).
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    priority: Priority = Priority.NORMAL
    arrival_time: float = 0.0
    # Absolute time on the scheduler's clock (time.monotonic by default); None = no deadline.
    deadline: float | None = None

    status: RequestStatus = field(default=RequestStatus.WAITING, init=False)
    num_computed_tokens: int = field(default=0, init=False)
    # Prompt tokens served from the prefix cache when the request was first scheduled.
    num_cached_tokens: int = field(default=0, init=False)
    # Seconds from arrival to the first schedule (None until then); reported once, with the first output.
    queue_s: float | None = field(default=None, init=False)
    queue_reported: bool = field(default=False, init=False)
    num_preemptions: int = field(default=0, init=False)
    # block_hashes[i] is the chained hash of full block i of all_token_ids (filled lazily).
    block_hashes: list[BlockHash] = field(default_factory=list, init=False)
    # Queue order, set by the scheduler on add: smaller sorts first (see request_queue.priority_key).
    priority_key: tuple[float, float, int] = field(default=(0.0, 0.0, 0), init=False)
    # prompt + outputs, kept as one list so prefill chunks and recompute slice it without copies.
    all_token_ids: list[int] = field(init=False)
    # The speculative drafter's state (core/ngram_draft.py), made at the first decode it may draft for.
    draft: DraftState | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.prompt_token_ids = tuple(self.prompt_token_ids)
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """A copy of the generated tokens (append through `append_output_token`)."""
        return self.all_token_ids[len(self.prompt_token_ids) :]

    @property
    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _REASON_FOR_STATUS.get(self.status)

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
