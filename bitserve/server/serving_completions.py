"""POST /v1/completions: one raw prompt (text or token ids) -> generate -> a `text_completion` body,
or SSE `text_completion` chunks, the usage chunk if asked, and [DONE]."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from bitserve import __version__
from bitserve.layers.sampler import TokenLogprobs
from bitserve.outputs import RequestOutput
from bitserve.server.body import parse_request, with_model_defaults
from bitserve.server.prompts import encode_text, prompt_from_ids, resolve_max_tokens
from bitserve.server.protocol import (
    CompletionRequest,
    finite_logprob,
    new_request_id,
    token_text,
    usage_payload,
)
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

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
SYSTEM_FINGERPRINT = f"bitserve-{__version__}"


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


async def create_completion(request: Request) -> Response:
    state = get_state(request)
    body = parse_request(await request.body(), CompletionRequest)
    lease = state.acquire(body.model)
    with lease.released_on_error():
        body = with_model_defaults(body, lease.slot.source.default_params)
        instance = lease.engine.instance
        prompt = body.single_prompt
        if isinstance(prompt, str):
            prompt_ids = await encode_text(instance, prompt)
            prompt_text = prompt
        else:
            prompt_ids = prompt_from_ids(instance, prompt)
            prompt_text = instance.tokenizer.decode(prompt_ids) if body.echo else ""
        max_tokens = resolve_max_tokens(len(prompt_ids), body.max_tokens, DEFAULT_MAX_TOKENS, instance.max_model_len)
        params = body.to_sampling_params(max_tokens=max_tokens, logprobs=body.logprobs)
        request_id = new_request_id("cmpl")
        stream = GenerationStream(lease, prompt_ids, params, request_id=request_id,
                                  priority=body.priority_class, registry=state.registry)  # fmt: skip
    await stream.start()
    version = lease.info.version
    base = {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": lease.info.id,
        "model_version": version,
    }
    echo = prompt_text if body.echo else ""
    if body.stream:
        return SSEResponse(
            _stream_frames(stream, base, body, echo, instance.tokenizer, state.server_config.sse_keepalive_s),
            headers=version_header(version),
        )
    try:
        result = await until_disconnect(request.receive, collect(stream, body.n))
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED_STATUS)
    choices = []
    for choice in result.choices:
        logprobs = (
            completion_logprobs(instance.tokenizer, choice.logprobs, len(echo))
            if body.logprobs is not None
            else None
        )
        choices.append({"index": choice.index, "text": echo + choice.text, "logprobs": logprobs,
                        "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason})  # fmt: skip
    usage = usage_payload(result.num_prompt_tokens, result.num_output_tokens, result.num_cached_tokens)
    return JSONResponse(
        {**base, "choices": choices, "usage": usage, "system_fingerprint": SYSTEM_FINGERPRINT},
        headers=version_header(version),
    )


def _stream_frames(
    stream: GenerationStream,
    base: dict[str, Any],
    body: CompletionRequest,
    echo: str,
    tokenizer: Tokenizer,
    keepalive_s: float,
) -> AsyncIterator[bytes]:
    wants_logprobs = body.logprobs is not None
    offsets = [len(echo)] * body.n  # text offset of each choice so far, for logprobs
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
            logprobs = None
            if wants_logprobs:
                logprobs = completion_logprobs(tokenizer, delta.logprobs or (), offsets[delta.index])
                offsets[delta.index] += sum(len(text) for text in logprobs["tokens"])
            payloads.append(chunk({"index": delta.index, "text": delta.text, "logprobs": logprobs,
                                   "finish_reason": delta.finish_reason, "stop_reason": delta.stop_reason}))  # fmt: skip
        return payloads

    def epilogue() -> list[dict[str, Any]]:
        if not body.include_usage:
            return []
        usage = usage_payload(stream.num_prompt_tokens, counts["completion"], counts["cached"])
        return [{**base, "choices": [], "system_fingerprint": SYSTEM_FINGERPRINT, "usage": usage}]

    prologue = (
        [
            chunk({"index": index, "text": echo, "logprobs": None, "finish_reason": None})
            for index in range(body.n)
        ]
        if echo
        else []
    )
    return sse_events(stream, keepalive_s, chunks_for, prologue, epilogue)
