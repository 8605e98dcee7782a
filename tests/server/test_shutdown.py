"""Admission and graceful shutdown, black box: a small queue cap turns the excess into 429 +
Retry-After; SIGTERM fails readiness at once, answers new requests 503 + Retry-After, lets
in-flight streams finish (or ends them with an SSE error event at the drain deadline), exit 0."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from http_testing import ServerProcess, chat_body, parse_stream

MAX_NUM_WAITING = 3
NUM_BURST = 10
EXIT_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def capped(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Iterator[ServerProcess]:
    """A server admitting at most 3 requests, with a drain long enough for in-flight streams."""
    server = ServerProcess(
        tmp_path_factory.mktemp("capped") / "server.log",
        "--max-num-waiting",
        str(MAX_NUM_WAITING),
        "--drain-timeout-s",
        "60",
        "--sse-keepalive-s",
        "1",
    )
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


async def _stream(http: httpx.AsyncClient, body: dict[str, Any]) -> tuple[int, dict[str, str], list[str]]:
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        lines = [line async for line in response.aiter_lines()]
    return response.status_code, dict(response.headers), lines


def test_queue_cap_answers_429_with_retry_after(capped: ServerProcess) -> None:
    async def burst() -> list[tuple[int, dict[str, str], list[str]]]:
        async with httpx.AsyncClient(base_url=capped.url, timeout=120.0) as http:
            return await asyncio.gather(*(_stream(http, chat_body(12)) for _ in range(NUM_BURST)))

    results = asyncio.run(burst())
    statuses = sorted(status for status, _, _ in results)
    assert set(statuses) == {200, 429} and statuses.count(200) >= 1, statuses
    for status, headers, lines in results:
        if status == 429:
            assert int(headers["retry-after"]) >= 1
            assert json.loads("".join(lines))["error"]["code"] == "queue_full"
        else:
            _, is_done = parse_stream(lines)
            assert is_done
    # nothing else broke: the server is ready again and serves
    assert httpx.get(f"{capped.url}/health/ready").status_code == 200
    status, _, lines = asyncio.run(_one(capped, chat_body(4)))
    assert status == 200 and parse_stream(lines)[1]


async def _one(server: ServerProcess, body: dict[str, Any]) -> tuple[int, dict[str, str], list[str]]:
    async with httpx.AsyncClient(base_url=server.url, timeout=120.0) as http:
        return await _stream(http, body)


class StreamReader(threading.Thread):
    """Reads one SSE stream in the background; `first_chunk` is set once data arrives."""

    def __init__(self, server: ServerProcess, body: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.url, self.body = f"{server.url}/v1/chat/completions", body
        self.first_chunk = threading.Event()
        self.lines: list[str] = []
        self.status = 0

    def run(self) -> None:
        with httpx.stream("POST", self.url, json=self.body, timeout=120.0) as response:
            self.status = response.status_code
            for line in response.iter_lines():
                self.lines.append(line)
                if line.startswith("data: {") and '"content":"' in line and not self.first_chunk.is_set():
                    self.first_chunk.set()


def test_sigterm_drains_in_flight_streams(capped: ServerProcess) -> None:
    """Runs last against `capped`: the server exits."""
    readers = [StreamReader(capped, chat_body(24, ignore_eos=True)) for _ in range(2)]
    for reader in readers:
        reader.start()
    assert all(reader.first_chunk.wait(60) for reader in readers)
    capped.terminate()
    deadline = time.monotonic() + 5.0
    while httpx.get(f"{capped.url}/health/ready").status_code != 503:
        assert time.monotonic() < deadline, "readiness did not fail after SIGTERM"
        time.sleep(0.05)
    refused = httpx.post(f"{capped.url}/v1/chat/completions", json={**chat_body(4), "stream": False})
    assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
    assert refused.json()["error"]["code"] == "server_shutting_down"
    for reader in readers:
        reader.join(EXIT_TIMEOUT_S)
        chunks, is_done = parse_stream(reader.lines)
        assert reader.status == 200 and is_done
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # ran to max_tokens, not cut
    assert capped.wait_exit(EXIT_TIMEOUT_S) == 0


def test_drain_deadline_ends_streams_with_an_error_event(tmp_path: Path, smollm2_path: Path) -> None:
    server = ServerProcess(tmp_path / "server.log", "--drain-timeout-s", "2", "--sse-keepalive-s", "1")
    try:
        server.wait_ready()
        reader = StreamReader(server, chat_body(2000, ignore_eos=True))
        reader.start()
        assert reader.first_chunk.wait(60)
        server.terminate()
        reader.join(EXIT_TIMEOUT_S)
        payloads = [line[len("data: ") :] for line in reader.lines if line.startswith("data: ")]
        assert payloads[-1] == "[DONE]"
        error = json.loads(payloads[-2])["error"]
        assert error["code"] == "server_shutting_down" and "drain" in error["message"]
        assert server.wait_exit(EXIT_TIMEOUT_S) == 0
    finally:
        server.stop()
