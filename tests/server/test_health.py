"""Probes in process: a model that fails to load, a stalled engine, and draining; plus the SSE
framing of keep-alives and mid-stream errors."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from bitserve.config import EngineConfig, ModelConfig, SchedulerConfig, ServerConfig
from bitserve.errors import EngineDead
from bitserve.outputs import CompletionOutput, RequestOutput
from bitserve.server.streaming import DONE_FRAME, PING_FRAME, sse_events


def test_failed_model_load_fails_the_probes(tmp_path: Path) -> None:
    from bitserve.server.app import build_app

    missing = tmp_path / "missing.gguf"
    is_fatal = threading.Event()
    app = build_app(
        ServerConfig(), EngineConfig(model=ModelConfig(model=str(missing))), on_fatal=is_fatal.set
    )
    with TestClient(app) as client:
        assert is_fatal.wait(30)
        ready = client.get("/health/ready")
        assert ready.status_code == 503 and int(ready.headers["retry-after"]) >= 1
        live = client.get("/health/live")
        assert live.status_code == 503 and live.json()["checks"]["model_load_ok"] is False
        assert client.get("/health").json()["status"] == "failed"
        error = client.post("/v1/completions", json={"prompt": "hi"})
        assert error.status_code == 503 and error.json()["error"]["code"] == "model_unavailable"
        assert client.get("/v1/models").json()["data"] == []


@pytest.fixture(scope="module")
def strict_client(tq2_model_path: Path) -> Iterator[TestClient]:
    """Its own synthetic model and engine; liveness tolerates no gap at all between steps."""
    from bitserve.engine.instance import ModelInstance
    from bitserve.server.app import build_app

    instance = ModelInstance.load(
        EngineConfig(
            model=ModelConfig(model=str(tq2_model_path)), scheduler=SchedulerConfig(max_model_len=128)
        )
    )
    app = build_app(ServerConfig(liveness_stall_s=1e-9), instance=instance)
    try:
        with TestClient(app) as client:
            yield client
    finally:
        instance.close()


def test_liveness_fails_while_the_engine_makes_no_progress(strict_client: TestClient) -> None:
    assert strict_client.get("/health/live").status_code == 200  # idle: nothing pending, nothing stalled
    body = {"prompt": [1, 2, 3], "max_tokens": 60, "n": 4, "ignore_eos": True}
    worker = threading.Thread(target=strict_client.post, args=("/v1/completions",), kwargs={"json": body})
    worker.start()
    statuses = set()
    while worker.is_alive():
        response = strict_client.get("/health/live")
        statuses.add(response.status_code)
        if response.status_code == 503:
            assert response.json()["checks"]["engine_progressing"] is False
        time.sleep(0.005)
    worker.join()
    assert 503 in statuses  # any time between steps exceeds a 1 ns allowance
    assert strict_client.get("/health/live").status_code == 200  # work done: healthy again


def test_draining_fails_readiness_and_refuses_new_work(strict_client: TestClient) -> None:
    state = strict_client.app.state.bitserve  # type: ignore[attr-defined]
    assert strict_client.get("/health/ready").status_code == 200
    state.begin_drain()
    try:
        ready = strict_client.get("/health/ready")
        assert ready.status_code == 503 and ready.json()["checks"]["not_draining"] is False
        refused = strict_client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["code"] == "server_shutting_down"
        assert (
            strict_client.post("/tokenize", json={"prompt": "hi"}).status_code == 200
        )  # no engine step needed
    finally:
        state.is_draining = state.models.is_draining = False


class ScriptedStream:
    """Stands in for GenerationStream in a framing test: replays outputs, timeouts (None), errors."""

    def __init__(self, script: list[RequestOutput | None | BaseException]) -> None:
        self.script = script
        self.num_prompt_tokens = 3
        self.is_closed = False

    async def next(self, timeout: float | None) -> RequestOutput | None:
        if not self.script:
            raise StopAsyncIteration
        item = self.script.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self.is_closed = True


class EchoFormat:
    """A ResponseFormat that frames each output's text between a hello and a bye."""

    def prologue(self) -> list[dict[str, Any]]:
        return [{"hello": 1}]

    def chunks(self, output: RequestOutput) -> list[dict[str, Any]]:
        return [{"text": output.outputs[0].text}]

    def epilogue(self, usage: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"bye": usage["completion_tokens"]}]


def _frames(stream: ScriptedStream) -> list[bytes]:
    async def run() -> list[bytes]:
        events = sse_events(stream, 0.01, EchoFormat())  # type: ignore[arg-type]
        return [frame async for frame in events]

    return asyncio.run(run())


def test_sse_framing_keepalive_and_errors() -> None:
    output = RequestOutput("r", [1, 2, 3], [CompletionOutput(0, "hi", [5])], finished=False)
    stream = ScriptedStream([None, output, None])
    assert _frames(stream) == [
        b'data: {"hello":1}\n\n',
        PING_FRAME,
        b'data: {"text":"hi"}\n\n',
        PING_FRAME,
        b'data: {"bye":1}\n\n',
        DONE_FRAME,
    ]
    assert stream.is_closed
    failing = ScriptedStream([output, EngineDead("the engine failed")])
    frames = _frames(failing)
    assert frames[-1] == DONE_FRAME and frames[-2].startswith(
        b'data: {"error": {"message": "the engine failed"'
    )
    assert b'"code": "engine_dead"' in frames[-2] and failing.is_closed
