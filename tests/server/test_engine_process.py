"""Engines in processes of their own (`--engine-process on`: engine/process.py, frontend/process_client.py)
over real HTTP, on the lifecycle tests' tiny synthetic versions: the same answers (completions, streams,
embeddings) as the thread engine, a
load's error carried back from the child, swaps under load, and a killed engine process ending its
streams with an error while the server lives on and can load the alias again."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from multiprocessing.process import BaseProcess
from typing import Any

import httpx
from lifecycle_testing import (
    ModelRoot,
    admin,
    failed,
    lifecycle_server,
    run_clients,
    stream_completion,
    version_of,
)

from bitserve.engine.process import uses_engine_process

ALIAS = "v1"
PROMPTS = ("Hello world", "client 3 request 7", "a b c d e f g")


def engine_process_of(server: Any) -> BaseProcess:
    instance = server.state.models.aliases[ALIAS].current.instance
    return instance.engine_process.process


def reaped(process: BaseProcess, timeout_s: float = 30.0) -> bool:
    """Whether the process is gone (exited and reaped by the server) within timeout_s. Polled with
    kill(pid, 0): joining it from this thread too would race the server's own join for its exit status."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(process.pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def greedy_completion(url: str, prompt: str) -> tuple[str, int, str]:
    body = {"prompt": prompt, "max_tokens": 24, "temperature": 0.0}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60.0)
    assert response.status_code == 200, response.text
    payload = response.json()
    choice = payload["choices"][0]
    return choice["text"], payload["usage"]["completion_tokens"], choice["finish_reason"]


def replica_view(url: str) -> dict[str, Any]:
    """What /v1/models shows of the alias's replica, less what changes with traffic."""
    [model] = httpx.get(f"{url}/v1/models", timeout=10.0).json()["data"]
    [replica] = model["replicas"]
    return {key: replica[key] for key in ("device", "backend", "kernels", "kv_cache", "is_alive")}


def test_the_engine_process_answers_as_the_thread_engine(model_root: ModelRoot) -> None:
    answers: dict[str, list[tuple[str, int, str]]] = {}
    views: dict[str, dict[str, Any]] = {}
    embeddings: dict[str, list[list[float]]] = {}
    for mode in ("off", "on"):
        with lifecycle_server(model_root, engine_process=mode) as server:
            if mode == "on":
                process = engine_process_of(server)
                assert process.is_alive() and process.pid != os.getpid()
            answers[mode] = [greedy_completion(server.url, prompt) for prompt in PROMPTS]
            views[mode] = replica_view(server.url)
            embedded = httpx.post(f"{server.url}/v1/embeddings", json={"input": list(PROMPTS)}, timeout=60.0)
            assert embedded.status_code == 200, embedded.text
            embeddings[mode] = [item["embedding"] for item in embedded.json()["data"]]

            async def streamed(url: str = server.url) -> Any:
                async with httpx.AsyncClient(base_url=url, timeout=60.0) as client:
                    return await stream_completion(client, PROMPTS[0], 24)

            result = asyncio.run(streamed())
            assert result.has_done and result.error is None and result.text == answers[mode][0][0]
    assert answers["on"] == answers["off"]
    assert embeddings["on"] == embeddings["off"] and len(embeddings["on"]) == len(PROMPTS)
    assert all(tokens > 0 for _, tokens, _ in answers["on"])
    assert views["on"] == views["off"] and views["on"]["is_alive"] is True
    assert reaped(process), "the server's shutdown stops its engine process"


def test_a_load_error_in_the_engine_process_is_the_loads_error(model_root: ModelRoot) -> None:
    v1 = version_of(model_root.files["v1"])
    with lifecycle_server(model_root, engine_process="on") as server:
        for name, reason in (("truncated", "truncated.gguf"), ("wrongarch", "mamba")):
            response = admin(server.url, f"/v1/models/{ALIAS}/swap", {"model": name, "wait": True})
            assert response.status_code == 422, response.text
            error = response.json()["error"]
            assert error["code"] == "model_rejected" and reason in error["message"], response.text
        models = httpx.get(f"{server.url}/v1/models").json()["data"]
        assert [(m["id"], m["version"], m["state"]) for m in models] == [(ALIAS, v1, "ready")]
        assert greedy_completion(server.url, PROMPTS[0])[1] > 0


def test_swaps_under_load_between_engine_processes_lose_nothing(model_root: ModelRoot) -> None:
    v1, v2 = version_of(model_root.files["v1"]), version_of(model_root.files["v2"])
    with lifecycle_server(model_root, engine_process="on") as server:
        results: list[Any] = []
        swaps: list[str] = []
        retired: list[BaseProcess] = []

        async def scenario() -> None:
            stop = asyncio.Event()
            clients = asyncio.create_task(run_clients(server.url, 16, stop, results))
            async with httpx.AsyncClient(base_url=server.url, timeout=300.0) as admin_client:
                for target in ("v2", "v1"):
                    await asyncio.sleep(0.5)
                    retired.append(engine_process_of(server))
                    response = await admin_client.post(
                        f"/v1/models/{ALIAS}/swap", json={"model": target, "wait": True}
                    )
                    assert response.status_code == 200, response.text
                    swaps.append(response.json()["result"]["version"])
                await asyncio.sleep(0.5)
            stop.set()
            await clients

        asyncio.run(scenario())
        assert swaps == [v2, v1]
        assert len(results) > 50 and failed(results) == []
        assert {next(iter(r.versions)) for _, _, r in results} == {v1, v2}
        assert all(reaped(process) for process in retired)  # each swapped-out version's engine ended


def test_a_killed_engine_process_ends_its_streams_and_the_alias_loads_again(model_root: ModelRoot) -> None:
    with lifecycle_server(model_root, engine_process="on") as server:
        process = engine_process_of(server)

        async def stream_then_kill() -> tuple[list[str], float]:
            lines: list[str] = []
            async with httpx.AsyncClient(base_url=server.url, timeout=60.0) as client:
                body = {"prompt": PROMPTS[1], "max_tokens": 200, "stream": True, "temperature": 0.0}
                async with client.stream("POST", "/v1/completions", json=body) as response:
                    assert response.status_code == 200
                    async for line in response.aiter_lines():
                        if line.startswith("data: ") and not lines:
                            os.kill(process.pid, signal.SIGKILL)  # mid-stream: the first chunk is out
                            killed_at = time.monotonic()
                        if line.startswith("data: "):
                            lines.append(line)
            return lines, time.monotonic() - killed_at

        lines, ended_after_s = asyncio.run(stream_then_kill())
        assert ended_after_s < 10.0
        assert any('"error"' in line and "engine" in line for line in lines), lines[-3:]
        assert reaped(process) and process.exitcode == -signal.SIGKILL
        refused = httpx.post(
            f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30.0
        )
        assert refused.status_code >= 500 and "engine" in refused.json()["error"]["message"], refused.text
        [replica] = httpx.get(f"{server.url}/v1/models").json()["data"][0]["replicas"]
        assert replica["is_alive"] is False
        response = admin(server.url, f"/v1/models/{ALIAS}/swap", {"model": "v2", "wait": True})
        assert response.status_code == 200, response.text
        assert engine_process_of(server).is_alive()
        assert greedy_completion(server.url, PROMPTS[0])[1] > 0


def test_engine_process_modes() -> None:
    assert [uses_engine_process("auto", device) for device in ("cpu", "cuda:0", "cuda:1")] == [
        False,
        True,
        True,
    ]
    assert uses_engine_process("on", "cpu") and not uses_engine_process("off", "cuda:0")
