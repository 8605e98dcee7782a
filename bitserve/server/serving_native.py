"""bitserve's native API: /v1/inference, /v1/inference/stream, /v1/stats, /tokenize, /detokenize.

POST /v1/inference takes exactly one of `prompt` (a string, or a list of token ids) or `messages`
(OpenAI chat messages, rendered with the model's template), plus the sampling fields of
`SamplingFields` (n, temperature, top_p, top_k, min_p, penalties, seed, stop, stop_token_ids,
ignore_eos, min_tokens, logit_bias, priority) and `max_tokens` (default: SamplingParams' default,
until the end of the context; SamplingParams says the policy), `logprobs` (k alternatives per
token) and `timeout` (seconds; or the X-Request-Timeout header: past it, 504 deadline_exceeded). It
answers
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

from bitserve.engine.messages import TokenLogprobs
from bitserve.frontend.async_engine import EngineSnapshot
from bitserve.outputs import CompletionOutput, RequestOutput
from bitserve.server.body import parse_request
from bitserve.server.pipeline import Generation, prepare, respond
from bitserve.server.prompts import encode_messages, encode_text
from bitserve.server.protocol import (
    DetokenizeRequest,
    InferenceRequest,
    TokenizeRequest,
    check_token_ids,
    finite_logprob,
    token_text,
)
from bitserve.server.state import get_state
from bitserve.tokenizer.base import Tokenizer

PROC_STATUS = Path("/proc/self/status")


def native_logprobs(tokenizer: Tokenizer, entries: Sequence[TokenLogprobs]) -> list[dict[str, Any]]:
    return [
        {
            "token_id": entry.token_id,
            "token": token_text(tokenizer, entry.token_id),
            "logprob": finite_logprob(entry.logprob),
            "rank": entry.rank,
            "top_logprobs": [
                {
                    "token_id": token_id,
                    "token": token_text(tokenizer, token_id),
                    "logprob": finite_logprob(lp),
                }
                for token_id, lp in entry.top_logprobs
            ],
        }
        for entry in entries
    ]


class NativeFormat:
    """The native API's shapes: one SSE event per engine step with every choice's delta."""

    def __init__(self, generation: Generation) -> None:
        self.tokenizer = generation.tokenizer
        self.wants_logprobs = generation.body.logprobs is not None
        self.envelope = {
            "id": generation.stream.request_id,
            "model": generation.model_id,
            "model_version": generation.version,
        }
        self.started = generation.started

    def _choice(self, output: CompletionOutput) -> dict[str, Any]:
        logprobs = native_logprobs(self.tokenizer, output.logprobs or ()) if self.wants_logprobs else None
        return {
            "index": output.index,
            "text": output.text,
            "token_ids": output.token_ids,
            "finish_reason": output.finish_reason,
            "stop_reason": output.stop_reason,
            "logprobs": logprobs,
        }

    def prologue(self) -> list[dict[str, Any]]:
        return []

    def chunks(self, output: RequestOutput) -> list[dict[str, Any]]:
        return [{**self.envelope, "choices": [self._choice(delta) for delta in output.outputs]}]

    def epilogue(self, usage: dict[str, Any]) -> list[dict[str, Any]]:
        return [{**self.envelope, "choices": [], "usage": usage}]

    def body(self, result: RequestOutput, usage: dict[str, Any]) -> dict[str, Any]:
        return {
            **self.envelope,
            "choices": [self._choice(output) for output in result.outputs],
            "usage": usage,
            "e2e_s": round(time.monotonic() - self.started, 4),
        }


async def inference(request: Request) -> Response:
    generation = await prepare(request, InferenceRequest, "inf")
    return await respond(request, generation, NativeFormat(generation), stream=False)


async def inference_stream(request: Request) -> Response:
    generation = await prepare(request, InferenceRequest, "inf")
    return await respond(request, generation, NativeFormat(generation), stream=True)


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
    payload: dict[str, Any] = {
        "phase": state.phase,
        "uptime_s": round(time.time() - state.started_at, 1),
        "memory": _memory(),
        "admission": {  # as set; unset (None) they scale with each replica: see "admission_by_device"
            "max_num_waiting": config.max_num_waiting,
            "max_num_queued_tokens": config.max_num_queued_tokens,
        },
    }
    cache = state.response_cache
    payload["response_cache"] = cache.describe() if cache is not None else {"enabled": False}
    payload["batches"] = state.batches.describe()
    slot = state.default_slot()
    if slot is None or not slot.replicas:
        return JSONResponse(payload)
    payload.update(model_stats([engine.snapshot() for engine in slot.engines]))
    payload["admission_by_device"] = {
        engine.device: {
            "max_num_waiting": engine.limits.max_num_waiting,
            "max_num_queued_tokens": engine.limits.max_num_queued_tokens,
        }
        for engine in slot.engines
    }
    payload["models"] = {
        name: model_stats([engine.snapshot() for engine in alias.current.engines])
        for name, alias in sorted(state.models.aliases.items())
        if alias.current.replicas
    }
    return JSONResponse(payload)


def model_stats(snapshots: Sequence[EngineSnapshot]) -> dict[str, Any]:
    """One model version: its replicas' counters together (the first replica's batching), and each
    replica's own under "replicas"."""
    stats = engine_stats(snapshots[0])
    if len(snapshots) > 1:
        num_free = sum(s.kv_cache.num_free_blocks for s in snapshots)
        num_usable = sum(s.kv_cache.num_usable_blocks for s in snapshots)
        stats["requests"] = {
            "num_active": sum(s.num_active_requests for s in snapshots),
            "num_queued_prompt_tokens": sum(s.num_queued_prompt_tokens for s in snapshots),
        }
        stats["throughput"] = {"tokens_per_s": round(sum(s.tokens_per_s for s in snapshots), 2)}
        stats["kv_cache"] = {  # over every replica's blocks (their block sizes may differ: counts only)
            "usage": round(1.0 - num_free / num_usable, 6) if num_usable else 0.0,
            "num_free_blocks": num_free,
            "num_usable_blocks": num_usable,
            "num_resident_blocks": sum(s.kv_cache.num_resident_blocks for s in snapshots),
        }
        stats["engine"]["is_alive"] = any(s.is_alive for s in snapshots)
    stats["replicas"] = [engine_stats(s) for s in snapshots]
    return stats


def engine_stats(snapshot: EngineSnapshot) -> dict[str, Any]:
    return {
        "model": snapshot.model,
        "device": snapshot.device,
        "requests": {
            "num_active": snapshot.num_active_requests,
            "num_queued_prompt_tokens": snapshot.num_queued_prompt_tokens,
        },
        "throughput": {"tokens_per_s": snapshot.tokens_per_s, "mean_step_time_s": snapshot.mean_step_time_s},
        "batching": dataclasses.asdict(snapshot.last_step) if snapshot.last_step is not None else None,
        "kv_cache": dataclasses.asdict(snapshot.kv_cache),
        "engine": {
            "is_alive": snapshot.is_alive,
            "is_draining": snapshot.is_draining,
            "seconds_since_progress": snapshot.seconds_since_progress,
        },
    }


async def tokenize(request: Request) -> Response:
    state = get_state(request)
    body = parse_request(await request.body(), TokenizeRequest)
    instance = state.require_instance(body.model)
    if body.messages is not None:
        token_ids = await encode_messages(instance, body.messages)
    else:
        token_ids = await encode_text(instance, body.prompt or "", add_special=body.add_special_tokens)
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
