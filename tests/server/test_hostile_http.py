"""Hostile requests get a clear 4xx (never a 500, a hang or a crash): malformed bodies, wrong types,
NaN, extreme numbers, bad UTF-8, oversized and slow bodies, slow headers, path traversal."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from http_testing import ServerProcess

from bitserve.server.limits import BodyLimitMiddleware

ERROR_KEYS = {"message", "type", "param", "code", "hint"}
SOCKET_TIMEOUT_S = 15.0


def error_of(response: object, status: int) -> dict[str, object]:
    assert response.status_code == status, response.text  # type: ignore[attr-defined]
    error = response.json()["error"]  # type: ignore[attr-defined]
    assert set(error) == ERROR_KEYS
    return error


@pytest.mark.parametrize(
    "body",
    [
        b"{",
        b'{"prompt": "x",}',
        b'{"prompt": "x"} trailing',
        b"[1, 2]",
        b'"just a string"',
        b"",
        b"   ",
        b"null",
        b"\xff\xfe{}",
        b'{"prompt": "caf\xc3"}',  # bad UTF-8
        b'{"prompt": "x", "temperature": NaN}',
        b'{"prompt": "x", "temperature": Infinity}',
        b'{"prompt": "x", "top_p": -Infinity}',
        b'{"prompt": "x", "temperature": 1e999}',
        b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}",  # past Python's int-digit limit
        b'{"prompt": ' + b"[" * 20_000 + b"]" * 20_000 + b"}",  # nesting deeper than the parser allows
    ],
    ids=lambda body: repr(body[:24]),
)
def test_malformed_bodies_get_400(client: TestClient, body: bytes) -> None:
    error = error_of(
        client.post("/v1/completions", content=body, headers={"content-type": "application/json"}), 400
    )
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": "hi"}, "messages"),
        ({"messages": [["user", "hi"]]}, "messages[0]"),
        ({"messages": [{"role": "user", "content": 42}]}, "messages[0].content"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}] * 513}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "stop": ["s"] * 17}, "stop"),
        ({"messages": [{"role": "user", "content": "x"}], "n": -1}, "n"),
        ({"messages": [{"role": "user", "content": "x"}], "seed": 2**70}, "seed"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": -0.1}, "temperature"),
        (
            {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3},
            "top_logprobs",
        ),  # needs logprobs
        (
            {"messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": True}},
            "stream_options",
        ),
    ],
)
def test_wrong_types_and_bounds_get_400(client: TestClient, body: dict[str, object], param: str) -> None:
    assert error_of(client.post("/v1/chat/completions", json=body), 400)["param"] == param


def test_oversized_bodies_get_413(client: TestClient) -> None:
    big = b'{"prompt": "' + b"a" * 70_000 + b'"}'
    error = error_of(client.post("/v1/completions", content=big), 413)
    assert error["code"] == "payload_too_large"

    def chunked() -> Iterator[bytes]:  # no Content-Length: the limit applies as the bytes arrive
        yield b'{"prompt": "'
        for _ in range(20):
            yield b"a" * 4096
        yield b'"}'

    assert error_of(client.post("/v1/completions", content=chunked()), 413)["code"] == "payload_too_large"


def test_slow_body_gets_408_and_close() -> None:
    """BodyLimitMiddleware alone, fed by a receive() that trickles chunks 0.6 s apart (1 s deadline)."""
    chunks = [b'{"prompt": ', b'"hello", ', b'"max_tokens": 2}']
    sent: list[dict[str, object]] = []
    is_app_called = False

    async def receive() -> dict[str, object]:
        await asyncio.sleep(0.6)
        chunk = chunks.pop(0)
        return {"type": "http.request", "body": chunk, "more_body": bool(chunks)}

    async def send(message: dict[str, object]) -> None:
        sent.append(message)

    async def app(scope: object, receive: object, send: object) -> None:
        nonlocal is_app_called
        is_app_called = True

    middleware = BodyLimitMiddleware(app, max_body_bytes=1024, body_read_timeout_s=1.0, max_header_bytes=4096)
    asyncio.run(middleware({"type": "http", "method": "POST", "headers": []}, receive, send))
    assert not is_app_called
    assert sent[0]["status"] == 408
    assert (b"connection", b"close") in sent[0]["headers"]  # type: ignore[operator]
    assert json.loads(sent[1]["body"])["error"]["code"] == "request_timeout"  # type: ignore[arg-type]


def test_unknown_routes_and_methods(client: TestClient) -> None:
    assert error_of(client.get("/v2/anything"), 404)["code"] == "not_found"
    assert error_of(client.get("/v1/completions"), 405)["code"] == "method_not_allowed"


@pytest.mark.parametrize(
    "path",
    [
        "/v1/models/..%2F..%2Fetc%2Fpasswd",
        "/v1/models/%2e%2e%2f%2e%2e%2fetc%2fpasswd",
        "/v1/models/....//....//etc/passwd",
        "/v1/models/%00",
        "/v1/models/bitnet-TQ2_0/../../../etc/passwd",
    ],
)
def test_path_traversal_in_model_ids_is_404(client: TestClient, path: str) -> None:
    response = client.get(path)
    assert response.status_code == 404
    assert "root:" not in response.text


# ----------------------------------------------------------------- raw sockets against `bitserve serve`


def exchange(server: ServerProcess, data: bytes, *, pause_s: float = 0.0, more: bytes = b"") -> bytes:
    """Send `data`, wait `pause_s`, send `more`, then read until the server closes the connection."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=SOCKET_TIMEOUT_S) as sock:
        sock.sendall(data)
        time.sleep(pause_s)
        if more:
            try:
                sock.sendall(more)
            except OSError:
                pass  # already closed by the server
        chunks = []
        while True:
            try:
                chunk = sock.recv(65536)
            except (ConnectionResetError, TimeoutError):
                break
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)


def test_slow_headers_are_cut_off(blackbox: ServerProcess) -> None:
    start = time.monotonic()
    reply = exchange(
        blackbox, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    )
    assert reply.startswith(b"HTTP/1.1 408")
    assert time.monotonic() - start < SOCKET_TIMEOUT_S  # closed by the server, not by our read timeout
    assert exchange(blackbox, b"").startswith(b"HTTP/1.1 408")  # a connection that sends nothing at all


def test_slow_body_is_cut_off_and_closed(blackbox: ServerProcess) -> None:
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
        b"Content-Type: application/json\r\nContent-Length: 40\r\n\r\n"
    )
    reply = exchange(blackbox, head + b'{"prompt": ', pause_s=3.0, more=b'"hello", "max_tokens": 2}')
    assert reply.startswith(b"HTTP/1.1 408")
    assert b"connection: close" in reply.lower()


def test_huge_headers_are_refused(blackbox: ServerProcess) -> None:
    # 431 when the whole head arrives at once (the middleware measures it); an incomplete head that
    # outgrows the limit gets 431 from the httptools protocol (400 from h11's own buffer limit)
    reply = exchange(blackbox, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 40_000 + b"\r\n\r\n")
    assert reply.startswith((b"HTTP/1.1 431", b"HTTP/1.1 400")), reply[:100]
    with socket.create_connection(("127.0.0.1", blackbox.port), timeout=SOCKET_TIMEOUT_S) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nX-Pad: ")
        with contextlib.suppress(OSError):  # the server may hang up mid-way
            for _ in range(10):  # 40 KiB of an unfinished head, in pieces: the 16 KiB limit trips
                sock.sendall(b"a" * 4096)
                time.sleep(0.05)
        assert sock.recv(65536).startswith((b"HTTP/1.1 431", b"HTTP/1.1 400"))


def test_raw_dot_segments_never_reach_files(blackbox: ServerProcess) -> None:
    for target in (
        b"/v1/models/../../../../etc/passwd",
        b"/v1/models/..%2f..%2fetc%2fpasswd",
        b"/../../etc/passwd",
    ):
        reply = exchange(blackbox, b"GET " + target + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert reply.startswith(b"HTTP/1.1 404"), reply[:200]
        assert b"root:" not in reply
