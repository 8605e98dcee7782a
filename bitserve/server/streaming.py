"""Generation plumbing between the AsyncEngine and HTTP: a pumped generation stream (admission
errors before any header, keep-alive while waiting, drain deadline), SSE framing and an SSE
response that watches for client disconnect, and the non-streaming collector.

SSE contract: `data: {json}\\n\\n` chunks; on success the last frame is `data: [DONE]\\n\\n`. An error
after the stream began is sent as `data: {"error": {...}}\\n\\n` (the table's body), then
`data: [DONE]\\n\\n`, so clients that wait for [DONE] always terminate. Idle streams get `: ping`
comments every `sse_keepalive_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from bitserve.core.request import Priority
from bitserve.errors import BitserveError, EngineDead, RequestFailed
from bitserve.layers.sampler import TokenLogprobs
from bitserve.lifecycle.slot import Lease
from bitserve.outputs import RequestOutput
from bitserve.sampling_params import SamplingParams
from bitserve.server.errors import sse_error_event

logger = logging.getLogger(__name__)

DONE_FRAME = b"data: [DONE]\n\n"
PING_FRAME = b": ping\n\n"
CLIENT_CLOSED_STATUS = 499  # the client left before its answer; only the access log sees it
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
MODEL_VERSION_HEADER = "X-Model-Version"  # the version (short sha256) that served a generation
T = TypeVar("T")
# Errors that count against a model version on probation (not admission refusals or bad requests).
MODEL_FAILURES = (EngineDead, RequestFailed)


class ClientDisconnected(Exception):
    """The client closed the connection before its response was complete."""


def version_header(version: str) -> dict[str, str]:
    return {MODEL_VERSION_HEADER: version}


def sse_frame(payload: dict[str, Any]) -> bytes:
    # allow_nan=False: a NaN would make invalid JSON; the ValueError becomes an error event instead.
    return (
        b"data: "
        + json.dumps(payload, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
        + b"\n\n"
    )


class StreamRegistry:
    """Every live generation's queue, so the drain deadline can end them all at once."""

    def __init__(self) -> None:
        self._queues: set[asyncio.Queue[Any]] = set()

    def add(self, queue: asyncio.Queue[Any]) -> None:
        self._queues.add(queue)

    def discard(self, queue: asyncio.Queue[Any]) -> None:
        self._queues.discard(queue)

    def expire(self, error: BaseException) -> int:
        """Deliver `error` to every live generation; returns how many there were."""
        for queue in self._queues:
            queue.put_nowait(error)
        return len(self._queues)

    def __len__(self) -> int:
        return len(self._queues)


class GenerationStream:
    """One `AsyncEngine.generate` running in a pump task that feeds a queue.

    `start()` raises admission errors (QueueFull, InvalidRequest, ModelUnavailable, EngineDead)
    before any response is sent. `next(timeout)` returns an output, None on timeout (time for a
    keep-alive), or raises the stream's error. `close()` cancels the pump: `generate`'s cleanup
    aborts the request, so the engine frees its blocks before its next step. The stream owns the
    request's lease on its model version and releases it when the generation ends, however it ends.
    """

    def __init__(self, lease: Lease, prompt_token_ids: list[int], params: SamplingParams, *,
                 request_id: str, priority: Priority, registry: StreamRegistry) -> None:  # fmt: skip
        self._lease = lease
        self._generator = lease.engine.generate(prompt_token_ids, params, request_id=request_id, priority=priority)
        self._queue: asyncio.Queue[RequestOutput | BaseException | None] = asyncio.Queue()
        self._registry = registry
        self._task: asyncio.Task[None] | None = None
        self.request_id = request_id
        self.num_prompt_tokens = len(prompt_token_ids)

    async def start(self) -> None:
        self._task = asyncio.ensure_future(self._pump())
        # NOTE: generate() admits synchronously on its first step; asyncio runs the new task's first
        # step before resuming us, so after one yield an admission error has already ended the pump.
        await asyncio.sleep(0)
        if self._task.done():
            items = [self._queue.get_nowait() for _ in range(self._queue.qsize())]
            if items and isinstance(items[0], BaseException):
                raise items[0]
            for item in items:  # finished without an error (cannot happen before a step): keep them
                self._queue.put_nowait(item)
        self._registry.add(self._queue)

    async def _pump(self) -> None:
        has_failed = False
        try:
            async for output in self._generator:
                self._queue.put_nowait(output)
            self._queue.put_nowait(None)
        except Exception as exc:  # delivered to the consumer, which renders it through the table
            has_failed = isinstance(exc, MODEL_FAILURES) or not isinstance(exc, BitserveError)
            self._queue.put_nowait(exc)
        finally:
            self._lease.release(has_failed=has_failed)

    async def next(self, timeout: float | None) -> RequestOutput | None:
        """The next output; None on timeout; StopAsyncIteration at the end; the stream's error."""
        # NOTE: not asyncio.wait_for: up to Python 3.11 it returns the result when a cancellation
        # (client disconnect) lands just as the item arrives, swallowing the cancel. asyncio.wait
        # never swallows it; an unfinished get is cancelled (Queue.get keeps the item then).
        getter = asyncio.ensure_future(self._queue.get())
        try:
            done, _ = await asyncio.wait({getter}, timeout=timeout)
        finally:
            if not getter.done():
                getter.cancel()
        if not done:
            return None
        item = getter.result()
        if item is None:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return item

    async def close(self) -> None:
        self._registry.discard(self._queue)
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


@dataclass(slots=True)
class ChoiceResult:
    """One choice of a finished non-streaming request."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@dataclass(slots=True)
class CollectedResult:
    choices: list[ChoiceResult]
    num_prompt_tokens: int
    num_cached_tokens: int = 0

    @property
    def num_output_tokens(self) -> int:
        return sum(len(choice.token_ids) for choice in self.choices)


async def collect(stream: GenerationStream, num_choices: int) -> CollectedResult:
    """Run a started stream to its end and gather every choice (closes the stream)."""
    result = CollectedResult([ChoiceResult(index) for index in range(num_choices)], stream.num_prompt_tokens)
    try:
        while True:
            try:
                output = await stream.next(None)
            except StopAsyncIteration:
                return result
            if output is None:
                continue
            result.num_cached_tokens = max(result.num_cached_tokens, output.num_cached_tokens)
            for delta in output.outputs:
                choice = result.choices[delta.index]
                choice.text += delta.text
                choice.token_ids.extend(delta.token_ids)
                choice.logprobs.extend(delta.logprobs or ())
                if delta.finish_reason is not None:
                    choice.finish_reason, choice.stop_reason = delta.finish_reason, delta.stop_reason
    finally:
        await stream.close()


async def until_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it if the client disconnects first (then ClientDisconnected)."""
    work_task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
    try:
        await asyncio.wait({work_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work_task, watcher):
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
    if work_task.cancelled():
        logger.info("client disconnected; request aborted")
        raise ClientDisconnected("the client disconnected")
    return work_task.result()


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class SSEResponse(Response):
    """text/event-stream from an async iterator of frames. A client disconnect cancels the
    iterator (its `finally` closes the GenerationStream, which aborts the request)."""

    media_type = "text/event-stream"

    def __init__(self, frames: AsyncIterator[bytes], headers: dict[str, str] | None = None) -> None:
        # NOTE: Response.__init__ is bypassed: it would add "content-length: 0" to a bodiless response.
        self.status_code = 200
        self.background = None
        self.body = b""
        merged = {"content-type": "text/event-stream; charset=utf-8", **SSE_HEADERS, **(headers or {})}
        self.raw_headers = [
            (name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in merged.items()
        ]
        self.frames = frames

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        self.is_disconnected = False
        body = asyncio.ensure_future(self._send_frames(send))
        watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
        try:
            await asyncio.wait({body, watcher}, return_when=asyncio.FIRST_COMPLETED)
            # Also a flag, not only the cancel below: a cancellation swallowed inside the frames'
            # awaits must still stop the loop, or the request would run to its end for nobody.
            self.is_disconnected = watcher.done()
        finally:
            for task in (body, watcher):
                if not task.done():
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, OSError):
                        await task
        if body.done() and not body.cancelled() and body.exception() is not None:
            logger.info("stream ended early: %r", body.exception())

    async def _send_frames(self, send: Send) -> None:
        try:
            async for frame in self.frames:
                if self.is_disconnected:
                    return  # the finally closes the frames, which aborts the request
                await send({"type": "http.response.body", "body": frame, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            aclose = getattr(self.frames, "aclose", None)
            if aclose is not None:
                await aclose()


async def sse_events(stream: GenerationStream, keepalive_s: float,
                     chunks_for: Callable[[RequestOutput], list[dict[str, Any]]],
                     prologue: list[dict[str, Any]], epilogue: Callable[[], list[dict[str, Any]]]) -> AsyncIterator[bytes]:  # fmt: skip
    """SSE frames of one started stream: prologue, chunks per output, epilogue, [DONE].

    Any error after the first frame becomes an error event followed by [DONE]. Closing this
    iterator (client disconnect) closes the stream, which aborts the request.
    """
    try:
        for payload in prologue:
            yield sse_frame(payload)
        while True:
            try:
                output = await stream.next(keepalive_s)
            except StopAsyncIteration:
                break
            if output is None:
                yield PING_FRAME
                continue
            for payload in chunks_for(output):
                yield sse_frame(payload)
        for payload in epilogue():
            yield sse_frame(payload)
    except Exception as exc:  # noqa: BLE001 - headers are out: the table's body goes in an error event
        if not isinstance(exc, BitserveError):
            logger.exception("stream failed")
        yield sse_error_event(exc)
    finally:
        await stream.close()
    yield DONE_FRAME
