"""What callers and the server consume: RequestOutput with per-choice CompletionOutput deltas, and the
one merge of a choice's delta into what came before (used by the async frontend, the HTTP layer's
non-streaming collector and the offline LLM alike)."""

from __future__ import annotations

from dataclasses import dataclass, field

from bitserve.engine.messages import TokenLogprobs


@dataclass(slots=True)
class CompletionOutput:
    """One choice. In a stream `text` / `token_ids` / `logprobs` are the new part (deltas); in a
    final, non-streamed result they are the whole output."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "deadline" | None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    logprobs: list[TokenLogprobs] | None = None

    def extend(self, update: CompletionOutput) -> None:
        """Append `update` (a later part of this choice) to this output."""
        self.text += update.text
        self.token_ids.extend(update.token_ids)
        if update.logprobs:
            self.logprobs = (self.logprobs or []) + list(update.logprobs)
        if update.finish_reason is not None:
            self.finish_reason, self.stop_reason = update.finish_reason, update.stop_reason


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

    def add(self, update: CompletionOutput, num_cached_tokens: int = 0) -> None:
        """Merge one choice's update; outputs stay sorted by choice index."""
        output = next((out for out in self.outputs if out.index == update.index), None)
        if output is None:
            output = CompletionOutput(update.index)
            self.outputs.append(output)
            self.outputs.sort(key=lambda out: out.index)
        output.extend(update)
        self.num_cached_tokens = max(self.num_cached_tokens, num_cached_tokens)

    def merge(self, later: RequestOutput) -> None:
        """Fold a later delta of the same request into this one (a stream collected to its end)."""
        for update in later.outputs:
            self.add(update, later.num_cached_tokens)
        self.finished = later.finished
