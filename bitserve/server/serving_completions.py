"""POST /v1/completions: the shared pipeline on raw prompts (text or token ids; one, or a batch whose
choice j of prompt i is index i * n + j), formatted as a `text_completion` body, or SSE
`text_completion` chunks (a batch's interleaved), the usage chunk if asked, and [DONE]."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from bitserve.engine.messages import TokenLogprobs
from bitserve.outputs import CompletionOutput
from bitserve.server.openai_format import OpenAIFormat
from bitserve.server.pipeline import Generation, prepare, respond
from bitserve.server.protocol import CompletionRequest, finite_logprob, token_text
from bitserve.tokenizer.base import Tokenizer


def completion_logprobs(
    tokenizer: Tokenizer, entries: Sequence[TokenLogprobs], text_offset: int
) -> dict[str, Any]:
    """The legacy completions shape: parallel lists of tokens, logprobs, top alternatives, offsets."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for entry in entries:
        text = token_text(tokenizer, entry.token_id)
        tokens.append(text)
        token_logprobs.append(finite_logprob(entry.logprob))
        top_logprobs.append(
            {token_text(tokenizer, token_id): finite_logprob(lp) for token_id, lp in entry.top_logprobs}
        )
        offsets.append(text_offset)
        text_offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


class CompletionFormat(OpenAIFormat):
    object_name = chunk_object_name = "text_completion"

    def __init__(self, generation: Generation) -> None:
        super().__init__(generation)
        self.request: CompletionRequest = generation.body
        self.n = self.request.n
        # choice k answers prompt k // n (OpenAI's numbering of a batch); echo prepends that prompt
        self.echoes = (
            self._echo_texts(generation) if self.request.echo else [""] * len(generation.prompt_token_ids)
        )
        self.offsets = [len(self.echo(k)) for k in range(len(self.echoes) * self.n)]  # for logprobs

    def _echo_texts(self, generation: Generation) -> list[str]:
        return [
            prompt.text if prompt.text is not None else self.tokenizer.decode(token_ids)
            for prompt, token_ids in zip(
                self.request.prompt_inputs(), generation.prompt_token_ids, strict=True
            )
        ]

    def echo(self, index: int) -> str:
        return self.echoes[index // self.n]

    def _logprobs(self, output: CompletionOutput, text_offset: int) -> dict[str, Any] | None:
        if self.request.logprobs is None:
            return None
        return completion_logprobs(self.tokenizer, output.logprobs or (), text_offset)

    def prologue(self) -> list[dict[str, Any]]:
        if not self.request.echo:
            return []
        return [
            self.chunk({"index": index, "text": self.echo(index), "logprobs": None, "finish_reason": None})
            for index in range(len(self.offsets))
        ]

    def choice_delta(self, delta: CompletionOutput) -> dict[str, Any]:
        logprobs = self._logprobs(delta, self.offsets[delta.index])
        if logprobs is not None:
            self.offsets[delta.index] += sum(len(text) for text in logprobs["tokens"])
        return {
            "index": delta.index,
            "text": delta.text,
            "logprobs": logprobs,
            "finish_reason": delta.finish_reason,
            "stop_reason": delta.stop_reason,
        }

    def choice(self, output: CompletionOutput) -> dict[str, Any]:
        return {
            "index": output.index,
            "text": self.echo(output.index) + output.text,
            "logprobs": self._logprobs(output, len(self.echo(output.index))),
            "finish_reason": output.finish_reason,
            "stop_reason": output.stop_reason,
        }


async def create_completion(request: Request) -> Response:
    generation = await prepare(request, CompletionRequest, "cmpl")
    return await respond(request, generation, CompletionFormat(generation), stream=generation.body.stream)
