"""OpenTelemetry tracing, off unless ServerConfig.otel_endpoint is set (`--otel-endpoint`,
BITSERVE_OTEL_ENDPOINT, or the standard OTEL_EXPORTER_OTLP_ENDPOINT: server/settings.py reads both): one
SERVER span per HTTP request (a W3C `traceparent` from the client is its parent; a WebSocket request gets
one of its own), with child spans for a generation's queue wait, prefill and decode. The span's trace id
is on every JSON log line of the request (`trace_id`). Spans go to an OTLP/HTTP collector in batches,
through a circuit breaker: a collector that failed N exports in a row is not called for a cool-down (its
spans are dropped and counted), so a dead one does not hold the export thread in retries or a shutdown in
its flush. The SDK is an optional dependency: `pip install 'bitserve[otel]'`."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from bitserve.frontend.generation_stream import StreamTiming
from bitserve.log import TRACE_ID
from bitserve.server.breakers import CircuitBreaker

TRACER_NAME = "bitserve"


def build_tracer_provider(endpoint: str, breaker: CircuitBreaker | None = None) -> Any:
    """An SDK TracerProvider exporting to `endpoint` (an OTLP/HTTP base URL; /v1/traces is appended),
    through `breaker` when given."""
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise RuntimeError(
            "tracing is on (--otel-endpoint or OTEL_EXPORTER_OTLP_ENDPOINT) but the OpenTelemetry SDK is "
            "not installed: pip install 'bitserve[otel]'"
        ) from exc
    provider = TracerProvider(resource=Resource.create({"service.name": "bitserve"}))
    url = endpoint.rstrip("/") + "/v1/traces"
    exporter: Any = OTLPSpanExporter(endpoint=url)
    if breaker is not None:
        exporter = BreakerSpanExporter(exporter, breaker)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


class BreakerSpanExporter:
    """A SpanExporter calling `exporter` while `breaker` allows: a failed export counts against it; while
    it is open, batches are dropped (counted on the breaker) without a call. Runs on the SDK's export
    thread; the breaker is thread-safe."""

    def __init__(self, exporter: Any, breaker: CircuitBreaker) -> None:
        self.exporter = exporter
        self.breaker = breaker

    def export(self, spans: Any) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        if not self.breaker.allow():
            self.breaker.record_dropped(len(spans))
            return SpanExportResult.FAILURE
        result = self.exporter.export(spans)
        if result == SpanExportResult.SUCCESS:
            self.breaker.record_success()
        else:
            self.breaker.record_failure()
        return result

    def shutdown(self) -> None:
        self.exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return bool(self.exporter.force_flush(timeout_millis))


class TracingMiddleware:
    """A SERVER span around each HTTP request, child of the client's `traceparent` when it sends one."""

    def __init__(self, app: ASGIApp, tracer: Any) -> None:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.app = app
        self.tracer = tracer
        self.propagator = TraceContextTextMapPropagator()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        from opentelemetry import trace

        headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in scope["headers"]}
        attributes = {
            "http.request.method": scope["method"],
            "url.path": scope["path"],
            "bitserve.request_id": scope.get("state", {}).get("request_id", ""),
        }
        name = f"{scope['method']} {scope['path']}"
        with server_span(self.tracer, name, attributes, self.propagator.extract(headers)) as span:
            status = 0

            async def send_traced(message: Message) -> None:
                nonlocal status
                if message["type"] == "http.response.start":
                    status = int(message["status"])
                    span.set_attribute("http.response.status_code", status)
                await send(message)

            try:
                await self.app(scope, receive, send_traced)
            finally:
                if status >= 500:
                    span.set_status(trace.Status(trace.StatusCode.ERROR))


@contextlib.contextmanager
def server_span(tracer: Any, name: str, attributes: dict[str, Any], context: Any = None) -> Iterator[Any]:
    """A SERVER span (the child of `context`, a client's extracted traceparent) that is current while
    open; its trace id stamps the log lines meanwhile."""
    from opentelemetry import trace

    with tracer.start_as_current_span(
        name, context=context, kind=trace.SpanKind.SERVER, attributes=attributes
    ) as span:
        token = TRACE_ID.set(format(span.get_span_context().trace_id, "032x"))
        try:
            yield span
        finally:
            TRACE_ID.reset(token)


def current_span() -> Any:
    from opentelemetry import trace

    return trace.get_current_span()


def record_generation_spans(tracer: Any, parent: Any, timing: StreamTiming) -> None:
    """Child spans of `parent` from a finished generation's monotonic timestamps: queue wait (arrival to
    first schedule), prefill (to the first token) and decode. A request that ended earlier gets the
    spans it reached (queue wait alone when it never left the queue)."""
    from opentelemetry import trace

    now_monotonic, now_ns = time.monotonic(), time.time_ns()

    def wall_ns(monotonic: float) -> int:
        return now_ns - int((now_monotonic - monotonic) * 1e9)

    context = trace.set_span_in_context(parent)
    scheduled_at = timing.arrival + timing.queue_s if timing.queue_s is not None else None
    decoded = {"bitserve.output_tokens": timing.num_output_tokens}
    phases = (
        ("bitserve.queue", timing.arrival, scheduled_at, {}),
        ("bitserve.prefill", scheduled_at, timing.first_token_at, {}),
        ("bitserve.decode", timing.first_token_at, None, decoded),
    )
    for name, start, end, attributes in phases:
        if start is None:
            return  # the request never reached this phase
        span = tracer.start_span(name, context=context, start_time=wall_ns(start), attributes=attributes)
        span.end(end_time=wall_ns(end if end is not None else now_monotonic))
