"""bitserve's native API: /v1/inference, /v1/inference/stream, /v1/stats, /tokenize, /detokenize.

POST /v1/inference takes exactly one of `prompt` (a string, or a list of token ids) or `messages`
(OpenAI chat messages, rendered with the model's template), plus the sampling fields of
`SamplingFields` (n, temperature, top_p, top_k, min_p, penalties, seed, stop, stop_token_ids,
ignore_eos, min_tokens, logit_bias, priority) and `max_tokens` (default: SamplingParams' default,
capped by the context) and `logprobs` (k alternatives per token). It answers
  {"id", "model", "choices": [{"index", "text", "token_ids", "finish_reason", "stop_reason",
   "logprobs": [{"token_id", "token", "logprob", "rank", "top_logprobs": [{"token_id", "token",
   "logprob"}]}] | null}], "usage": {...}, "e2e_s"}.
POST /v1/inference/stream sends the same choice objects as deltas, one SSE event per engine step
(`data: {"id", "choices": [...]}`), then `data: {"id", "choices": [], "usage": {...}}`, then
`data: [DONE]`; an error after the start is `data: {"error": {...}}` then `data: [DONE]`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from bitserve.frontend.async_engine import AsyncEngine
from bitserve.layers.sampler import TokenLogprobs
from bitserve.lifecycle.slot import Lease
from bitserve.outputs import RequestOutput
from bitserve.sampling_params import SamplingParams
from bitserve.server.body import parse_request, with_model_defaults
from bitserve.server.prompts import encode_messages, encode_text, prompt_from_ids, resolve_max_tokens
from bitserve.server.protocol import (
    DetokenizeRequest,
    InferenceRequest,
    TokenizeRequest,
    check_token_ids,
    finite_logprob,
    new_request_id,
    token_text,
    usage_payload,
)
from bitserve.server.state import AppState, get_state
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

DEFAULT_MAX_TOKENS = next(f.default for f in dataclasses.fields(SamplingParams) if f.name == "max_tokens")
PROC_STATUS = Path("/proc/self/status")


def native_logprobs(tokenizer: Tokenizer, entries: Sequence[TokenLogprobs]) -> list[dict[str, Any]]:
    return [{
        "token_id": entry.token_id, "token": token_text(tokenizer, entry.token_id),
        "logprob": finite_logprob(entry.logprob), "rank": entry.rank,
        "top_logprobs": [{"token_id": token_id, "token": token_text(tokenizer, token_id), "logprob": finite_logprob(lp)}
                         for token_id, lp in entry.top_logprobs],
    } for entry in entries]  # fmt: skip


async def _start(request: Request) -> tuple[AppState, InferenceRequest, GenerationStream, Lease]:
    state = get_state(request)
    body = parse_request(await request.body(), InferenceRequest)
    lease = state.acquire(body.model)
    with lease.released_on_error():
        body = with_model_defaults(body, lease.slot.source.default_params)
        instance = lease.engine.instance
        if body.messages is not None:
            prompt_ids, param = await encode_messages(instance, body.messages), "messages"
        elif isinstance(body.prompt, str):
            prompt_ids, param = await encode_text(instance, body.prompt), "prompt"
        else:
            prompt_ids, param = prompt_from_ids(instance, body.prompt or []), "prompt"
        max_tokens = resolve_max_tokens(len(prompt_ids), body.max_tokens, DEFAULT_MAX_TOKENS, instance.max_model_len,
                                        prompt_param=param)  # fmt: skip
        params = body.to_sampling_params(max_tokens=max_tokens, logprobs=body.logprobs)
        stream = GenerationStream(lease, prompt_ids, params, request_id=new_request_id("inf"),
                                  priority=body.priority_class, registry=state.registry)  # fmt: skip
    await stream.start()
    return state, body, stream, lease


async def inference(request: Request) -> Response:
    start = time.monotonic()
    state, body, stream, lease = await _start(request)
    tokenizer = lease.engine.instance.tokenizer
    try:
        result = await until_disconnect(request.receive, collect(stream, body.n))
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED_STATUS)
    choices = [{
        "index": choice.index, "text": choice.text, "token_ids": choice.token_ids,
        "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason,
        "logprobs": native_logprobs(tokenizer, choice.logprobs) if body.logprobs is not None else None,
    } for choice in result.choices]  # fmt: skip
    return JSONResponse({
        "id": stream.request_id, "model": lease.info.id, "model_version": lease.info.version, "choices": choices,
        "usage": usage_payload(result.num_prompt_tokens, result.num_output_tokens, result.num_cached_tokens),
        "e2e_s": round(time.monotonic() - start, 4),
    }, headers=version_header(lease.info.version))  # fmt: skip


async def inference_stream(request: Request) -> Response:
    state, body, stream, lease = await _start(request)
    tokenizer = lease.engine.instance.tokenizer
    model_id, version = lease.info.id, lease.info.version
    counts = {"completion": 0, "cached": 0}

    def chunks_for(output: RequestOutput) -> list[dict[str, Any]]:
        counts["cached"] = max(counts["cached"], output.num_cached_tokens)
        choices = []
        for delta in output.outputs:
            counts["completion"] += len(delta.token_ids)
            logprobs = native_logprobs(tokenizer, delta.logprobs or ()) if body.logprobs is not None else None
            choices.append({"index": delta.index, "text": delta.text, "token_ids": delta.token_ids,
                            "finish_reason": delta.finish_reason, "stop_reason": delta.stop_reason, "logprobs": logprobs})  # fmt: skip
        return [{"id": stream.request_id, "model": model_id, "model_version": version, "choices": choices}]

    def epilogue() -> list[dict[str, Any]]:
        usage = usage_payload(stream.num_prompt_tokens, counts["completion"], counts["cached"])
        return [{"id": stream.request_id, "model": model_id, "model_version": version, "choices": [], "usage": usage}]

    frames = sse_events(stream, state.server_config.sse_keepalive_s, chunks_for, [], epilogue)
    return SSEResponse(frames, headers=version_header(version))


def _memory() -> dict[str, int | None]:
    """Resident and peak resident memory of this process (Linux /proc; None elsewhere)."""
    values: dict[str, int | None] = {"rss_bytes": None, "peak_rss_bytes": None}
    try:
        lines = PROC_STATUS.read_text().splitlines()
    except OSError:
        return values
    for line in lines:
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            number = rest.split()[0]
            values["rss_bytes" if key == "VmRSS" else "peak_rss_bytes"] = int(number) * 1024
    return values


async def stats(request: Request) -> Response:
    """Batching, throughput, queue, KV usage and memory, from cached counters (no model compute)."""
    state = get_state(request)
    config = state.server_config
    payload: dict[str, Any] = {"phase": state.phase, "uptime_s": round(time.time() - state.started_at, 1),
                               "memory": _memory(), "admission": {"max_num_waiting": config.max_num_waiting,
                                                                  "max_num_queued_tokens": config.max_num_queued_tokens}}  # fmt: skip
    slot = state.default_slot()
    if slot is None or slot.engine is None:
        return JSONResponse(payload)
    payload.update(engine_stats(slot.engine))
    payload["models"] = {name: engine_stats(entry.current.engine) for name, entry in sorted(state.models.aliases.items())
                         if entry.current.engine is not None}  # fmt: skip
    return JSONResponse(payload)


def engine_stats(engine: AsyncEngine) -> dict[str, Any]:
    snapshot = engine.stats_snapshot()
    # NOTE: a read of the engine thread's block pool without a lock: counters only, one step stale at worst.
    kv = engine.instance.engine.scheduler.kv
    return {
        "model": snapshot["model"],
        "requests": {"num_active": snapshot["num_active_requests"], "num_queued_prompt_tokens": snapshot["num_queued_prompt_tokens"]},
        "throughput": {"tokens_per_s": snapshot["tokens_per_s_ema"]},
        "batching": snapshot["last_step"],
        "kv_cache": {"usage": round(kv.usage, 6), "num_free_blocks": kv.num_free_blocks,
                     "num_usable_blocks": kv.num_usable_blocks, "block_size": kv.block_size},
        "engine": {"is_alive": snapshot["engine_alive"], "is_draining": snapshot["draining"],
                   "seconds_since_progress": round(engine.seconds_since_progress, 3)},
    }  # fmt: skip


async def tokenize(request: Request) -> Response:
    state = get_state(request)
    body = parse_request(await request.body(), TokenizeRequest)
    instance = state.require_instance(body.model)
    if body.messages is not None:
        token_ids = await encode_messages(instance, body.messages)
    else:
        token_ids = await encode_text(
            instance, body.prompt or "", add_special=body.add_special_tokens, allow_empty=True
        )
    return JSONResponse(
        {"tokens": token_ids, "count": len(token_ids), "max_model_len": instance.max_model_len}
    )


async def detokenize(request: Request) -> Response:
    state = get_state(request)
    body = parse_request(await request.body(), DetokenizeRequest)
    tokenizer = state.require_instance(body.model).tokenizer
    if body.tokens:
        check_token_ids(body.tokens, tokenizer.vocab_size, "tokens")
    return JSONResponse({"prompt": tokenizer.decode(body.tokens, skip_special=False)})
