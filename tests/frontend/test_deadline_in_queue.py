"""A deadline that passes while the request is still waiting in the queue (the one running slot is
taken): it ends with 504 at its deadline, not when a slot frees, and the running request is untouched."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from bitserve.config import EngineConfig, ModelConfig, SchedulerConfig, ServerConfig
from bitserve.engine.instance import ModelInstance

STEP_S = 0.05  # every engine step is slowed to this, so the running request holds its slot ~2 s
LONG = {"prompt": [1, 2, 3], "max_tokens": 40, "ignore_eos": True, "temperature": 0}


@pytest.fixture()
def one_slot_client(synthetic_models: dict[str, Path]) -> Iterator[TestClient]:
    from bitserve.server.app import build_app

    instance = ModelInstance.load(
        EngineConfig(
            model=ModelConfig(model=str(synthetic_models["TQ2_0"]), backend="reference"),
            scheduler=SchedulerConfig(max_model_len=128, max_num_seqs=1),
        )
    )
    execute = instance.engine.runner.execute

    def slow_execute(scheduler_output):  # noqa: ANN001, ANN202
        time.sleep(STEP_S)
        return execute(scheduler_output)

    instance.engine.runner.execute = slow_execute
    app = build_app(ServerConfig(warmup=False), instance=instance)
    try:
        with TestClient(app) as client:
            yield client
    finally:
        instance.close()


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
