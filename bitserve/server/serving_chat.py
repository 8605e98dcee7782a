"""POST /v1/chat/completions: the shared pipeline, formatted as a `chat.completion` body, or SSE
`chat.completion.chunk`s (role first, content deltas, finish), usage if asked, [DONE]."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from bitserve.engine.messages import TokenLogprobs
from bitserve.outputs import CompletionOutput, RequestOutput
from bitserve.server.chat_tool_calls import StreamedToolCalls, message_with_tool_calls
from bitserve.server.openai_format import OpenAIFormat
from bitserve.server.pipeline import Generation, prepare, respond
from bitserve.server.protocol import ChatCompletionRequest, finite_logprob, token_text
from bitserve.tokenizer.base import Tokenizer


def _token_entry(tokenizer: Tokenizer, token_id: int, logprob: float) -> dict[str, Any]:
    return {
        "token": token_text(tokenizer, token_id),
        "logprob": finite_logprob(logprob),
        "bytes": list(tokenizer.token_bytes(token_id)),
    }


def chat_logprobs(tokenizer: Tokenizer, entries: Sequence[TokenLogprobs]) -> dict[str, Any]:
    """`{"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}` (the chat shape)."""
    content = []
    for entry in entries:
        item = _token_entry(tokenizer, entry.token_id, entry.logprob)
        item["top_logprobs"] = [_token_entry(tokenizer, token_id, lp) for token_id, lp in entry.top_logprobs]
        content.append(item)
    return {"content": content}


def _carries_something(choice: dict[str, Any]) -> bool:
    return bool(choice["delta"] or choice["finish_reason"] or choice["logprobs"])


class ChatFormat(OpenAIFormat):
    object_name, chunk_object_name = "chat.completion", "chat.completion.chunk"

    def __init__(self, generation: Generation) -> None:
        super().__init__(generation)
        self.request: ChatCompletionRequest = generation.body
        tool_request = self.request.tool_request()
        self.tools = tool_request.tools
        self.tool_format = generation.lease.instance.tool_format
        self.reads_tool_calls = tool_request.choice.mode != "none"
        self.forced_tool_calls = tool_request.forced
        self._streams: dict[int, StreamedToolCalls] = {}  # per choice index, while streaming

    def _logprobs(self, output: CompletionOutput) -> dict[str, Any] | None:
        return chat_logprobs(self.tokenizer, output.logprobs or ()) if self.request.logprobs else None

    def prologue(self) -> list[dict[str, Any]]:
        return [
            self.chunk(
                {
                    "index": index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            )
            for index in range(self.request.n)
        ]

    def chunks(self, output: RequestOutput) -> list[dict[str, Any]]:
        # a tool-call reply's text may add nothing to a delta yet (held back, or between calls)
        return [
            chunk
            for chunk in super().chunks(output)
            if any(_carries_something(choice) for choice in chunk["choices"])
        ]

    def choice_delta(self, delta: CompletionOutput) -> dict[str, Any]:
        content, finish_reason = ({"content": delta.text} if delta.text else {}), delta.finish_reason
        if self.reads_tool_calls:
            stream = self._streams.get(delta.index)
            if stream is None:
                stream = self._streams[delta.index] = StreamedToolCalls(
                    self.tools, self.forced_tool_calls, self.tool_format
                )
            content, finish_reason = stream.delta(delta.text, delta.finish_reason)
        return {
            "index": delta.index,
            "delta": content,
            "logprobs": self._logprobs(delta),
            "finish_reason": finish_reason,
            "stop_reason": delta.stop_reason,
        }

    def choice(self, output: CompletionOutput) -> dict[str, Any]:
        message, finish_reason = {"role": "assistant", "content": output.text}, output.finish_reason
        if self.reads_tool_calls:
            message, finish_reason = message_with_tool_calls(
                output.text, output.finish_reason, self.tools, self.tool_format
            )
        return {
            "index": output.index,
            "message": message,
            "logprobs": self._logprobs(output),
            "finish_reason": finish_reason,
            "stop_reason": output.stop_reason,
        }


async def create_chat_completion(request: Request) -> Response:
    generation = await prepare(request, ChatCompletionRequest, "chatcmpl")
    return await respond(request, generation, ChatFormat(generation), stream=generation.body.stream)
