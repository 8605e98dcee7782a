"""CompressionMiddleware as a unit, on raw ASGI messages: Accept-Encoding negotiation (q-values, `*`,
`identity`, br preferred on a tie), the threshold, what is never encoded (SSE, encoded bodies, 204, HEAD,
no-transform), Vary, and a streamed body compressed chunk by chunk with nothing held back. The real
sockets (HTTP/1.1 and HTTP/2, the served JSON, SSE) are tests/server/test_http2_serving.py."""

from __future__ import annotations

import asyncio
import gzip
import json
import zlib
from typing import Any

import brotli
import pytest

from bitserve.server.compression import CompressionMiddleware, choose_encoding

MIN_BYTES = 1024
BIG_JSON = json.dumps({"data": [{"index": i, "embedding": [0.25] * 16} for i in range(40)]}).encode()


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        ("", None),
        ("gzip", "gzip"),
        ("br", "br"),
        ("gzip, br", "br"),  # a tie: br
        ("gzip;q=1.0, br;q=0.5", "gzip"),
        ("br;q=0, gzip", "gzip"),
        ("identity", None),
        ("gzip;q=0.4, identity;q=0.9", None),  # the client prefers the body as it is
        ("*", "br"),
        ("*;q=0.5, br;q=0", "gzip"),
        ("deflate, compress", None),
        ("GZIP;Q=0.7", "gzip"),
        ("gzip;q=bogus", None),
        ("x-gzip", "gzip"),
    ],
)
def test_choose_encoding(header: str, expected: str | None) -> None:
    assert choose_encoding(header) == expected


def app_sending(*messages: dict[str, Any]) -> Any:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        for message in messages:
            await send(message)

    return app


def start(content_type: str, status: int = 200, **extra: str) -> dict[str, Any]:
    headers = [(b"content-type", content_type.encode())]
    headers += [(name.replace("_", "-").encode(), value.encode()) for name, value in extra.items()]
    return {"type": "http.response.start", "status": status, "headers": headers}


def body(data: bytes, more: bool = False) -> dict[str, Any]:
    return {"type": "http.response.body", "body": data, "more_body": more}


def run(app: Any, accept: str = "gzip, br", method: str = "GET") -> list[dict[str, Any]]:
    """The messages the middleware sends for one request (each body message as it was sent)."""
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": method,
        "path": "/",
        "headers": [(b"accept-encoding", accept.encode())],
    }
    middleware = CompressionMiddleware(app, min_bytes=MIN_BYTES)
    asyncio.run(middleware(scope, None, send))
    return sent


def headers_of(messages: list[dict[str, Any]]) -> dict[str, str]:
    return {name.decode(): value.decode() for name, value in messages[0]["headers"]}


def decoded_body(messages: list[dict[str, Any]], encoding: str | None) -> bytes:
    data = b"".join(message["body"] for message in messages[1:])
    if encoding == "gzip":
        return gzip.decompress(data)
    return brotli.decompress(data) if encoding == "br" else data


@pytest.mark.parametrize("accept", ["gzip", "br", "identity"])
def test_a_json_body_over_the_threshold_is_encoded_as_asked(accept: str) -> None:
    sent = run(app_sending(start("application/json"), body(BIG_JSON)), accept=accept)
    headers = headers_of(sent)
    encoding = None if accept == "identity" else accept
    assert headers.get("content-encoding") == encoding and headers["vary"] == "Accept-Encoding"
    if encoding is not None:
        assert int(headers["content-length"]) == len(sent[1]["body"]) < len(BIG_JSON) / 3
    assert decoded_body(sent, encoding) == BIG_JSON


def test_a_body_under_the_threshold_goes_as_it_is_with_vary() -> None:
    small = b'{"ok": true}'
    sent = run(app_sending(start("application/json", content_length=str(len(small))), body(small)))
    headers = headers_of(sent)
    assert "content-encoding" not in headers and headers["vary"] == "Accept-Encoding"
    assert sent[1]["body"] == small


@pytest.mark.parametrize(
    "response_start",
    [
        start("text/event-stream; charset=utf-8"),
        start("application/json", content_encoding="gzip"),
        start("application/json", cache_control="no-transform"),
        start("image/png"),
        start("application/json", status=206, content_range="bytes 0-9/100"),
    ],
    ids=["sse", "already-encoded", "no-transform", "binary", "partial"],
)
def test_never_encoded(response_start: dict[str, Any]) -> None:
    chunks = [body(BIG_JSON[:2000], more=True), body(BIG_JSON[2000:])]
    sent = run(app_sending(response_start, *chunks))
    assert sent == [response_start, *chunks]  # byte for byte, message for message, no Vary


def test_head_and_204_are_not_encoded() -> None:
    sent = run(app_sending(start("application/json"), body(BIG_JSON)), method="HEAD")
    assert "content-encoding" not in headers_of(sent) and sent[1]["body"] == BIG_JSON
    sent = run(app_sending(start("application/json", status=204), body(b"")))
    assert "content-encoding" not in headers_of(sent)


@pytest.mark.parametrize("encoding", ["gzip", "br"])
def test_a_streamed_body_is_compressed_chunk_by_chunk(encoding: str) -> None:
    """Each chunk the app sends leaves compressed and flushed: it decodes on arrival, nothing waits."""
    pieces = [BIG_JSON[i : i + 700] for i in range(0, len(BIG_JSON), 700)]
    chunks = [body(piece, more=True) for piece in pieces] + [body(b"")]
    sent = run(
        app_sending(start("application/x-ndjson", content_length=str(len(BIG_JSON))), *chunks), encoding
    )
    headers = headers_of(sent)
    assert headers["content-encoding"] == encoding and "content-length" not in headers
    assert len(sent) == len(chunks) + 1
    decoder: Any = zlib.decompressobj(16 + zlib.MAX_WBITS) if encoding == "gzip" else brotli.Decompressor()
    for piece, message in zip(pieces, sent[1:], strict=False):
        decoded = (
            decoder.decompress(message["body"]) if encoding == "gzip" else decoder.process(message["body"])
        )
        assert decoded == piece
    assert decoded_body(sent, encoding) == BIG_JSON


def test_a_stream_declaring_a_small_length_goes_as_it_is() -> None:
    chunks = [body(b'{"a":', more=True), body(b"1}")]
    sent = run(app_sending(start("application/json", content_length="7"), *chunks))
    assert "content-encoding" not in headers_of(sent) and sent[1:] == chunks
