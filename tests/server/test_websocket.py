"""/v1/ws over a real socket (uvicorn in a thread, the `websockets` client): streamed text equals the HTTP
greedy answer, two requests at once on one socket, cancel mid-stream (the engine lets go of the
request), authentication in the upgrade header or the first message, per-request limits, and errors
that leave the socket open. Chat runs against the black-box SmolLM2 server (the synthetic model has no
chat template)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import security_testing as st
from http_testing import ServerProcess, free_port
from lifecycle_testing import ThreadServer
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from bitserve.config import EngineConfig, ModelConfig, SchedulerConfig, ServerConfig
from bitserve.server.security.config import SecurityConfig

MAX_WS_REQUESTS = 2
PROMPTS = ("The quick brown fox", "Once upon a time")
GREEDY = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tq2_model_path: Path) -> Iterator[ThreadServer]:
    folder = tmp_path_factory.mktemp("ws")
    auth_file = st.write_auth_file(folder / "auth.toml")
    config = ServerConfig(port=free_port(), ws_max_requests=MAX_WS_REQUESTS, body_read_timeout_s=5.0)
    engine = EngineConfig(
        model=ModelConfig(model=str(tq2_model_path)), scheduler=SchedulerConfig(max_model_len=128)
    )
    security = SecurityConfig(auth_file=str(auth_file), audit_log=str(folder / "audit.log"))
    thread_server = ThreadServer(config, engine, security=security)
    thread_server.audit_path = folder / "audit.log"  # type: ignore[attr-defined]
    thread_server.start()
    yield thread_server
    thread_server.stop()


def ws_url(base: str) -> str:
    return base.replace("http://", "ws://") + "/v1/ws"


def request(request_id: str, body: dict[str, Any], kind: str = "completions") -> str:
    return json.dumps({"type": kind, "id": request_id, "body": body})


async def read_until_done(socket: ClientConnection, ids: set[str]) -> list[dict[str, Any]]:
    """Every message until each of `ids` has its done message."""
    messages: list[dict[str, Any]] = []
    pending = set(ids)
    while pending:
        message = json.loads(await asyncio.wait_for(socket.recv(), 30))
        messages.append(message)
        if message["type"] == "done":
            pending.discard(message["id"])
    return messages


def streamed_text(messages: list[dict[str, Any]], request_id: str, field: str = "text") -> str:
    chunks = [m["data"] for m in messages if m["type"] == "chunk" and m["id"] == request_id]
    return "".join(choice.get(field) or "" for chunk in chunks for choice in chunk["choices"])


def done_status(messages: list[dict[str, Any]], request_id: str) -> str:
    (done,) = [m for m in messages if m["type"] == "done" and m["id"] == request_id]
    return str(done["status"])


def http_text(url: str, prompt: str) -> str:
    response = httpx.post(
        f"{url}/v1/completions", json={"prompt": prompt, **GREEDY}, headers=st.bearer("infer"), timeout=60
    )
    response.raise_for_status()
    return str(response.json()["choices"][0]["text"])


def test_two_concurrent_streams_equal_the_http_greedy_answers(server: ThreadServer) -> None:
    expected = {f"r{i}": http_text(server.url, prompt) for i, prompt in enumerate(PROMPTS)}

    async def scenario() -> list[dict[str, Any]]:
        async with connect(ws_url(server.url), additional_headers=st.bearer("infer")) as socket:
            for i, prompt in enumerate(PROMPTS):
                await socket.send(request(f"r{i}", {"prompt": prompt, **GREEDY}))
            return await read_until_done(socket, set(expected))

    messages = asyncio.run(scenario())
    for request_id, text in expected.items():
        assert streamed_text(messages, request_id) == text and text
        assert done_status(messages, request_id) == "completed"
    kinds = [(m["type"], m["id"]) for m in messages]
    # both were in flight at once: the second's first chunk came before the first's done
    assert kinds.index(("chunk", "r1")) < kinds.index(("done", "r0"))
    chunk = next(m["data"] for m in messages if m["type"] == "chunk")
    assert chunk["object"] == "text_completion" and chunk["id"].startswith("cmpl-")


def test_cancel_mid_stream_aborts_the_sequence(server: ThreadServer) -> None:
    engines = list(server.state.models.serving_engines())
    long = {"prompt": "Count with me", "max_tokens": 100, "temperature": 0, "ignore_eos": True}

    async def scenario() -> list[dict[str, Any]]:
        async with connect(ws_url(server.url), additional_headers=st.bearer("infer")) as socket:
            await socket.send(request("long", long))
            first = json.loads(await asyncio.wait_for(socket.recv(), 30))
            assert first["type"] == "chunk"
            assert sum(engine.num_active_requests for engine in engines) == 1
            await socket.send(json.dumps({"type": "cancel", "id": "long"}))
            return [first, *await read_until_done(socket, {"long"})]

    messages = asyncio.run(scenario())
    assert done_status(messages, "long") == "cancelled"
    num_chunks = sum(1 for m in messages if m["type"] == "chunk")
    assert num_chunks < long["max_tokens"]
    assert sum(engine.num_active_requests for engine in engines) == 0
    deadline = time.monotonic() + 5
    while any(e.instance.engine.has_unfinished_requests() for e in engines) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not any(engine.instance.engine.has_unfinished_requests() for engine in engines)
    metrics = httpx.get(f"{server.url}/metrics", headers=st.bearer("admin")).text
    assert (
        'bitserve_requests_aborted_total{reason="abort"}' in metrics or "requests_aborted_total{" in metrics
    )


def test_errors_leave_the_socket_open(server: ThreadServer) -> None:
    async def scenario() -> list[dict[str, Any]]:
        async with connect(ws_url(server.url), additional_headers=st.bearer("infer")) as socket:
            await socket.send("{not json")
            await socket.send(json.dumps({"type": "translate", "id": "x"}))
            await socket.send(json.dumps({"type": "cancel", "id": "nothing"}))
            await socket.send(request("bad", {"prompt": "hi", "max_tokens": -1}))
            await socket.send(
                request("chat", {"messages": [{"role": "user", "content": "hi"}]}, "chat.completions")
            )
            failed = await read_until_done(socket, {"bad", "chat"})  # (two in flight at most)
            await socket.send(request("ok", {"prompt": "hi", **GREEDY}))
            return failed + await read_until_done(socket, {"ok"})

    messages = asyncio.run(scenario())
    anonymous = [m for m in messages if m["type"] == "error" and m["id"] is None]
    assert [m["status"] for m in anonymous] == [400, 400, 400]
    assert "not valid JSON" in anonymous[0]["error"]["message"]
    assert anonymous[1]["error"]["param"] == "type" and anonymous[2]["error"]["param"] == "id"
    (bad,) = [m for m in messages if m["type"] == "error" and m["id"] == "bad"]
    assert bad["status"] == 400 and bad["error"]["param"] == "max_tokens"
    assert done_status(messages, "bad") == "failed" and done_status(messages, "chat") == "failed"
    assert done_status(messages, "ok") == "completed" and streamed_text(messages, "ok")


def test_requests_per_socket_are_bounded(server: ThreadServer) -> None:
    long = {"prompt": "Go on", "max_tokens": 60, "temperature": 0, "ignore_eos": True}

    async def scenario() -> list[dict[str, Any]]:
        async with connect(ws_url(server.url), additional_headers=st.bearer("infer")) as socket:
            for index in range(MAX_WS_REQUESTS + 1):
                await socket.send(request(f"n{index}", long))
            return await read_until_done(socket, {f"n{index}" for index in range(MAX_WS_REQUESTS + 1)})

    messages = asyncio.run(scenario())
    (refused,) = [m for m in messages if m["type"] == "error"]
    assert refused["id"] == f"n{MAX_WS_REQUESTS}", refused
    assert refused["status"] == 429 and refused["retry_after_s"] >= 1
    assert [done_status(messages, f"n{i}") for i in range(MAX_WS_REQUESTS)] == ["completed"] * MAX_WS_REQUESTS


def test_authentication(server: ThreadServer) -> None:
    url = ws_url(server.url)
    for headers in (
        {"Authorization": "Bearer bsk_wrong"},
        st.bearer("reader"),
    ):  # bad key; no inference scope
        with pytest.raises(InvalidStatus) as refused:
            asyncio.run(_open(url, headers))
        assert refused.value.response.status_code == 403

    async def without_key() -> tuple[dict[str, Any], int | None]:
        async with connect(url) as socket:
            await socket.send(request("r", {"prompt": "hi", **GREEDY}))
            error = json.loads(await asyncio.wait_for(socket.recv(), 10))
            with pytest.raises(ConnectionClosed):
                await asyncio.wait_for(socket.recv(), 10)
            return error, socket.close_code

    error, close_code = asyncio.run(without_key())
    assert error["status"] == 401 and error["error"]["type"] == "authentication_error" and close_code == 1008

    async def token_in_first_message() -> list[dict[str, Any]]:
        async with connect(url) as socket:
            await socket.send(json.dumps({"type": "auth", "token": st.key_of("infer")}))
            await socket.send(request("r", {"prompt": "hi", **GREEDY}))
            return await read_until_done(socket, {"r"})

    assert done_status(asyncio.run(token_in_first_message()), "r") == "completed"
    audit = [json.loads(line) for line in server.audit_path.read_text().splitlines()]  # type: ignore[attr-defined]
    refusals = [
        (entry["event"], entry["outcome"])
        for entry in audit
        if "ws" in str(entry.get("path") or entry.get("route"))
    ]
    # the bad key and the scopeless key at the upgrade, the missing token in the first message
    assert refusals == [("auth_failure", 401), ("permission_denied", 403), ("auth_failure", 401)], audit


def test_rate_limits_apply_per_request(server: ThreadServer) -> None:
    async def scenario() -> list[dict[str, Any]]:
        async with connect(ws_url(server.url), additional_headers=st.bearer("limited")) as socket:
            messages = []
            for index in range(4):  # the key's limit: 3 requests a minute
                await socket.send(request(f"q{index}", {"prompt": "hi", "max_tokens": 1}))
                messages += await read_until_done(socket, {f"q{index}"})
            return messages

    messages = asyncio.run(scenario())
    statuses = [done_status(messages, f"q{index}") for index in range(4)]
    assert statuses == ["completed", "completed", "completed", "failed"]
    (limited,) = [m for m in messages if m["type"] == "error"]
    assert (
        limited["id"] == "q3" and limited["status"] == 429 and limited["error"]["type"] == "rate_limit_error"
    )


async def _open(url: str, headers: dict[str, str]) -> None:
    async with connect(url, additional_headers=headers):
        pass


def test_chat_stream_equals_the_http_answer(blackbox: ServerProcess) -> None:
    body = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 12, "temperature": 0}
    # NOTE: twice, and the second answer is the reference: the first fills the prefix cache, and a prompt
    # served partly from the cache runs a shorter prefill (another kernel path on CPU) whose rounding can
    # flip a near-tie, so the socket's request is compared with one that met the same cache.
    assert httpx.post(f"{blackbox.url}/v1/chat/completions", json=body, timeout=60).status_code == 200
    response = httpx.post(f"{blackbox.url}/v1/chat/completions", json=body, timeout=60)
    expected = response.json()["choices"][0]["message"]["content"]

    async def scenario() -> list[dict[str, Any]]:
        async with connect(ws_url(blackbox.url)) as socket:
            await socket.send(
                request("c", {**body, "stream_options": {"include_usage": True}}, "chat.completions")
            )
            return await read_until_done(socket, {"c"})

    messages = asyncio.run(scenario())
    chunks = [m["data"] for m in messages if m["type"] == "chunk"]
    assert (
        chunks[0]["object"] == "chat.completion.chunk"
        and chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    )
    text = "".join(choice["delta"].get("content") or "" for chunk in chunks for choice in chunk["choices"])
    assert text == expected
    assert chunks[-1]["usage"]["completion_tokens"] == response.json()["usage"]["completion_tokens"]
    assert done_status(messages, "c") == "completed"
