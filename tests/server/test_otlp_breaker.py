"""The OTLP span exporter behind its circuit breaker, over real sockets: a collector that refuses
connections fails N exports, then the exporter is not called (spans dropped and counted) until the
cool-down's probe reaches a collector that answers again, which closes the breaker."""

from __future__ import annotations

import http.server
import threading
import time

import pytest
from http_testing import free_port

from bitserve.server.breakers import CLOSED, OPEN, CircuitBreaker
from bitserve.server.tracing import BreakerSpanExporter

pytest.importorskip("opentelemetry.sdk")
pytest.importorskip("opentelemetry.exporter.otlp.proto.http")

EXPORT_TIMEOUT_S = 1.0


class Collector(http.server.BaseHTTPRequestHandler):
    """Accepts every OTLP/HTTP export (200, empty protobuf body)."""

    received: list[str] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers.get("content-length", 0)))
        Collector.received.append(self.path)
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        return None


@pytest.fixture
def spans() -> list[object]:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    for name in ("a", "b", "c"):
        provider.get_tracer("test").start_span(name).end()
    return list(memory.get_finished_spans())


def test_an_unreachable_collector_is_not_called_while_the_breaker_is_open(spans: list[object]) -> None:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import SpanExportResult

    port = free_port()
    breaker = CircuitBreaker("otlp", failure_threshold=2, cooldown_s=1.0)
    otlp = OTLPSpanExporter(endpoint=f"http://127.0.0.1:{port}/v1/traces", timeout=EXPORT_TIMEOUT_S)
    exporter = BreakerSpanExporter(otlp, breaker)
    for _ in range(2):  # nothing listens: each export retries until its timeout, then fails
        assert exporter.export(spans) == SpanExportResult.FAILURE
    assert breaker.state == OPEN
    started = time.perf_counter()
    for _ in range(5):
        assert exporter.export(spans) == SpanExportResult.FAILURE
    assert time.perf_counter() - started < EXPORT_TIMEOUT_S / 2  # not one call reached the socket
    assert breaker.stats().num_dropped == 15 and breaker.num_rejected == 5
    Collector.received = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Collector)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        time.sleep(1.1)  # past the cool-down: the next export is the probe
        assert exporter.export(spans) == SpanExportResult.SUCCESS
        assert breaker.state == CLOSED
        assert exporter.export(spans) == SpanExportResult.SUCCESS
    finally:
        server.shutdown()
        server.server_close()
        exporter.shutdown()
    assert Collector.received == ["/v1/traces", "/v1/traces"]
    assert breaker.stats().transitions == {"open": 1, "half_open": 1, "closed": 1}
