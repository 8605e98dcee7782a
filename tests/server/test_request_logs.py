"""The server's JSON log lines, read back: every line a request writes (uvicorn's access line, a warning
from its validation, the slow-request line with its timings) carries that request's id, and the
slow-request line has queue / ttft / decode / e2e timings that add up. The server is uvicorn on a real
socket, logging through the formatter and filters `bitserve serve` installs (log.configure_logging)."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from http_testing import free_port
from lifecycle_testing import ThreadServer

from bitserve.config import EngineConfig, ModelConfig, SchedulerConfig, ServerConfig
from bitserve.log import JsonFormatter, RedactionFilter, RequestIdFilter

REQUEST_ID = "log-test-request-1"


@pytest.fixture
def json_log() -> Iterator[io.StringIO]:
    """The root logger's JSON lines at INFO, as configure_logging sets them up, into a buffer."""
    output = io.StringIO()
    handler = logging.StreamHandler(output)
    handler.setFormatter(JsonFormatter())
    handler.addFilter(RequestIdFilter())
    handler.addFilter(RedactionFilter())
    root = logging.getLogger()
    uvicorn_loggers = [logging.getLogger(name) for name in ("uvicorn", "uvicorn.error", "uvicorn.access")]
    saved_root = root.level
    saved = [(lg.propagate, lg.level, lg.disabled) for lg in uvicorn_loggers]
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    # as configure_logging leaves them: a server started earlier in the session (uvicorn's own dictConfig,
    # or access_log=False) may have cut propagation at "uvicorn" or "uvicorn.access", raised a level or
    # disabled one; uvicorn then sees no handler for the access line and does not write it at all
    for lg in uvicorn_loggers:
        lg.propagate, lg.disabled = True, False
        lg.setLevel(logging.NOTSET)
    try:
        yield output
    finally:
        root.removeHandler(handler)
        root.setLevel(saved_root)
        for lg, (propagate, level, disabled) in zip(uvicorn_loggers, saved, strict=True):
            lg.propagate, lg.disabled = propagate, disabled
            lg.setLevel(level)


def request_lines(lines: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The lines one completions request writes, found by what they say, not by their request id."""
    found = {}
    for line in lines:
        message = str(line.get("message", ""))
        if line["logger"] == "uvicorn.access" and "/v1/completions" in message:
            found["access"] = line
        elif "unknown request field" in message and "x_note" in message:
            found["unknown_field"] = line
        elif message.startswith("slow request"):
            found["slow"] = line
    return found


def test_each_line_of_a_request_carries_its_id(json_log: io.StringIO, tq2_model_path: Path) -> None:
    config = ServerConfig(port=free_port(), slow_request_s=0.001)  # every request is slow past 1 ms
    engine = EngineConfig(
        model=ModelConfig(model=str(tq2_model_path)), scheduler=SchedulerConfig(max_model_len=128)
    )
    server = ThreadServer(config, engine, access_log=True)
    server.start()
    try:
        body = {"prompt": "one two", "max_tokens": 4, "temperature": 0, "ignore_eos": True, "x_note": 1}
        response = httpx.post(
            f"{server.url}/v1/completions", json=body, headers={"x-request-id": REQUEST_ID}, timeout=60
        )
        assert response.status_code == 200 and response.headers["x-request-id"] == REQUEST_ID
    finally:
        server.stop()
    lines = [json.loads(line) for line in json_log.getvalue().splitlines()]
    found = request_lines(lines)
    assert set(found) == {"access", "unknown_field", "slow"}, found
    assert all(line["request_id"] == REQUEST_ID for line in found.values())
    # and nothing else was logged under that id
    assert sorted(map(json.dumps, found.values())) == sorted(
        json.dumps(line) for line in lines if line.get("request_id") == REQUEST_ID
    )
    slow = found["slow"]
    assert slow["level"] == "WARNING" and slow["num_output_tokens"] == 4
    assert 0 <= slow["queue_s"] <= slow["ttft_s"] <= slow["e2e_s"] and 0 <= slow["decode_s"] <= slow["e2e_s"]
