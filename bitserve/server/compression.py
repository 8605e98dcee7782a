"""Response compression: gzip (the stdlib's zlib) or brotli bodies, chosen by Accept-Encoding, as a pure
ASGI middleware (Starlette's GZipMiddleware knows gzip only, and buffers a streamed body it compresses).

- The encoding: the highest q among `br` and `gzip` (`br` on a tie: smaller JSON at a lower CPU cost than
  gzip at the levels below); `*` stands for an encoding the header does not name; q=0 refuses one. No
  header, `identity` alone, or `identity` with a higher q than both: the body goes as it is.
- What is compressed: a response with a body (not 1xx, 204, 206, 304, nor HEAD), no Content-Encoding
  already, no `Cache-Control: no-transform`, of a textual media type (JSON, text/*, ...), and never
  `text/event-stream`: an SSE frame must leave when it is produced, and a compressor holds its input
  back for its window. A one-message body is compressed when it has at least `min_bytes`; a streamed
  body (more_body) unless it declares a smaller Content-Length, each chunk compressed and flushed as it
  comes, so nothing the app sent is held back.
- `Vary: Accept-Encoding` goes on every response of a compressible type, compressed or not, so a cache
  in front keeps the variants apart.
"""

from __future__ import annotations

import zlib
from typing import Protocol

import brotli
from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

GZIP_LEVEL = 6  # zlib's default: most of level 9's ratio on JSON at a fraction of its CPU
BROTLI_QUALITY = 4  # on JSON bodies of a few KiB: smaller than gzip -6 and about as fast
ENCODINGS = ("br", "gzip")  # in order of preference on equal q
NO_BODY_STATUSES = frozenset({204, 206, 304})
COMPRESSIBLE_TYPES = frozenset(
    {
        "application/json",
        "application/jsonl",
        "application/x-ndjson",
        "application/javascript",
        "application/xml",
        "image/svg+xml",
    }
)


def _q_values(accept_encoding: str) -> dict[str, float]:
    """Coding name (lower case) -> its q in [0, 1]; an unreadable q counts as 0 (refused)."""
    weights: dict[str, float] = {}
    for part in accept_encoding.split(","):
        name, _, params = part.partition(";")
        name = name.strip().lower()
        if not name:
            continue
        weight = 1.0
        for param in params.split(";"):
            key, _, value = param.partition("=")
            if key.strip().lower() == "q":
                try:
                    weight = min(max(float(value), 0.0), 1.0)
                except ValueError:
                    weight = 0.0
        weights[name] = max(weight, weights.get(name, 0.0))
    return weights


def choose_encoding(accept_encoding: str) -> str | None:
    """The coding to send for an Accept-Encoding header value: "br", "gzip" or None (identity)."""
    weights = _q_values(accept_encoding)
    wildcard = weights.get("*", 0.0)
    best, best_q = None, 0.0
    for name in ENCODINGS:
        weight = weights.get(name, weights.get("x-gzip", wildcard) if name == "gzip" else wildcard)
        if weight > best_q:
            best, best_q = name, weight
    identity_q = weights.get("identity")
    if identity_q is not None and identity_q > best_q:
        return None
    return best


def is_compressible(content_type: str) -> bool:
    media_type = content_type.partition(";")[0].strip().lower()
    if media_type == "text/event-stream":
        return False
    return media_type.startswith("text/") or media_type in COMPRESSIBLE_TYPES or media_type.endswith("+json")


class Encoder(Protocol):
    def compress(self, data: bytes) -> bytes: ...

    def flush(self) -> bytes: ...

    def finish(self) -> bytes: ...


class GzipEncoder:
    def __init__(self) -> None:
        self._compressor = zlib.compressobj(GZIP_LEVEL, zlib.DEFLATED, 16 + zlib.MAX_WBITS)  # gzip framing

    def compress(self, data: bytes) -> bytes:
        return self._compressor.compress(data)

    def flush(self) -> bytes:
        return self._compressor.flush(zlib.Z_SYNC_FLUSH)

    def finish(self) -> bytes:
        return self._compressor.flush(zlib.Z_FINISH)


class BrotliEncoder:
    def __init__(self) -> None:
        self._compressor = brotli.Compressor(quality=BROTLI_QUALITY)

    def compress(self, data: bytes) -> bytes:
        return bytes(self._compressor.process(data))

    def flush(self) -> bytes:
        return bytes(self._compressor.flush())

    def finish(self) -> bytes:
        return bytes(self._compressor.finish())


def new_encoder(encoding: str) -> Encoder:
    return BrotliEncoder() if encoding == "br" else GzipEncoder()


class CompressionMiddleware:
    """Compresses response bodies by the request's Accept-Encoding (the module docstring says which)."""

    def __init__(self, app: ASGIApp, *, min_bytes: int) -> None:
        self.app = app
        self.min_bytes = min_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        encoding = choose_encoding(",".join(headers.getlist("accept-encoding")))
        if scope.get("method") == "HEAD":
            encoding = None  # no body to encode; the Vary header still goes on
        await self.app(scope, receive, _CompressingSend(send, encoding, self.min_bytes))


class _CompressingSend:
    """The `send` of one response: holds its start until the first body message decides the encoding."""

    def __init__(self, send: Send, encoding: str | None, min_bytes: int) -> None:
        self._send = send
        self._encoding = encoding
        self._min_bytes = min_bytes
        self._start: Message | None = None  # held http.response.start
        self._encoder: Encoder | None = None
        self._is_decided = False  # True once the start went out (as it was, or with the encoding)

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            await self._on_start(message)
        elif self._is_decided:
            if self._encoder is not None and message["type"] == "http.response.body":
                await self._send_chunk(message)
            else:
                await self._send(message)
        elif message["type"] == "http.response.body":
            await self._on_first_body(message)
        else:  # another extension's message (pathsend, trailers): let the response go as it is
            await self._release_start()
            await self._send(message)

    async def _on_start(self, message: Message) -> None:
        start = {**message, "headers": list(message.get("headers", []))}
        headers = MutableHeaders(scope=start)
        status = int(start["status"])
        if (
            status < 200
            or status in NO_BODY_STATUSES
            or "content-encoding" in headers
            or "content-range" in headers
            or "no-transform" in headers.get("cache-control", "").lower()
            or not is_compressible(headers.get("content-type", ""))
        ):
            self._start = start
            await self._release_start()
            return
        headers.add_vary_header("Accept-Encoding")
        self._start = start
        if self._encoding is None:
            await self._release_start()

    async def _release_start(self) -> None:
        self._is_decided = True
        if self._start is not None:
            start, self._start = self._start, None
            await self._send(start)

    async def _on_first_body(self, message: Message) -> None:
        assert self._start is not None and self._encoding is not None
        body = message.get("body", b"")
        headers = MutableHeaders(scope=self._start)
        if not message.get("more_body", False):
            if len(body) < self._min_bytes:
                await self._release_start()
                await self._send(message)
                return
            encoder = new_encoder(self._encoding)
            body = encoder.compress(body) + encoder.finish()
            headers["content-encoding"] = self._encoding
            headers["content-length"] = str(len(body))
            await self._release_start()
            await self._send({"type": "http.response.body", "body": body, "more_body": False})
            return
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) < self._min_bytes:
            await self._release_start()
            await self._send(message)
            return
        self._encoder = new_encoder(self._encoding)
        del headers["content-length"]
        headers["content-encoding"] = self._encoding
        await self._release_start()
        await self._send_chunk(message)

    async def _send_chunk(self, message: Message) -> None:
        assert self._encoder is not None
        more_body = message.get("more_body", False)
        data = self._encoder.compress(message.get("body", b""))
        data += self._encoder.flush() if more_body else self._encoder.finish()
        await self._send({"type": "http.response.body", "body": data, "more_body": more_body})
