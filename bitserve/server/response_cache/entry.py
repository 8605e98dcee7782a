"""CachedCompletion: the final answer of one generation request, independent of how it was sent
(a streamed answer serves a later whole-body request and the reverse), and its byte form."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from bitserve.engine.messages import TokenLogprobs
from bitserve.outputs import CompletionOutput, RequestOutput

FORMAT_VERSION = 1
# Finish reasons of a complete answer; "abort" (client left) and "deadline" are never stored.
COMPLETE_FINISH_REASONS = frozenset({"stop", "length"})


@dataclass(frozen=True, slots=True)
class CachedCompletion:
    prompt_token_ids: list[list[int]]  # each prompt's (one, unless a batched completions request)
    outputs: list[CompletionOutput]  # every choice, whole, sorted by index

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(ids) for ids in self.prompt_token_ids)

    @classmethod
    def of(cls, prompt_token_ids: list[list[int]], result: RequestOutput) -> CachedCompletion | None:
        """The answer to keep, or None when it is not a complete one (a choice aborted or missing)."""
        if not result.finished or not result.outputs:
            return None
        if any(output.finish_reason not in COMPLETE_FINISH_REASONS for output in result.outputs):
            return None
        return cls([list(ids) for ids in prompt_token_ids], [_copy(output) for output in result.outputs])

    def request_output(self, request_id: str) -> RequestOutput:
        """A finished RequestOutput holding every choice whole; the prompt counts as cached."""
        flat_prompt = [token for ids in self.prompt_token_ids for token in ids]
        return RequestOutput(
            request_id,
            flat_prompt,
            [_copy(output) for output in self.outputs],
            True,
            num_cached_tokens=len(flat_prompt),
        )

    def to_bytes(self) -> bytes:
        payload = {
            "format": FORMAT_VERSION,
            "prompt_token_ids": self.prompt_token_ids,
            "outputs": [_output_json(output) for output in self.outputs],
        }
        return json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode("utf-8")

    @classmethod
    def from_bytes(cls, data: bytes) -> CachedCompletion:
        """Raises ValueError (or KeyError / TypeError, from a damaged payload) when `data` is not one."""
        payload = json.loads(data.decode("utf-8"))
        if payload.get("format") != FORMAT_VERSION:
            raise ValueError(f"unknown cache entry format {payload.get('format')!r}")
        return cls(
            [[int(token) for token in ids] for ids in payload["prompt_token_ids"]],
            [_output_of(item) for item in payload["outputs"]],
        )


def _copy(output: CompletionOutput) -> CompletionOutput:
    logprobs = list(output.logprobs) if output.logprobs is not None else None
    return CompletionOutput(
        output.index, output.text, list(output.token_ids), output.finish_reason, output.stop_reason, logprobs
    )


def _output_json(output: CompletionOutput) -> dict[str, Any]:
    return dataclasses.asdict(output)  # TokenLogprobs entries become dicts, their pairs lists


def _output_of(item: dict[str, Any]) -> CompletionOutput:
    if item["finish_reason"] not in COMPLETE_FINISH_REASONS:
        raise ValueError(f"a cache entry with finish reason {item['finish_reason']!r}")
    logprobs = item.pop("logprobs")
    if logprobs is not None:
        logprobs = [
            TokenLogprobs(
                **{**entry, "top_logprobs": tuple((int(t), float(lp)) for t, lp in entry["top_logprobs"])}
            )
            for entry in logprobs
        ]
    return CompletionOutput(**item, logprobs=logprobs)
