"""Request size and time limits that uvicorn does not enforce.

- `BodyLimitMiddleware` (ASGI): headers over `max_header_bytes` get 431; bodies over
  `max_body_bytes` get 413 (from Content-Length before reading, or as the bytes arrive); a body not
  fully received within `body_read_timeout_s` gets 408 and `Connection: close`. The app then sees
  the whole body at once.
Headers that are slow or still growing are cut off by the HTTP protocols (server/http_protocols.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from bitserve.errors import InvalidRequest, PayloadTooLarge
from bitserve.server.errors import HeadersTooLarge, RequestTimeout, lookup, send_error

logger = logging.getLogger(__name__)


class BodyLimitMiddleware:
    """Reads each request body up front under a size cap and a deadline, then replays it."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        max_body_bytes: int,
        body_read_timeout_s: float,
        max_header_bytes: int,
        on_error: Callable[[int, str], None] | None = None,
        path_limits: dict[str, int] | None = None,
    ) -> None:
        self.app = app
        self.on_error = on_error
        self.max_body_bytes = max_body_bytes
        self.path_limits = path_limits or {}  # exact path -> its own body limit (batch file uploads)
        self.body_read_timeout_s = body_read_timeout_s
        self.max_header_bytes = max_header_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        max_body_bytes = self.path_limits.get(scope.get("path", ""), self.max_body_bytes)
        try:
            self._check_headers(scope, max_body_bytes)
            body, disconnected = await self._read_body(receive, max_body_bytes)
        except (PayloadTooLarge, RequestTimeout, InvalidRequest, HeadersTooLarge) as exc:
            logger.warning("request refused before the app: %s", exc.message)
            if self.on_error is not None:
                spec = lookup(exc)
                self.on_error(spec.status, spec.code)
            # NOTE: `Connection: close` exists in HTTP/1.x only: on an HTTP/2 stream the header is a protocol
            # error that would reset the whole connection (every stream multiplexed on it), not this request
            is_http1 = scope.get("http_version", "1.1").startswith("1")
            await send_error(send, exc, close=is_http1, path=scope.get("path", ""))
            return
        if disconnected:
            return  # the client left while sending; nobody to answer
        await self.app(scope, _replay(body, receive), send)

    def _check_headers(self, scope: Scope, max_body_bytes: int) -> None:
        num_bytes = len(scope.get("raw_path", b"")) + len(scope.get("query_string", b""))
        num_bytes += sum(len(name) + len(value) + 4 for name, value in scope["headers"])  # ": " and CRLF
        if num_bytes > self.max_header_bytes:
            raise HeadersTooLarge(
                f"the request headers ({num_bytes} bytes) exceed the limit of {self.max_header_bytes} bytes",
                hint="send fewer or shorter headers",
            )
        for name, value in scope["headers"]:
            if name != b"content-length":
                continue
            if not value.isdigit() or len(value) > 18:
                raise InvalidRequest("the Content-Length header is not a valid length")
            if int(value) > max_body_bytes:
                raise PayloadTooLarge(
                    f"the request body of {int(value)} bytes exceeds the limit of {max_body_bytes} bytes",
                    hint="send a smaller request",
                )

    async def _read_body(self, receive: Receive, max_body_bytes: int) -> tuple[bytes, bool]:
        """(body, client disconnected). Raises PayloadTooLarge / RequestTimeout."""
        chunks: list[bytes] = []
        num_bytes = 0
        deadline = time.monotonic() + self.body_read_timeout_s
        while True:
            remaining = deadline - time.monotonic()
            try:
                message = await asyncio.wait_for(receive(), timeout=max(remaining, 0.0))
            except asyncio.TimeoutError:
                raise RequestTimeout(
                    f"the request body was not received within {self.body_read_timeout_s:g} s",
                    hint="send the whole body promptly",
                ) from None
            if message["type"] == "http.disconnect":
                return b"", True
            chunk = message.get("body", b"")
            num_bytes += len(chunk)
            if num_bytes > max_body_bytes:
                raise PayloadTooLarge(
                    f"the request body exceeds the limit of {max_body_bytes} bytes",
                    hint="send a smaller request",
                )
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), False


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive() that yields the buffered body once, then defers to the real one (disconnects)."""
    is_sent = False

    async def replay() -> Message:
        nonlocal is_sent
        if not is_sent:
            is_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
