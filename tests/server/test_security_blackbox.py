"""Black box: `bitserve serve` with an auth file, a JWKS, CIDR and proxy rules and an audit log, attacked
over real sockets (path, method, Host and X-Forwarded-For tricks; forged JWTs) and used through the
official `openai` client. Zero bypasses; no credential in the server's log."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
import security_testing as st
from conftest import BLACKBOX_ARGS
from http_testing import REPO_ROOT, ServerProcess, free_port

from bitserve.server.security.audit import verify_chain

SERVED = "a"
TRUSTED_PROXY = "127.0.0.3"
OUTSIDER = "127.0.0.2"  # not in --allow-cidr
SOCKET_TIMEOUT_S = 15.0
ADMIN_PATH_TRICKS = (
    b"//v1/models/load",
    b"/v1/models/load/",
    b"/V1/models/load",
    b"/v1/models/%6Coad",
    b"/v1/./models/load",
    b"/v1/models/chat%2Fswap",
    b"/v1/models/a%2Funload",
    b"/v1/models/load?x=/health/live",
    b"/health/live/../../v1/models/load",
    b"/v1/models/load%00",
    b"/v1/models/load#/health",
)


@pytest.fixture(scope="module")
def signing(tmp_path_factory: pytest.TempPathFactory) -> st.SigningKeys:
    return st.make_signing_keys(tmp_path_factory.mktemp("blackbox-jwks"))


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, tq2_model_path: Path, signing: st.SigningKeys
) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("secured-server")
    args = (
        *("--model", str(tq2_model_path), "--served-model-name", SERVED, "--max-model-len", "128"),
        *("--auth-file", str(st.write_auth_file(folder / "auth.toml"))),
        *(
            "--jwt-jwks-file",
            str(signing.jwks_path),
            "--jwt-issuer",
            st.ISSUER,
            "--jwt-audience",
            st.AUDIENCE,
        ),
        *("--allow-cidr", "127.0.0.1/32", "--trusted-proxy", f"{TRUSTED_PROXY}/32"),
        *("--audit-log", str(folder / "audit.log"), "--log-level", "DEBUG"),
        *BLACKBOX_ARGS,
    )
    process = ServerProcess(folder / "server.log", *args)
    process.audit_path = folder / "audit.log"  # type: ignore[attr-defined]
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


def exchange(server: ServerProcess, request: bytes, source: str | None = None) -> bytes:
    """Send raw bytes (no client-side normalization), read until the server closes."""
    with socket.create_connection(
        ("127.0.0.1", server.port), timeout=SOCKET_TIMEOUT_S, source_address=(source, 0) if source else None
    ) as sock:
        sock.sendall(request)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def status_of(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1])


def raw(method: bytes, target: bytes, headers: bytes = b"", body: bytes = b"{}") -> bytes:
    return (
        method + b" " + target + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
        b"Content-Type: application/json\r\n"
        + headers
        + b"Content-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )


def models_now(server: ServerProcess) -> list[str]:
    listed = httpx.get(f"{server.url}/v1/models", headers=st.bearer("admin"), timeout=30).json()["data"]
    return sorted(model["id"] for model in listed)


@pytest.mark.parametrize("target", ADMIN_PATH_TRICKS)
def test_path_tricks_on_admin_routes(server: ServerProcess, target: bytes) -> None:
    body = b'{"model": "bitnet-TQ2_0", "alias": "x", "wait": true}'
    assert status_of(exchange(server, raw(b"POST", target, body=body))) in (400, 401), target
    reply = exchange(
        server, raw(b"POST", target, b"Authorization: Bearer " + st.key_of("infer").encode() + b"\r\n", body)
    )
    assert status_of(reply) in (400, 403, 404, 405), (target, reply[:300])
    assert models_now(server) == [SERVED]


@pytest.mark.parametrize("method", [b"HEAD", b"OPTIONS", b"PUT", b"DELETE", b"PATCH", b"TRACE"])
def test_other_methods_on_admin_routes(server: ServerProcess, method: bytes) -> None:
    for target in (b"/v1/models/load", b"/v1/models/a/swap", b"/metrics"):
        assert status_of(exchange(server, raw(method, target))) == 401, (method, target)
        key = b"Authorization: Bearer " + st.key_of("infer").encode() + b"\r\n"
        assert status_of(exchange(server, raw(method, target, key))) in (403, 405), (method, target)


END = b"Connection: close\r\nContent-Length: 2\r\n\r\n{}"


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"POST /v1/models/load HTTP/1.1\r\nHost: evil.example\r\n" + END,
        b"POST /v1/models/load HTTP/1.1\r\nHost: localhost:1\r\n" + END,
        b"POST http://evil.example/v1/models/load HTTP/1.1\r\nHost: x\r\n" + END,
        b"POST http://127.0.0.1/health/live HTTP/1.1\r\nHost: x\r\n" + END,
        b"POST /v1/models/load HTTP/1.1\r\nHost: a\r\nHost: b\r\n" + END,
        b"POST /v1/models/load HTTP/1.1\r\n" + END,
        b"POST /v1/models/load HTTP/1.0\r\nContent-Length: 2\r\n\r\n{}",
    ],
    ids=[
        "evil-host",
        "other-port",
        "absolute-uri",
        "absolute-uri-public",
        "two-hosts",
        "no-host",
        "http-1.0",
    ],
)
def test_host_header_games(server: ServerProcess, request_bytes: bytes) -> None:
    assert status_of(exchange(server, request_bytes)) in (400, 401, 404, 405)
    assert models_now(server) == [SERVED]


def test_x_forwarded_for_from_an_untrusted_peer_is_ignored(server: ServerProcess) -> None:
    probe = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
    assert status_of(exchange(server, probe + b"\r\n", OUTSIDER)) == 403
    for spoof in (b"127.0.0.1", b"127.0.0.1, 127.0.0.1", b"10.0.0.1, 127.0.0.1"):
        reply = exchange(server, probe + b"X-Forwarded-For: " + spoof + b"\r\n\r\n", OUTSIDER)
        assert status_of(reply) == 403, spoof
        assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["type"] == "permission_error"
    # through the trusted proxy, the nearest untrusted hop is the client
    assert status_of(exchange(server, probe + b"X-Forwarded-For: 127.0.0.1\r\n\r\n", TRUSTED_PROXY)) == 401
    reply = exchange(
        server, probe + b"X-Forwarded-For: 127.0.0.1, " + OUTSIDER.encode() + b"\r\n\r\n", TRUSTED_PROXY
    )
    assert status_of(reply) == 403
    assert (
        status_of(exchange(server, probe + b"\r\n", TRUSTED_PROXY)) == 403
    )  # the proxy itself is not allowed


@pytest.mark.parametrize(
    "attack",
    [
        "alg_none",
        "hs256_with_rsa_public_key",
        "expired",
        "not_yet_valid",
        "wrong_issuer",
        "wrong_audience",
        "tampered",
    ],
)
def test_forged_jwts_are_refused(server: ServerProcess, signing: st.SigningKeys, attack: str) -> None:
    import time

    now = int(time.time())
    token = {
        "alg_none": lambda: st.unsigned(scope="admin"),
        "hs256_with_rsa_public_key": lambda: st.hs256_with_public_key(signing, scope="admin"),
        "expired": lambda: st.rs256(signing, exp=now - 600, scope="admin"),
        "not_yet_valid": lambda: st.rs256(signing, nbf=now + 600, scope="admin"),
        "wrong_issuer": lambda: st.rs256(signing, iss="https://evil.test", scope="admin"),
        "wrong_audience": lambda: st.rs256(signing, aud="someone-else", scope="admin"),
        "tampered": lambda: st.tampered(st.rs256(signing, scope="inference"), scope="admin"),
    }[attack]()
    response = httpx.post(
        f"{server.url}/v1/models/load",
        json={"model": "x"},
        headers={"Authorization": f"Bearer {token}"},
        timeout=30,
    )
    assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
    assert response.json()["error"]["type"] == "authentication_error"


def test_a_valid_jwt_gets_its_scopes(server: ServerProcess, signing: st.SigningKeys) -> None:
    headers = {"Authorization": f"Bearer {st.es256(signing, scope='inference')}"}
    body = {"model": SERVED, "prompt": "hi", "max_tokens": 2}
    assert (
        httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=60).status_code == 200
    )
    assert httpx.get(f"{server.url}/metrics", headers=headers, timeout=30).status_code == 403


def api(server: ServerProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=60.0)


def test_the_openai_client(server: ServerProcess, signing: st.SigningKeys) -> None:
    with api(server, st.key_of("infer")) as client:
        assert [model.id for model in client.models.list()] == [SERVED]
        completion = client.completions.create(model=SERVED, prompt="hi", max_tokens=3, temperature=0)
        assert completion.usage is not None and completion.usage.completion_tokens >= 1
        with pytest.raises(openai.PermissionDeniedError):
            client.post("/models/load", body={"model": "x"}, cast_to=dict)
    with api(server, "bsk_not_a_key_at_all_00000000000"), pytest.raises(openai.AuthenticationError):
        api(server, "bsk_not_a_key_at_all_00000000000").models.list()
    with api(server, st.key_of("only_a")) as client, pytest.raises(openai.PermissionDeniedError) as denied:
        client.completions.create(model="b", prompt="hi", max_tokens=2)
    assert denied.value.body["type"] == "permission_error"  # type: ignore[index]
    with api(server, st.key_of("reader")) as client, pytest.raises(openai.PermissionDeniedError):
        client.completions.create(model=SERVED, prompt="hi", max_tokens=2)
    with api(server, st.key_of("limited")) as client:
        for _ in range(3):
            client.models.list()
        with pytest.raises(openai.RateLimitError) as limited:
            client.models.list()
        assert int(limited.value.response.headers["retry-after"]) >= 1
    with api(server, st.rs256(signing, scope="inference models:read")) as client:
        assert [model.id for model in client.models.list()] == [SERVED]


def test_security_headers_and_no_server_banner(server: ServerProcess) -> None:
    reply = exchange(server, b"GET /health/live HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    head = reply.split(b"\r\n\r\n", 1)[0].lower()
    assert b"\r\nserver:" not in head and b"x-content-type-options: nosniff" in head
    assert b"cache-control: no-store" in head


def test_the_audit_log_holds_the_refusals(server: ServerProcess) -> None:
    path: Path = server.audit_path  # type: ignore[attr-defined]
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    events = {line["event"] for line in lines}
    assert {"auth_failure", "permission_denied", "rate_limited"} <= events
    assert any(line["source"] == OUTSIDER for line in lines)
    assert verify_chain([str(path)]).error is None
    result = subprocess.run(
        [sys.executable, "-m", "bitserve", "audit", "verify", str(path)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr


def test_no_credential_reaches_the_log(server: ServerProcess, signing: st.SigningKeys) -> None:
    """Runs last in this module: every key and token above was sent by now (DEBUG logging on)."""
    log = server.log_path.read_text(errors="replace")
    for name in st.KEYS:
        assert st.key_of(name) not in log
    assert "eyJ" not in log  # no JWT, whole or in part


def test_a_public_bind_without_auth_refuses_to_start(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "bitserve", "serve", "--host", "0.0.0.0", "--port", str(free_port())],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    for flag in ("--api-key", "--auth-file", "--allow-unauthenticated"):
        assert flag in result.stderr


def test_keys_create_prints_a_key_and_its_block() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "bitserve",
            "keys",
            "create",
            "--name",
            "ci",
            "--scopes",
            "inference,models:read",
            "--json",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    created = json.loads(result.stdout)
    from bitserve.server.security.keys import hash_key

    assert created["key"].startswith("bsk_") and hash_key(created["key"]) in created["toml"]
    assert (
        created["key"] not in created["toml"] and 'scopes = ["inference", "models:read"]' in created["toml"]
    )


def test_models_cli_sends_its_api_key(server: ServerProcess, capsys: pytest.CaptureFixture[str]) -> None:
    from bitserve.cli.main import main

    assert main(["models", "--url", server.url, "list"]) == 2  # no key: 401, reported, exit 2
    assert main(["models", "--url", server.url, "--api-key", st.key_of("reader"), "--json", "list"]) == 0
    assert SERVED in capsys.readouterr().out


def test_the_anthropic_sdk_authenticates_with_x_api_key(server: ServerProcess) -> None:
    """Anthropic clients send `x-api-key`; refusals come back in Anthropic's error shape."""
    question = [{"role": "user", "content": "hi"}]

    def claude(key: str | None) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=server.url, api_key=key or "", max_retries=0, timeout=30.0)

    with pytest.raises(anthropic.AuthenticationError) as unauthenticated:
        claude("bsk_not_a_key").messages.count_tokens(model=SERVED, messages=question)
    assert unauthenticated.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.PermissionDeniedError) as forbidden:
        claude(st.key_of("reader")).messages.create(model=SERVED, max_tokens=4, messages=question)
    assert forbidden.value.body["error"]["type"] == "permission_error"
    # the inference key passes; the synthetic model has no chat template, which is the 400 it gets
    with pytest.raises(anthropic.BadRequestError) as past_auth:
        claude(st.key_of("infer")).messages.count_tokens(model=SERVED, messages=question)
    assert "template" in past_auth.value.body["error"]["message"]
