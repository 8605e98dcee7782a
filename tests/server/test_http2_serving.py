"""`bitserve serve --http2` over real sockets: hypercorn serves HTTP/2 with prior knowledge (h2c) and
HTTP/1.1 on one plain port, h2 or http/1.1 by ALPN over TLS; SSE streams frame by frame over HTTP/2;
gzip and br bodies decode to the identity JSON while an SSE stream asked for gzip is sent unencoded and
arrives before its generation ends; the limits, the access log, /v1/ws and the SIGTERM drain hold.
Two servers: one plain (module scope), one on TLS (its test ends it with the drain)."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import re
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from http_testing import ServerProcess, chat_body, parse_stream
from websockets.asyncio.client import connect

MIN_BYTES = 128  # --compression-min-bytes: small enough that an error body is compressed too
MAX_BODY_BYTES = 65536


def chat(max_tokens: int, *, stream: bool, **extra: Any) -> dict[str, Any]:
    return chat_body(max_tokens, stream=stream, temperature=0, **extra)  # greedy: the same JSON each time


@pytest.fixture(scope="module")
def h2_server(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Iterator[ServerProcess]:
    server = ServerProcess(
        tmp_path_factory.mktemp("http2") / "server.log",
        "--http2",
        "--compression-min-bytes",
        str(MIN_BYTES),
        "--max-body-bytes",
        str(MAX_BODY_BYTES),
        "--no-warmup",
    )
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def timed_stream(client: httpx.Client, body: dict[str, Any], **headers: str) -> tuple[httpx.Response, list]:
    """(response, [(seconds since the request, line)]) of one SSE request, each line timed on arrival."""
    started = time.monotonic()
    with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
        lines = [(time.monotonic() - started, line) for line in response.iter_lines()]
    return response, lines


def assert_streamed_incrementally(lines: list[tuple[float, str]]) -> None:
    """Ends with [DONE], and its first content chunk arrived well before [DONE] (not one buffered body)."""
    chunks, is_done = parse_stream([line for _, line in lines])
    assert is_done and len(chunks) >= 10, lines
    data_times = [at for at, line in lines if line.startswith("data: ")]
    assert data_times[-1] - data_times[0] > 0.1, data_times  # 24 tokens decode over hundreds of ms
    assert len({round(at, 3) for at in data_times}) > len(data_times) // 2, data_times


def test_h2c_prior_knowledge_serves_chat_and_sse(h2_server: ServerProcess) -> None:
    with httpx.Client(base_url=h2_server.url, http1=False, http2=True, timeout=60.0) as client:
        answer = client.post("/v1/chat/completions", json=chat(8, stream=False))
        assert answer.http_version == "HTTP/2" and answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["content"]
        response, lines = timed_stream(client, chat(24, stream=True, ignore_eos=True))
    assert response.http_version == "HTTP/2" and response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert_streamed_incrementally(lines)
    # hypercorn's access line, in uvicorn's shape, with the request's id
    request_id = response.headers["x-request-id"]
    pattern = (
        rf'hypercorn\.access \[{request_id}\]: 127\.0\.0\.1:\d+ - "POST /v1/chat/completions HTTP/2" 200'
    )
    deadline = time.monotonic() + 5.0
    while not re.search(pattern, h2_server.log_tail(100_000)):
        assert time.monotonic() < deadline, h2_server.log_tail()
        time.sleep(0.05)


def test_http11_on_the_same_port_and_websocket(h2_server: ServerProcess) -> None:
    with httpx.Client(base_url=h2_server.url, timeout=60.0) as client:
        response, lines = timed_stream(client, chat(24, stream=True, ignore_eos=True))
    assert response.http_version == "HTTP/1.1" and response.status_code == 200
    assert_streamed_incrementally(lines)

    async def over_ws() -> list[dict[str, Any]]:
        url = h2_server.url.replace("http://", "ws://") + "/v1/ws"
        async with connect(url) as ws:
            await ws.send(json.dumps({"type": "chat.completions", "id": "a", "body": chat(6, stream=True)}))
            messages = []
            while not messages or messages[-1]["type"] not in ("done", "error"):
                messages.append(json.loads(await asyncio.wait_for(ws.recv(), 30)))
            return messages

    messages = asyncio.run(over_ws())
    assert messages[-1] == {"type": "done", "id": "a", "status": "completed"}, messages
    assert any(message["type"] == "chunk" for message in messages)


@pytest.mark.parametrize("http2", [False, True], ids=["http1", "h2c"])
def test_gzip_and_br_bodies_decode_to_the_identity_json(h2_server: ServerProcess, http2: bool) -> None:
    body = chat(48, stream=False, ignore_eos=True, logprobs=True, top_logprobs=3)  # a body of ~10 KiB
    decoded = {}
    with httpx.Client(base_url=h2_server.url, http1=not http2, http2=http2, timeout=60.0) as client:
        for accept, expected in (("identity", None), ("gzip", "gzip"), ("br;q=0.9, gzip;q=0.8", "br")):
            response = client.post("/v1/chat/completions", json=body, headers={"accept-encoding": accept})
            assert response.status_code == 200, response.text
            assert response.headers.get("content-encoding") == expected
            assert "accept-encoding" in response.headers["vary"].lower()
            if expected is not None:  # on the wire: compressed, and smaller than what it decodes to
                assert response.num_bytes_downloaded < len(response.content) / 2
            payload = response.json()
            for volatile in ("id", "created"):
                payload.pop(volatile)
            decoded[accept] = payload
    assert decoded["gzip"] == decoded["identity"] == decoded["br;q=0.9, gzip;q=0.8"]


def test_compression_of_metrics_errors_and_small_bodies(h2_server: ServerProcess) -> None:
    with httpx.Client(base_url=h2_server.url, http1=False, http2=True, timeout=30.0) as client:
        metrics = client.get("/metrics", headers={"accept-encoding": "gzip"})
        assert metrics.headers["content-encoding"] == "gzip"
        assert metrics.status_code == 200 and "# TYPE bitserve_" in metrics.text  # Prometheus text, decoded
        error = client.post(
            "/v1/chat/completions",
            json={**chat(4, stream=False), "temperature": 9},
            headers={"accept-encoding": "br"},
        )
        assert error.status_code == 400 and error.headers["content-encoding"] == "br"
        assert error.json()["error"]["param"] == "temperature"
        gzip_only = {"accept-encoding": "gzip"}
        small = client.post("/tokenize", json={"prompt": "hi"}, headers=gzip_only)
        large = client.post("/tokenize", json={"prompt": "hi " * 100}, headers=gzip_only)
        assert small.status_code == large.status_code == 200
        assert len(small.content) < MIN_BYTES and "content-encoding" not in small.headers
        assert len(large.content) >= MIN_BYTES and large.headers["content-encoding"] == "gzip"
        assert large.json()["tokens"][: len(small.json()["tokens"])] == small.json()["tokens"]
        # a 413 answered before its body arrived leaves the HTTP/2 connection (and its other streams) up
        too_big = client.post("/v1/completions", content=b"x" * (MAX_BODY_BYTES * 4))
        assert too_big.status_code == 413 and too_big.json()["error"]["code"]
        again = client.post("/tokenize", json={"prompt": "hi"})
        assert again.status_code == 200 and again.http_version == "HTTP/2"


@pytest.mark.parametrize("http2", [False, True], ids=["http1", "h2c"])
def test_sse_asked_for_gzip_is_not_encoded_and_streams(h2_server: ServerProcess, http2: bool) -> None:
    with httpx.Client(base_url=h2_server.url, http1=not http2, http2=http2, timeout=60.0) as client:
        response, lines = timed_stream(
            client, chat(24, stream=True, ignore_eos=True), **{"accept-encoding": "gzip, br"}
        )
    assert response.status_code == 200 and "content-encoding" not in response.headers
    assert_streamed_incrementally(lines)


def test_a_head_past_max_header_bytes_gets_431(h2_server: ServerProcess) -> None:
    head = f"GET /health/live HTTP/1.1\r\nhost: x\r\nx-filler: {'a' * 20_000}\r\n\r\n".encode()
    with socket.create_connection(("127.0.0.1", h2_server.port), timeout=10) as sock:
        sock.sendall(head)
        reply = sock.recv(4096)
    assert reply.startswith(b"HTTP/1.1 431"), reply


def self_signed_cert(folder: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False
        )
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return cert_path, key_path


def wait_ready_tls(
    server: ServerProcess, url: str, context: ssl.SSLContext, timeout_s: float = 180.0
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert server.process.poll() is None, server.log_tail()
        try:
            if httpx.get(f"{url}/health/ready", verify=context, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise AssertionError(f"TLS server not ready:\n{server.log_tail()}")


def test_tls_alpn_h2_and_http11_then_sigterm_drains_an_h2_stream(tmp_path: Path, smollm2_path: Path) -> None:
    cert, key = self_signed_cert(tmp_path)
    server = ServerProcess(
        tmp_path / "server.log",
        "--http2",
        "--ssl-certfile",
        str(cert),
        "--ssl-keyfile",
        str(key),
        "--no-warmup",
    )
    url = f"https://127.0.0.1:{server.port}"
    context = ssl.create_default_context(cafile=str(cert))
    try:
        wait_ready_tls(server, url, context)
        with httpx.Client(base_url=url, verify=context, http2=True, timeout=60.0) as h2:
            response, lines = timed_stream(h2, chat(24, stream=True, ignore_eos=True))
            assert response.http_version == "HTTP/2"  # chosen by ALPN
            assert_streamed_incrementally(lines)
        with httpx.Client(base_url=url, verify=context, timeout=60.0) as h1:  # offers http/1.1 alone
            answer = h1.post("/v1/chat/completions", json=chat(4, stream=False))
            assert answer.http_version == "HTTP/1.1" and answer.status_code == 200
        with httpx.Client(base_url=url, verify=context, http2=True, timeout=120.0) as h2:
            with h2.stream(
                "POST", "/v1/chat/completions", json=chat(48, stream=True, ignore_eos=True)
            ) as stream:
                lines_iter = stream.iter_lines()
                first = [next(lines_iter) for _ in range(2)]
                server.terminate()  # mid-stream: the drain lets it finish
                rest = list(lines_iter)
        chunks, is_done = parse_stream([*first, *rest])
        assert is_done and chunks[-1]["choices"][0]["finish_reason"] == "length", rest[-3:]
        assert server.wait_exit(60) == 0, server.log_tail()
        assert "drained: no requests in flight" in server.log_tail(100_000)
    finally:
        server.stop()
