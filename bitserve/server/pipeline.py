"""The one serving pipeline every generation endpoint shares.

`prepare()`: parse the body, then `admit()`: lease the model it names -> fill the model's default
parameters -> encode the prompt -> SamplingParams -> `Lease.submit`, whose router picks a replica of
that version (admission errors, and a `device` hint this version does not run on, raise here, before
any response header). `admit()` takes what it needs of the transport as a `Caller`, so one WebSocket
message (server/websocket.py) is admitted by the same code as an HTTP request. `respond()`: SSE frames
or one JSON body, both built by the endpoint's small `ResponseFormat`. The lease is released when the
stream closes, however it ends.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from bitserve.frontend.batch_stream import BatchStream
from bitserve.frontend.device_router import RoutedStream
from bitserve.lifecycle.canary import CANARY_HEADER, SESSION_HEADER, routing_hints
from bitserve.lifecycle.slot import Lease
from bitserve.server.body import parse_request, with_model_defaults
from bitserve.server.deadlines import TIMEOUT_HEADER, request_deadline
from bitserve.server.plugins.base import RequestContext
from bitserve.server.plugins.stream import PluginStream, with_output_plugins
from bitserve.server.prompts import encode_prompt
from bitserve.server.protocol import GenerationRequest, PromptInput, new_request_id, usage_payload
from bitserve.server.request_log import log_if_slow
from bitserve.server.response_cache.cache import CACHE_HEADER, look_up
from bitserve.server.response_cache.streams import RecordingStream, ReplayStream
from bitserve.server.response_format import ResponseFormat
from bitserve.server.security.guard import RequestSecurity
from bitserve.server.security.request_context import charge_tokens, request_security, token_cost
from bitserve.server.state import AppState, get_state
from bitserve.server.streaming import (
    CLIENT_CLOSED_STATUS,
    AnyStream,
    ClientDisconnected,
    SSEResponse,
    sse_events,
    until_disconnect,
    version_header,
)
from bitserve.server.tracing import current_span, record_generation_spans
from bitserve.tokenizer.base import Tokenizer

BodyT = TypeVar("BodyT", bound=GenerationRequest)
OutputStreamLike = RoutedStream | BatchStream | ReplayStream
# (stream, keepalive_s, format) -> the SSE body's frames (streaming.sse_events is OpenAI's framing)
FrameSource = Callable[[AnyStream, float, ResponseFormat], AsyncIterator[bytes]]


@dataclass(slots=True)
class Generation:
    """One admitted generation: the validated body, the version serving it, its stream."""

    state: AppState
    body: Any  # the endpoint's GenerationRequest subclass
    lease: Lease
    stream: RoutedStream | BatchStream | ReplayStream | RecordingStream | PluginStream
    started: float  # time.monotonic() when the request arrived
    prompt_token_ids: list[list[int]]  # each prompt's (one, unless a batched completions request)
    created: int = field(default_factory=lambda: int(time.time()))
    cache: str | None = None  # "hit" | "miss" when the response cache looked this request up

    @property
    def tokenizer(self) -> Tokenizer:
        return self.lease.instance.tokenizer

    @property
    def model_id(self) -> str:
        return self.lease.info.id

    @property
    def version(self) -> str:
        return self.lease.info.version


@dataclass(frozen=True, slots=True)
class Caller:
    """What admission needs of the transport a generation came by (an HTTP request, a socket message)."""

    security: RequestSecurity | None  # the caller's principal and budgets (None: an app without security)
    timeout_header: str | None = None  # X-Request-Timeout, where the transport has headers
    session_header: str | None = None  # X-Session-Id: keeps a conversation on one version in a canary
    canary_header: str | None = None  # X-Canary: a tester's "always" / "never"

    @classmethod
    def of_request(cls, request: Request) -> Caller:
        headers = request.headers
        return cls(
            request_security(request),
            headers.get(TIMEOUT_HEADER),
            headers.get(SESSION_HEADER),
            headers.get(CANARY_HEADER),
        )


async def prepare(request: Request, body_cls: type[BodyT], id_prefix: str) -> Generation:
    """Parse and admit one HTTP generation request (raises before any header)."""
    started = time.monotonic()
    body = parse_request(await request.body(), body_cls)
    return await admit(get_state(request), body, id_prefix, Caller.of_request(request), started)


async def admit(state: AppState, body: BodyT, id_prefix: str, caller: Caller, started: float) -> Generation:
    """Lease, default, encode and admit one validated generation request (`started`: its arrival,
    time.monotonic()). A batched completions request admits one stream per prompt, seen as one
    BatchStream. With the response cache on, a deterministic request's stored answer is replayed
    instead of admitted, and a generated one is stored once it completes. With plugins enabled, their
    pre-inference hooks see (and may rewrite or refuse) the body first, and their output hooks wrap the
    stream, replayed or generated (server/plugins)."""
    hints = routing_hints(body.user, caller.session_header, caller.canary_header)
    lease = state.acquire(body.model, hints)
    with lease.released_on_error():
        body = with_model_defaults(body, lease.slot.source.default_params)  # may set `timeout` too
        plugin_context: RequestContext | None = None
        if state.plugins.plugins:
            principal = caller.security.principal.name if caller.security is not None else None
            context = RequestContext(id_prefix, lease.info.id, body, lease.instance.tokenizer, principal)
            plugin_context = await state.plugins.pre_inference(context)
            body = plugin_context.body
        deadline = request_deadline(started, body.timeout, caller.timeout_header)
        lookup = await look_up(state.response_cache, id_prefix, body, lease.info)
        if lookup is not None and lookup.entry is not None:
            replay = ReplayStream(new_request_id(id_prefix), lookup.entry)
            _close_with_lease(state, lease, replay, started)
            replayed = with_output_plugins(replay, state.plugins, plugin_context)
            return Generation(
                state, body, lease, replayed, started, lookup.entry.prompt_token_ids, cache="hit"
            )
        request_id = new_request_id(id_prefix)
        prompts = body.prompt_inputs()
        streams: list[RoutedStream] = []
        try:
            for index, prompt in enumerate(prompts):
                sub_id = request_id if len(prompts) == 1 else f"{request_id}-{index}"
                streams.append(await _admit(caller, lease, body, prompt, deadline, sub_id))
        except BaseException:
            for admitted in streams:
                admitted.close()  # aborts it and gives its tokens back; the lease is released below
            raise
        stream: RoutedStream | BatchStream = (
            streams[0] if len(streams) == 1 else BatchStream(request_id, streams, body.n)
        )
        _close_with_lease(state, lease, stream, started)
    prompt_ids = [admitted.submission.prompt_token_ids for admitted in streams]
    generation = Generation(state, body, lease, stream, started, prompt_ids)
    if lookup is not None:
        generation.stream = lookup.recording(stream, prompt_ids)
        generation.cache = "miss"
    generation.stream = with_output_plugins(generation.stream, state.plugins, plugin_context)
    return generation


def _close_with_lease(state: AppState, lease: Lease, stream: OutputStreamLike, started: float) -> None:
    """When `stream` closes: release the lease (once, after every prompt's stream ended), run what
    the stream already had to do on close, record the generation's spans when tracing, and log it
    if it was slow."""
    settle = stream.on_close
    span = current_span() if state.tracer is not None else None  # the request's (TracingMiddleware)

    def on_close(error: BaseException | None) -> None:
        lease.finish(error)
        if settle is not None:
            settle(error)
        timing = stream.timing
        if span is not None:
            record_generation_spans(state.tracer, span, timing)
        log_if_slow(state.server_config.slow_request_s, started, timing, stream.num_prompt_tokens)

    stream.on_close = on_close


async def _admit(
    caller: Caller,
    lease: Lease,
    body: GenerationRequest,
    prompt: PromptInput,
    deadline: float | None,
    request_id: str,
) -> RoutedStream:
    """Encode one prompt, charge its tokens, submit it; its on_close gives back what it did not use."""
    prompt_ids = await encode_prompt(lease.instance, prompt)
    params = body.to_sampling_params(lease.instance.tool_format)
    if params.guide is not None:  # a bad schema, regex or grammar is a 400 before admission
        await asyncio.to_thread(lease.instance.grammars.validate, params.guide)
    # the caller's token budget pays the most this can use now; what it did not use comes back
    cost = token_cost(len(prompt_ids), params, lease.instance.max_model_len)
    settle = await charge_tokens(caller.security, cost)
    try:
        stream = lease.submit(
            prompt_ids,
            params,
            request_id=request_id,
            priority=body.priority_class,
            deadline=deadline,
            prompt_param=prompt.param,
            device=body.device,
        )
    except BaseException:
        settle(0)
        raise

    def on_close(error: BaseException | None) -> None:
        settle(stream.num_prompt_tokens + stream.num_output_tokens)

    stream.on_close = on_close  # instead of the lease's release: prepare() releases once for all prompts
    return stream


async def respond(
    request: Request,
    generation: Generation,
    response_format: ResponseFormat,
    *,
    stream: bool,
    frames: FrameSource = sse_events,
) -> Response:
    """SSE `frames` when `stream` (OpenAI's `data:` frames and [DONE] unless the endpoint frames its
    own), else run to the end: one JSON body (499 if the client leaves first)."""
    headers = version_header(generation.version)
    if generation.cache is not None:
        headers[CACHE_HEADER] = generation.cache
    if stream:
        keepalive_s = generation.state.server_config.sse_keepalive_s
        return SSEResponse(frames(generation.stream, keepalive_s, response_format), headers=headers)
    try:
        result = await until_disconnect(request.receive, generation.stream.collect())
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED_STATUS)
    finally:
        # NOTE: collect() closes the stream itself, but a collect cancelled before its first step (a
        # batch request stopped the moment it was admitted) never runs: close here too (idempotent),
        # or the engine would go on generating for nobody.
        generation.stream.close()
    num_prompt_tokens = generation.stream.num_prompt_tokens  # summed over a batch's prompts
    usage = usage_payload(num_prompt_tokens, result.num_output_tokens, result.num_cached_tokens)
    return JSONResponse(response_format.body(result, usage), headers=headers)
