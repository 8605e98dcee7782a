"""An exception escaping Engine.step() is one distinct state: the request in flight ends with an error,
new requests are refused, and the probes say the engine is dead."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from bitserve.config import EngineConfig, ModelConfig, SchedulerConfig, ServerConfig
from bitserve.engine.instance import ModelInstance

BODY = {"prompt": [1, 2, 3], "max_tokens": 40, "ignore_eos": True, "temperature": 0}


class StepBomb:
    """Wraps the runner's execute: raises inside the engine thread from the `fail_at`-th call on."""

    def __init__(self, execute, fail_at: int) -> None:  # noqa: ANN001
        self.execute, self.fail_at, self.calls = execute, fail_at, 0

    def __call__(self, scheduler_output):  # noqa: ANN001, ANN204
        self.calls += 1
        if self.calls >= self.fail_at:
            raise RuntimeError("injected kernel failure")
        return self.execute(scheduler_output)


@pytest.fixture()
def dying_client(synthetic_models: dict[str, Path]) -> Iterator[tuple[TestClient, StepBomb]]:
    from bitserve.server.app import build_app

    instance = ModelInstance.load(
        EngineConfig(
            model=ModelConfig(model=str(synthetic_models["TQ2_0"]), backend="reference"),
            scheduler=SchedulerConfig(max_model_len=128),
        )
    )
    app = build_app(ServerConfig(warmup=False), instance=instance)
    bomb = StepBomb(instance.engine.runner.execute, fail_at=5)
    instance.engine.runner.execute = bomb
    try:
        with TestClient(app) as client:
            yield client, bomb
    finally:
        instance.close()


def test_engine_death_fails_the_request_the_probes_and_new_work(
    dying_client: tuple[TestClient, StepBomb],
) -> None:
    client, bomb = dying_client
    assert client.get("/health/live").status_code == 200
    with client.stream("POST", "/v1/completions", json=BODY | {"stream": True}) as response:
        assert response.status_code == 200  # the stream began before the failure
        frames = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert bomb.calls >= 5
    error_frames = [f for f in frames if '"error"' in f]
    assert error_frames, f"no error event in {frames[-3:]}"
    assert "injected kernel failure" in error_frames[-1] or "engine" in error_frames[-1]
    assert frames[-1] == "data: [DONE]"
    assert client.get("/health/live").status_code == 503
    assert client.get("/health/ready").status_code == 503
    refused = client.post("/v1/completions", json=BODY)
    assert refused.status_code in (500, 503)
    assert "engine" in refused.json()["error"]["message"]
