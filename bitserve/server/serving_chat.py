"""POST /v1/chat/completions: messages -> chat template -> ids -> generate -> a `chat.completion`
body, or SSE `chat.completion.chunk`s (role first, content deltas, finish), usage, [DONE]."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from bitserve.layers.sampler import TokenLogprobs
from bitserve.outputs import RequestOutput
from bitserve.server.body import parse_request, with_model_defaults
from bitserve.server.prompts import encode_messages, resolve_max_tokens
from bitserve.server.protocol import (
    ChatCompletionRequest,
    finite_logprob,
    new_request_id,
    token_text,
    usage_payload,
)
from bitserve.server.serving_completions import SYSTEM_FINGERPRINT
from bitserve.server.state import get_state
from bitserve.server.streaming import (
    CLIENT_CLOSED_STATUS,
    ClientDisconnected,
    GenerationStream,
    SSEResponse,
    collect,
    sse_events,
    until_disconnect,
    version_header,
)
from bitserve.tokenizer.base import Tokenizer


def _token_entry(tokenizer: Tokenizer, token_id: int, logprob: float) -> dict[str, Any]:
    return {"token": token_text(tokenizer, token_id), "logprob": finite_logprob(logprob),
            "bytes": list(tokenizer.token_bytes(token_id))}  # fmt: skip


def chat_logprobs(tokenizer: Tokenizer, entries: Sequence[TokenLogprobs]) -> dict[str, Any]:
    """`{"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}` (the chat shape)."""
    content = []
    for entry in entries:
        item = _token_entry(tokenizer, entry.token_id, entry.logprob)
        item["top_logprobs"] = [_token_entry(tokenizer, token_id, lp) for token_id, lp in entry.top_logprobs]
        content.append(item)
    return {"content": content}


async def create_chat_completion(request: Request) -> Response:
    state = get_state(request)
    body = parse_request(await request.body(), ChatCompletionRequest)
    lease = state.acquire(body.model)
    with lease.released_on_error():
        body = with_model_defaults(body, lease.slot.source.default_params)
        instance = lease.engine.instance
        prompt_ids = await encode_messages(instance, body.messages)
        max_tokens = resolve_max_tokens(len(prompt_ids), body.requested_max_tokens, None, instance.max_model_len,
                                        prompt_param="messages")  # fmt: skip
        params = body.to_sampling_params(max_tokens=max_tokens, logprobs=body.num_logprobs)
        request_id = new_request_id("chatcmpl")
        stream = GenerationStream(lease, prompt_ids, params, request_id=request_id,
                                  priority=body.priority_class, registry=state.registry)  # fmt: skip
    await stream.start()
    model_id, version = lease.info.id, lease.info.version
    if body.stream:
        base = {
            "id": request_id,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": model_id,
            "model_version": version,
        }
        return SSEResponse(
            _stream_frames(stream, base, body, instance.tokenizer, state.server_config.sse_keepalive_s),
            headers=version_header(version),
        )
    try:
        result = await until_disconnect(request.receive, collect(stream, body.n))
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED_STATUS)
    choices = []
    for choice in result.choices:
        logprobs = chat_logprobs(instance.tokenizer, choice.logprobs) if body.logprobs else None
        choices.append({"index": choice.index, "message": {"role": "assistant", "content": choice.text},
                        "logprobs": logprobs, "finish_reason": choice.finish_reason,
                        "stop_reason": choice.stop_reason})  # fmt: skip
    return JSONResponse({
        "id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model_id,
        "model_version": version, "choices": choices, "system_fingerprint": SYSTEM_FINGERPRINT,
        "usage": usage_payload(result.num_prompt_tokens, result.num_output_tokens, result.num_cached_tokens),
    }, headers=version_header(version))  # fmt: skip


def _stream_frames(stream: GenerationStream, base: dict[str, Any], body: ChatCompletionRequest,
                   tokenizer: Tokenizer, keepalive_s: float) -> AsyncIterator[bytes]:  # fmt: skip
    counts = {"completion": 0, "cached": 0}
    extra = {"usage": None} if body.include_usage else {}

    def chunk(choice: dict[str, Any]) -> dict[str, Any]:
        return {**base, "choices": [choice], "system_fingerprint": SYSTEM_FINGERPRINT, **extra}

    def chunks_for(output: RequestOutput) -> list[dict[str, Any]]:
        counts["cached"] = max(counts["cached"], output.num_cached_tokens)
        payloads = []
        for delta in output.outputs:
            counts["completion"] += len(delta.token_ids)
            if not (delta.text or delta.finish_reason or delta.logprobs):
                continue  # text held back (partial UTF-8 or a possible stop string)
            logprobs = chat_logprobs(tokenizer, delta.logprobs or ()) if body.logprobs else None
            payloads.append(chunk({"index": delta.index, "delta": {"content": delta.text} if delta.text else {},
                                   "logprobs": logprobs, "finish_reason": delta.finish_reason,
                                   "stop_reason": delta.stop_reason}))  # fmt: skip
        return payloads

    def epilogue() -> list[dict[str, Any]]:
        if not body.include_usage:
            return []
        usage = usage_payload(stream.num_prompt_tokens, counts["completion"], counts["cached"])
        return [{**base, "choices": [], "system_fingerprint": SYSTEM_FINGERPRINT, "usage": usage}]

    prologue = [chunk({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None})
                for index in range(body.n)]  # fmt: skip
    return sse_events(stream, keepalive_s, chunks_for, prologue, epilogue)
