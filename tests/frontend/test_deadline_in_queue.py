"""A deadline that passes while the request is still waiting in the queue (the one running slot is
taken): it ends with 504 at its deadline, not when a slot frees, and the running request is untouched."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from fastapi.testclient import TestClient

from bitserve.config import ServerConfig

LONG = {"prompt": [1, 2, 3], "max_tokens": 40, "ignore_eos": True, "temperature": 0}


@pytest.fixture()
def one_slot_client(slowed_client) -> Iterator[TestClient]:  # noqa: ANN001
    with slowed_client(ServerConfig(warmup=False)) as client:
        yield client


def test_deadline_in_the_queue(one_slot_client: TestClient) -> None:
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(one_slot_client.post, "/v1/completions", json=LONG)
        time.sleep(0.3)  # the first request has the only slot
        started = time.monotonic()
        queued = one_slot_client.post("/v1/completions", json=LONG | {"timeout": 0.3})
        waited = time.monotonic() - started
        first = running.result(timeout=60)
    assert queued.status_code == 504, queued.text
    assert queued.json()["error"]["code"] == "deadline_exceeded"
    assert waited < 1.0  # at its deadline, not after the ~2 s the running request still needed
    assert first.status_code == 200
    assert first.json()["usage"]["completion_tokens"] == 40
    counted = [
        line
        for line in one_slot_client.get("/metrics").text.splitlines()
        if line.startswith("bitserve_requests_aborted_total{") and 'reason="deadline"' in line
    ]
    assert counted and float(counted[0].rsplit(" ", 1)[1]) == 1.0, counted
