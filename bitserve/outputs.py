"""What callers and the server consume: RequestOutput with per-choice CompletionOutput deltas."""

from __future__ import annotations

from dataclasses import dataclass, field

from bitserve.layers.sampler import TokenLogprobs


@dataclass(slots=True)
class CompletionOutput:
    """One choice. In a stream `text` / `token_ids` / `logprobs` are the new part (deltas); in a
    final, non-streamed result they are the whole output."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "deadline" | None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    logprobs: list[TokenLogprobs] | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    model: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return sum(len(output.token_ids) for output in self.outputs)
