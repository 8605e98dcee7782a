"""SchedulerOutput / ScheduledRequest (core → runner) and RunnerOutput (runner → core).

Counts, positions, token ids and block ids only: no tensors, so core stays torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bitserve.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request's share of a step.

    The runner computes KV for `token_ids` at positions start_position .. start_position +
    len(token_ids) - 1, writing slots in `block_ids` (the request's whole table; slot of position
    p = block_ids[p // block_size] * block_size + p % block_size). When `sample` is True it samples
    one token from the logits of the last position.

    A speculative decode (`draft_token_ids` not empty, k drafts) has token_ids = [last token, *drafts]
    and is sampled at all 1 + k positions: the runner returns t_0 .. t_a, the tokens up to and including
    the first that differs from its draft (t_i == draft i + 1 for i < a), 1 to k + 1 tokens. The KV the
    step wrote for rejected drafts is garbage past the request's progress; the next step overwrites it.
    """

    request_id: str
    # A prompt chunk, a recompute chunk after preemption, or the last sampled token (decode).
    token_ids: list[int]
    start_position: int
    block_ids: list[int]
    # False for a non-final prefill chunk: no logits are needed.
    sample: bool
    params: SamplingParams
    # == start_position: tokens of this request whose KV was already in the cache.
    num_computed_tokens_before: int
    # The request's prompt (the request's own tuple: shared, never copied).
    prompt_token_ids: tuple[int, ...]
    # Outputs so far, a snapshot taken only when `sample` (penalties, min_tokens): () otherwise.
    # NOTE: copying costs O(num_output_tokens) per sampled request per step; cheap beside a forward.
    output_token_ids: tuple[int, ...] = ()
    # The model's EOS ids for this request (shared frozenset), for min_tokens masking.
    eos_token_ids: frozenset[int] = frozenset()
    # Speculative drafts to verify (token_ids[1:]); () for every other kind of step.
    draft_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """The plan of one step, from `Scheduler.schedule()`.

    `finished_request_ids` (finished or aborted since the previous schedule) and
    `preempted_request_ids` (blocks taken back in this schedule) name requests whose runner-side
    state must be dropped; a preempted request comes back later as a recompute from position 0.
    """

    requests: list[ScheduledRequest]
    num_scheduled_tokens: int
    finished_request_ids: list[str] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.requests


@dataclass(slots=True)
class RunnerOutput:
    """What the runner sampled in one step, for `Scheduler.update()`.

    `sampled_token_ids[request_id]` holds the token(s) sampled for each scheduled request with
    `sample=True`: one, or for a speculative decode 1 .. 1 + len(draft_token_ids) (ScheduledRequest);
    a request without sampling may be absent or map to []. `logprobs`, when requested, maps a request
    id to one entry per sampled token.
    """

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[Any]] | None = None
