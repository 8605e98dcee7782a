"""OutputProcessor: the one loop over engine step outputs.

Token ids -> text deltas (UTF-8 safe), stop strings with hold-back (a match truncates the text,
finishes the choice and asks for an engine abort), logprobs passed through. Used by the offline LLM
and the async frontend alike; holds per-request state keyed by the engine request id.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bitserve.engine.messages import EngineOutput, EngineRequest, Priority
from bitserve.frontend.stop_strings import StopStringMatcher
from bitserve.outputs import CompletionOutput
from bitserve.sampling_params import SamplingParams, child_params
from bitserve.tokenizer.base import Tokenizer
from bitserve.tokenizer.detokenizer import IncrementalDetokenizer


@dataclass(slots=True)
class ChoiceDelta:
    """What one engine request (one choice of a client request) produced in one step."""

    parent_id: str
    output: CompletionOutput  # the new text, token ids and logprobs; the finish if it finished
    num_cached_tokens: int


@dataclass(slots=True)
class _ChoiceState:
    parent_id: str
    index: int
    detokenizer: IncrementalDetokenizer
    matcher: StopStringMatcher
    wants_logprobs: bool
    text: str = ""  # all decoded text so far (before truncation at a stop string)
    num_emitted_chars: int = 0
    finished: bool = False


def choice_request_id(parent_id: str, index: int) -> str:
    """The engine request id of choice `index` of client request `parent_id`."""
    return f"{parent_id}/{index}"


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _ChoiceState] = {}

    def add_request(self, request_id: str, parent_id: str, index: int, params: SamplingParams) -> None:
        self._states[request_id] = _ChoiceState(
            parent_id=parent_id,
            index=index,
            detokenizer=IncrementalDetokenizer(self.tokenizer, skip_special=params.skip_special_tokens),
            matcher=StopStringMatcher(params.stop),
            wants_logprobs=params.logprobs is not None,
        )

    def add_choices(
        self,
        parent_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        priority: Priority = Priority.NORMAL,
        deadline: float | None = None,
    ) -> list[EngineRequest]:
        """The n-choice fan-out: one engine request per choice, ids `{parent_id}/{index}`, each with its
        own seed (child_params) and tracked here; the caller hands the requests to its engine."""
        requests = []
        for index in range(params.n):
            choice_id, choice = choice_request_id(parent_id, index), child_params(params, index)
            self.add_request(choice_id, parent_id, index, choice)
            requests.append(
                EngineRequest(
                    choice_id,
                    tuple(prompt_token_ids),
                    choice,
                    self.tokenizer.eos_token_ids,
                    priority,
                    deadline=deadline,
                )
            )
        return requests

    def drop_request(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    @property
    def num_requests(self) -> int:
        return len(self._states)

    def process(self, outputs: Sequence[EngineOutput]) -> tuple[list[ChoiceDelta], list[str]]:
        """Deltas for every known request in `outputs`, and engine request ids to abort (stop string hit)."""
        deltas: list[ChoiceDelta] = []
        abort_ids: list[str] = []
        for output in outputs:
            state = self._states.get(output.request_id)
            if state is None or state.finished:
                continue
            delta = self._advance(state, output)
            if delta.output.finish_reason is not None:
                state.finished = True
                del self._states[output.request_id]
                if output.finish_reason is None:
                    abort_ids.append(output.request_id)
            deltas.append(delta)
        return deltas, abort_ids

    def _advance(self, state: _ChoiceState, output: EngineOutput) -> ChoiceDelta:
        token_ids, match = self._add_text(state, output.new_token_ids)
        finish_reason = output.finish_reason.value if output.finish_reason is not None else None
        stop_reason: str | int | None = output.stop_token_id
        if match is not None:
            state.text = state.text[: match[0]]
            finish_reason, stop_reason = "stop", match[1]
            end = len(state.text)
        elif finish_reason is not None:
            state.text += state.detokenizer.finish()
            end = len(state.text)
        else:
            end = state.matcher.safe_length(state.text)
        text_delta = state.text[state.num_emitted_chars : end]
        state.num_emitted_chars = max(state.num_emitted_chars, end)
        logprobs = None
        if state.wants_logprobs and output.new_logprobs:
            logprobs = list(output.new_logprobs[: len(token_ids)])
        completion = CompletionOutput(
            state.index, text_delta, token_ids, finish_reason, stop_reason, logprobs
        )
        return ChoiceDelta(state.parent_id, completion, output.num_cached_tokens)

    @staticmethod
    def _add_text(state: _ChoiceState, new_token_ids: list[int]) -> tuple[list[int], tuple[int, str] | None]:
        """Detokenize the step's tokens into state.text; returns the tokens the choice keeps (those up to
        a stop string's token) and the stop string match, if any.

        NOTE: a speculative step brings several tokens: with stop strings they are added one at a time, so
        the tokens after the one that completes a stop string are dropped, as plain decoding never makes them.
        """
        num_checked = len(state.text)
        if not state.matcher.stop or len(new_token_ids) < 2:
            state.text += state.detokenizer.add_tokens(new_token_ids)
            return list(new_token_ids), state.matcher.find(state.text, num_checked)
        for count, token_id in enumerate(new_token_ids, 1):
            state.text += state.detokenizer.add_tokens([token_id])
            match = state.matcher.find(state.text, num_checked)
            if match is not None:
                return list(new_token_ids[:count]), match
        return list(new_token_ids), None
