"""What a start-up shows while it is slow: a log line at least every few seconds during the load and the
warm-up (a cold kernel cache makes the warm-up compile for ~40 s), and /health/ready's body naming the
step; plus the catalog's own numerics for the embedded model."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from bitserve.config import EngineConfig, ModelConfig, SchedulerConfig, ServerConfig
from bitserve.lifecycle import replicas
from bitserve.loader.catalog import CATALOG, DEFAULT_MODEL, catalog_block_activations


def test_a_slow_first_generation_is_logged_and_named_by_the_readiness_probe(
    tq2_model_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from bitserve.server.app import build_app

    release = threading.Event()
    real_validate = replicas.validate_engine

    async def slow_validate(engine, golden, request_id: str) -> None:  # noqa: ANN001 - an AsyncEngine
        while not release.is_set():  # stands in for a compile: the real validation runs after it
            await asyncio.sleep(0.01)
        await real_validate(engine, golden, request_id)

    monkeypatch.setattr(replicas, "validate_engine", slow_validate)
    monkeypatch.setattr(replicas, "PROGRESS_LOG_INTERVAL_S", 0.05)
    caplog.set_level(logging.INFO, logger="bitserve.lifecycle.replicas")
    config = EngineConfig(
        model=ModelConfig(model=str(tq2_model_path)), scheduler=SchedulerConfig(max_model_len=128)
    )
    with TestClient(build_app(ServerConfig(engine_process="off"), config)) as client:
        deadline = time.monotonic() + 60
        body: dict = {}
        while time.monotonic() < deadline:
            body = client.get("/health/ready").json()
            if body.get("loading", {}).get("step") == "validating":
                break
            time.sleep(0.02)
        assert body["phase"] == "loading" and body["loading"]["step"] == "validating", body
        assert body["loading"]["seconds"] >= 0 and 0 < body["loading"]["progress"] < 1
        time.sleep(0.2)  # a few ticks
        release.set()
        while time.monotonic() < deadline and client.get("/health/ready").status_code != 200:
            time.sleep(0.02)
        ready = client.get("/health/ready")
        assert ready.status_code == 200 and "loading" not in ready.json()
    messages = [record.getMessage() for record in caplog.records]
    first = [m for m in messages if m.startswith("validating")]
    assert first[0].endswith("later starts use the cache)"), first
    assert any("still running" in m for m in first), first
    assert "done in" in first[-1], first
    assert any(m.startswith("loading ") and "done in" in m for m in messages), messages


def test_the_embedded_model_runs_its_measured_numerics_by_name_only() -> None:
    entry = CATALOG[DEFAULT_MODEL]
    assert entry.block_activations == "f32"
    assert catalog_block_activations(DEFAULT_MODEL, "auto") == "f32"
    assert catalog_block_activations(DEFAULT_MODEL, "q8") == "q8"  # what the operator says wins
    assert catalog_block_activations(f"/models/{entry.filename}", "auto") == "auto"
