"""OpenTelemetry tracing with the SDK's in-memory exporter: a SERVER span per request that continues the
client's W3C traceparent, child spans for queue wait, prefill and decode, the trace id on the request's
JSON log lines, and no tracing at all when no endpoint is configured."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from bitserve.config import EngineConfig, ModelConfig, SchedulerConfig, ServerConfig
from bitserve.log import JsonFormatter, RequestIdFilter

sdk_trace = pytest.importorskip("opentelemetry.sdk.trace")
in_memory = pytest.importorskip("opentelemetry.sdk.trace.export.in_memory_span_exporter")
export = pytest.importorskip("opentelemetry.sdk.trace.export")

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def traced(tq2_model_path: Path) -> Iterator[tuple[TestClient, object]]:
    from bitserve.engine.instance import ModelInstance
    from bitserve.server.app import build_app

    instance = ModelInstance.load(
        EngineConfig(
            model=ModelConfig(model=str(tq2_model_path)), scheduler=SchedulerConfig(max_model_len=128)
        )
    )
    exporter = in_memory.InMemorySpanExporter()
    provider = sdk_trace.TracerProvider()
    provider.add_span_processor(export.SimpleSpanProcessor(exporter))
    app = build_app(ServerConfig(), instance=instance, tracer_provider=provider)
    try:
        with TestClient(app) as client:
            yield client, exporter
    finally:
        instance.close()


def test_request_span_continues_traceparent_with_generation_children(traced) -> None:  # noqa: ANN001
    client, exporter = traced
    exporter.clear()
    handler_output = io.StringIO()
    handler = logging.StreamHandler(handler_output)
    handler.setFormatter(JsonFormatter())
    handler.addFilter(RequestIdFilter())
    logger = logging.getLogger("bitserve")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        response = client.post(
            "/v1/completions",
            # the unknown field makes the server log a warning inside the request
            json={"prompt": "one two", "max_tokens": 3, "temperature": 0, "ignore_eos": True, "x_note": 1},
            headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01", "x-request-id": "traced-1"},
        )
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert response.status_code == 200
    spans = {span.name: span for span in exporter.get_finished_spans()}
    server = spans["POST /v1/completions"]
    assert format(server.context.trace_id, "032x") == TRACE_ID
    assert format(server.parent.span_id, "016x") == PARENT_ID
    assert server.attributes["http.response.status_code"] == 200
    assert server.attributes["bitserve.request_id"] == "traced-1"
    queue, prefill, decode = spans["bitserve.queue"], spans["bitserve.prefill"], spans["bitserve.decode"]
    for child in (queue, prefill, decode):
        assert child.parent.span_id == server.context.span_id
        assert child.context.trace_id == server.context.trace_id
        assert child.start_time <= child.end_time
    # one after the other (1 µs of slack: each end is converted from the monotonic clock on its own)
    assert queue.end_time <= prefill.start_time + 1000 and prefill.end_time <= decode.start_time + 1000
    assert server.start_time <= queue.start_time and decode.end_time <= server.end_time
    assert decode.attributes["bitserve.output_tokens"] == 3
    lines = [json.loads(line) for line in handler_output.getvalue().splitlines()]
    request_lines = [line for line in lines if line.get("request_id") == "traced-1"]
    assert request_lines and all(line["trace_id"] == TRACE_ID for line in request_lines)


def test_a_batched_completion_is_one_traced_generation(traced) -> None:  # noqa: ANN001
    client, exporter = traced
    exporter.clear()
    body = {"prompt": ["one two", "three"], "n": 2, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    assert client.post("/v1/completions", json=body).status_code == 200
    spans = {span.name: span for span in exporter.get_finished_spans()}
    assert (
        spans["bitserve.decode"].attributes["bitserve.output_tokens"] == 2 * 2 * 3
    )  # every prompt's choices


def test_without_traceparent_a_new_trace_starts(traced) -> None:  # noqa: ANN001
    client, exporter = traced
    exporter.clear()
    assert client.get("/health/live").status_code == 200
    (span,) = exporter.get_finished_spans()
    assert span.parent is None and span.name == "GET /health/live"
    assert format(span.context.trace_id, "032x") != TRACE_ID


def test_the_endpoint_comes_from_settings_and_the_standard_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tracing is off without an endpoint; settings take OTEL_EXPORTER_OTLP_ENDPOINT, below
    BITSERVE_OTEL_ENDPOINT and the flag."""
    from bitserve.server.settings import load_settings

    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("BITSERVE_OTEL_ENDPOINT", raising=False)
    assert load_settings({}).server.otel_endpoint is None
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")
    assert load_settings({}).server.otel_endpoint == "http://collector:4318"
    monkeypatch.setenv("BITSERVE_OTEL_ENDPOINT", "http://mine:4318")
    assert load_settings({}).server.otel_endpoint == "http://mine:4318"
    assert load_settings({"otel_endpoint": "http://other:4318"}).server.otel_endpoint == "http://other:4318"
