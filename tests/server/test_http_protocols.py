"""Both HTTP parsers enforce the header limits: a slow or absent head gets 408, a head still growing past
`max_header_bytes` is refused, a kept-alive connection gets the same deadline for its next request, and
ordinary requests (one after another on one connection) are untouched. Each runs a real uvicorn server
on a trivial ASGI app."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn

from bitserve.server import http_protocols
from bitserve.server.http_protocols import http_protocol, resolve_http_parser

HEADER_TIMEOUT_S = 0.5
MAX_HEADER_BYTES = 4096
READ_TIMEOUT_S = 10.0


async def hello_app(scope: dict, receive: object, send: object) -> None:  # type: ignore[type-arg]
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture(params=["h11", "httptools"])
def server_port(request: pytest.FixtureRequest) -> Iterator[int]:
    parser = request.param
    pytest.importorskip(parser)
    config = uvicorn.Config(
        hello_app,
        host="127.0.0.1",
        port=0,
        loop="asyncio",
        log_config=None,
        lifespan="off",
        http=http_protocol(parser, HEADER_TIMEOUT_S, MAX_HEADER_BYTES),
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + READ_TIMEOUT_S
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    yield server.servers[0].sockets[0].getsockname()[1]
    server.should_exit = True
    thread.join(READ_TIMEOUT_S)


def read_until_closed(sock: socket.socket) -> bytes:
    chunks = []
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=READ_TIMEOUT_S)


def test_a_slow_head_gets_408_within_the_deadline(server_port: int) -> None:
    with connect(server_port) as sock:
        start = time.monotonic()
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")  # never finished
        reply = read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 408"), reply[:80]
    assert json.loads(reply.partition(b"\r\n\r\n")[2])["error"]["code"] == "request_timeout"
    assert time.monotonic() - start < READ_TIMEOUT_S / 2  # the server closed it, not our read timeout


def test_a_silent_connection_gets_408(server_port: int) -> None:
    with connect(server_port) as sock:
        assert read_until_closed(sock).startswith(b"HTTP/1.1 408")


def test_a_growing_head_is_refused(server_port: int, request: pytest.FixtureRequest) -> None:
    parser = request.node.callspec.params["server_port"]
    with connect(server_port) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nX-Pad: ")
        with contextlib.suppress(OSError):  # the server may hang up mid-way
            for _ in range(4):  # 16 KiB of an unfinished head, 4x the limit
                sock.sendall(b"a" * 4096)
                time.sleep(0.02)
        reply = read_until_closed(sock)
    if parser == "h11":
        assert reply.startswith(b"HTTP/1.1 400"), reply[:80]  # h11's own buffer limit
    else:  # the httptools protocol says what was wrong
        assert reply.startswith(b"HTTP/1.1 431"), reply[:80]
        assert json.loads(reply.partition(b"\r\n\r\n")[2])["error"]["code"] == "headers_too_large"


def test_requests_on_one_connection_pass_and_the_next_head_has_a_deadline(server_port: int) -> None:
    with connect(server_port) as sock:
        for _ in range(3):
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            time.sleep(HEADER_TIMEOUT_S * 1.5)  # past the deadline: it ran from connect to the head only
            reply = sock.recv(65536)
            assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(b"ok"), reply
        sock.sendall(b"GET / HTTP/1.1\r\n")  # a fourth request that never finishes its head
        assert read_until_closed(sock).startswith(b"HTTP/1.1 408")


def test_auto_picks_httptools_when_installed() -> None:
    pytest.importorskip("httptools")
    assert resolve_http_parser("auto") == "httptools"
    assert resolve_http_parser("h11") == "h11"


def test_settings_refuse_unknown_and_missing_implementations(monkeypatch: pytest.MonkeyPatch) -> None:
    from bitserve import server_config as config

    with pytest.raises(ValueError, match="http_parser must be one of"):
        config.ServerConfig(http_parser="picohttp")
    monkeypatch.setattr(config.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="event_loop uvloop is not installed"):
        config.ServerConfig(event_loop="uvloop")
    with pytest.raises(ValueError, match="http_parser httptools is not installed"):
        config.ServerConfig(http_parser="httptools")
    assert config.ServerConfig().http_parser == "auto"
    monkeypatch.setattr(http_protocols, "_installed", lambda module: False)
    assert resolve_http_parser("auto") == "h11"  # auto falls back to h11 when httptools is missing
