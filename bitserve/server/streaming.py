"""HTTP framing of a GenerationStream: SSE frames, an SSE response that watches for client
disconnect, and a disconnect watcher for non-streaming requests.

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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from bitserve.errors import BitserveError
from bitserve.frontend.batch_stream import BatchStream
from bitserve.frontend.device_router import RoutedStream
from bitserve.frontend.generation_stream import GenerationStream
from bitserve.server.errors import sse_error_event
from bitserve.server.protocol import usage_payload
from bitserve.server.response_cache.streams import RecordingStream, ReplayStream

if TYPE_CHECKING:
    from bitserve.server.response_format import ResponseFormat

logger = logging.getLogger(__name__)

# what a generation's stream may be: admitted (one prompt, or a batch), or the response cache's
AnyStream = GenerationStream | RoutedStream | BatchStream | ReplayStream | RecordingStream
DONE_FRAME = b"data: [DONE]\n\n"
PING_FRAME = b": ping\n\n"
CLIENT_CLOSED_STATUS = 499  # the client left before its answer; only the access log sees it
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
MODEL_VERSION_HEADER = "X-Model-Version"  # the version (short sha256) that served a generation
T = TypeVar("T")


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


async def stream_payloads(
    stream: AnyStream,
    keepalive_s: float,
    response_format: ResponseFormat,
) -> AsyncIterator[dict[str, Any] | None]:
    """The chunk objects of one admitted stream, for any transport: the format's prologue, its chunks
    per output, its epilogue (given the usage); None when `keepalive_s` passed with no output. Raises
    what the stream raises. Closing this iterator (client disconnect, a cancel) closes the stream, which
    aborts the request."""
    num_completion_tokens = num_cached_tokens = 0
    try:
        for payload in response_format.prologue():
            yield payload
        while True:
            try:
                output = await stream.next(keepalive_s)
            except StopAsyncIteration:
                break
            if output is None:
                yield None
                continue
            num_completion_tokens += output.num_output_tokens
            num_cached_tokens = max(num_cached_tokens, output.num_cached_tokens)
            for payload in response_format.chunks(output):
                yield payload
        usage = usage_payload(stream.num_prompt_tokens, num_completion_tokens, num_cached_tokens)
        for payload in response_format.epilogue(usage):
            yield payload
    finally:
        stream.close()


@dataclass(frozen=True, slots=True)
class Framing:
    """How an API writes its stream: each payload's frame, the idle ping, the error after the headers,
    and the last frame (OpenAI's [DONE]; none for Anthropic's, which ends with its message_stop)."""

    frame: Callable[[dict[str, Any]], bytes]
    ping: bytes
    error: Callable[[BaseException], bytes]
    end: bytes = b""


OPENAI_FRAMING = Framing(sse_frame, PING_FRAME, sse_error_event, DONE_FRAME)


async def framed_events(
    stream: AnyStream,
    keepalive_s: float,
    response_format: ResponseFormat,
    framing: Framing = OPENAI_FRAMING,
) -> AsyncIterator[bytes]:
    """Frames of one admitted stream (stream_payloads) in `framing`, a ping when idle, then its end.
    Any error after the first frame becomes its error frame, then the end."""
    payloads = stream_payloads(stream, keepalive_s, response_format)
    try:
        async for payload in payloads:
            yield framing.ping if payload is None else framing.frame(payload)
    except Exception as exc:  # noqa: BLE001 - headers are out: the table's body goes in an error event
        if not isinstance(exc, BitserveError):
            logger.exception("stream failed")
        yield framing.error(exc)
    finally:
        await payloads.aclose()  # closes the stream (an abort) also when this iterator is closed early
    if framing.end:
        yield framing.end


def sse_events(
    stream: AnyStream, keepalive_s: float, response_format: ResponseFormat
) -> AsyncIterator[bytes]:
    """OpenAI's SSE: `data:` frames, a `: ping` comment when idle, [DONE] at the end (also after an error)."""
    return framed_events(stream, keepalive_s, response_format, OPENAI_FRAMING)
