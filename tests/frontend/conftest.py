"""Frontend test fixtures: an in-process server whose one running slot is held by slowed engine steps,
so requests queue behind it (deadlines in the queue, admission under saturation)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from bitserve.config import EngineConfig, ModelConfig, SchedulerConfig, ServerConfig
from bitserve.engine.instance import ModelInstance

STEP_S = 0.05  # every engine step is slowed to this: a 40-token request holds its slot ~2 s


@contextlib.contextmanager
def _slowed_client(model: Path, server: ServerConfig) -> Iterator[TestClient]:
    from bitserve.server.app import build_app

    instance = ModelInstance.load(
        EngineConfig(
            model=ModelConfig(model=str(model), backend="reference"),
            scheduler=SchedulerConfig(max_model_len=128, max_num_seqs=1),
        )
    )
    execute = instance.engine.runner.execute

    def slow_execute(scheduler_output):  # noqa: ANN001, ANN202
        time.sleep(STEP_S)
        return execute(scheduler_output)

    instance.engine.runner.execute = slow_execute
    try:
        with TestClient(build_app(server, instance=instance)) as client:
            yield client
    finally:
        instance.close()


@pytest.fixture()
def slowed_client(
    synthetic_models: dict[str, Path],
) -> Callable[[ServerConfig], contextlib.AbstractContextManager[TestClient]]:
    """slowed_client(server_config) -> a context manager yielding a TestClient over the synthetic TQ2_0
    model with one running slot and slowed steps."""
    return lambda server: _slowed_client(synthetic_models["TQ2_0"], server)
