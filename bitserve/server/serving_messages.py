"""POST /v1/messages and /v1/messages/count_tokens: the Anthropic Messages API on the shared pipeline.

The request is translated once into a chat request (anthropic_protocol.py) and admitted like any other;
the chat endpoint's own shaping (ChatFormat: tool calls parsed in the model's tool format, whole or
streamed) runs underneath, and this module only re-shapes its choice into Anthropic's: a `message`
with `text` and `tool_use` content blocks, or the stream's named events

    message_start, ping, (content_block_start, content_block_delta*, content_block_stop)*,
    message_delta (stop_reason, output usage), message_stop

framed as `event: <type>\\ndata: <json>`. No `[DONE]`: an Anthropic stream ends with message_stop, or
with an `error` event when it fails after it began.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from bitserve.outputs import RequestOutput
from bitserve.server.anthropic_protocol import MessagesInput, MessagesRequest
from bitserve.server.body import parse_request
from bitserve.server.errors import ANTHROPIC_PATH, error_body
from bitserve.server.pipeline import Caller, Generation, admit, respond
from bitserve.server.prompts import encode_prompt
from bitserve.server.response_format import ResponseFormat
from bitserve.server.serving_chat import ChatFormat
from bitserve.server.state import get_state
from bitserve.server.streaming import AnyStream, Framing, framed_events, sse_frame

# chat finish_reason -> Anthropic stop_reason ("stop" is end_turn or stop_sequence, by its stop_reason)
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use", "deadline": "max_tokens"}
PING_EVENT = {"type": "ping"}


def event_frame(payload: dict[str, Any]) -> bytes:
    """`event: <type>` then the payload's `data:` line (streaming.sse_frame's JSON)."""
    return f"event: {payload['type']}\n".encode() + sse_frame(payload)


ANTHROPIC_FRAMING = Framing(
    event_frame, event_frame(PING_EVENT), lambda exc: event_frame(error_body(exc, path=ANTHROPIC_PATH))
)


class ContentBlocks:
    """Chat deltas -> Anthropic content-block events: a text block while the reply is text, one
    `tool_use` block per call (its arguments as `input_json_delta`s); each opened block is stopped
    before the next one starts and at the end."""

    def __init__(self) -> None:
        self.index = -1  # of the open block
        self.open_kind: str | None = None  # "text" | the open call's chat index ("call:N")

    def _start(self, kind: str, block: dict[str, Any]) -> list[dict[str, Any]]:
        events = self.close()
        self.index += 1
        self.open_kind = kind
        return [*events, {"type": "content_block_start", "index": self.index, "content_block": block}]

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self.index, "delta": delta}

    def feed(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        text = delta.get("content")
        if text:
            if self.open_kind != "text":
                events += self._start("text", {"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": text}))
        for entry in delta.get("tool_calls") or ():
            kind, function = f"call:{entry['index']}", entry.get("function", {})
            if "id" in entry:
                block = {"type": "tool_use", "id": entry["id"], "name": function["name"], "input": {}}
                events += self._start(kind, block)
            arguments = function.get("arguments")
            if arguments and self.open_kind == kind:
                events.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))
        return events

    def close(self) -> list[dict[str, Any]]:
        if self.open_kind is None:
            return []
        self.open_kind = None
        return [{"type": "content_block_stop", "index": self.index}]


def content_blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat `message` (content, tool_calls) -> Anthropic content blocks."""
    blocks: list[dict[str, Any]] = []
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or ():
        function = call["function"]
        blocks.append(
            {
                "type": "tool_use",
                "id": call["id"],
                "name": function["name"],
                "input": json.loads(function["arguments"]),
            }
        )
    return blocks


class MessagesFormat:
    """The ResponseFormat of /v1/messages (one choice: Anthropic has no `n`)."""

    def __init__(self, generation: Generation, request: MessagesRequest) -> None:
        self.chat = ChatFormat(generation)
        self.stop_sequences = set(request.stop_sequences or ())
        self.message_id = generation.stream.request_id
        self.model = generation.model_id
        self.num_input_tokens = sum(len(ids) for ids in generation.prompt_token_ids)
        self.blocks = ContentBlocks()
        self.finish: tuple[str | None, str | None] = ("end_turn", None)  # stop_reason, stop_sequence

    def _stop(self, finish_reason: str | None, stop_reason: Any) -> tuple[str | None, str | None]:
        if finish_reason == "stop" and isinstance(stop_reason, str) and stop_reason in self.stop_sequences:
            return "stop_sequence", stop_reason
        if finish_reason in STOP_REASONS:
            return STOP_REASONS[finish_reason], None
        return ("end_turn" if finish_reason == "stop" else None), None

    def _usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        return {
            "input_tokens": usage["prompt_tokens"],
            "output_tokens": usage["completion_tokens"],
            "cache_read_input_tokens": usage["prompt_tokens_details"]["cached_tokens"],
            "cache_creation_input_tokens": 0,
        }

    def _message(self, content: list[dict[str, Any]], stop: tuple[str | None, str | None]) -> dict[str, Any]:
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop[0],
            "stop_sequence": stop[1],
        }

    def prologue(self) -> list[dict[str, Any]]:
        message = self._message([], (None, None))
        message["usage"] = {"input_tokens": self.num_input_tokens, "output_tokens": 0}
        return [{"type": "message_start", "message": message}, PING_EVENT]

    def chunks(self, output: RequestOutput) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for delta in output.outputs:
            if not (delta.text or delta.finish_reason):
                continue
            choice = self.chat.choice_delta(delta)
            events += self.blocks.feed(choice["delta"])
            if choice["finish_reason"] is not None:
                self.finish = self._stop(choice["finish_reason"], choice["stop_reason"])
        return events

    def epilogue(self, usage: dict[str, Any]) -> list[dict[str, Any]]:
        stop_reason, stop_sequence = self.finish
        return [
            *self.blocks.close(),
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                "usage": self._usage(usage),  # the SDKs' final usage: input and cache counts too
            },
            {"type": "message_stop"},
        ]

    def body(self, result: RequestOutput, usage: dict[str, Any]) -> dict[str, Any]:
        choice = self.chat.choice(result.outputs[0])
        stop = self._stop(choice["finish_reason"], choice["stop_reason"])
        return {**self._message(content_blocks(choice["message"]), stop), "usage": self._usage(usage)}


def event_frames(
    stream: AnyStream, keepalive_s: float, response_format: ResponseFormat
) -> AsyncIterator[bytes]:
    """The stream's event frames; a ping event when idle; an `error` event if it fails after it began."""
    return framed_events(stream, keepalive_s, response_format, ANTHROPIC_FRAMING)


async def create_message(request: Request) -> Response:
    started = time.monotonic()
    body = parse_request(await request.body(), MessagesRequest)
    generation = await admit(
        get_state(request), body.to_chat_request(), "msg", Caller.of_request(request), started
    )
    response_format = MessagesFormat(generation, body)
    return await respond(request, generation, response_format, stream=body.stream, frames=event_frames)


async def count_message_tokens(request: Request) -> Response:
    """`{"input_tokens": N}`: the prompt the same request to /v1/messages would be admitted with
    (chat template, system prompt and tools included)."""
    body = parse_request(await request.body(), MessagesInput)
    chat = body.to_chat_request()
    instance = get_state(request).require_instance(chat.model)
    token_ids = await encode_prompt(instance, chat.prompt_input())
    return JSONResponse({"input_tokens": len(token_ids)})
