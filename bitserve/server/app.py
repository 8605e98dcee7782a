"""build_app(): the FastAPI application. Lifespan (load the model in a worker thread, start the
engine, warm up), middleware order (request context -> compression -> CORS -> security -> body limits ->
routes), error handlers.
The only importer of metrics/prometheus.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from bitserve.config import EngineConfig, ServerConfig
from bitserve.engine.instance import ModelInstance
from bitserve.lifecycle.manager import ModelManager
from bitserve.lifecycle.model_files import ModelFiles, default_alias
from bitserve.log import REQUEST_ID
from bitserve.metrics.breakers import BreakerCollector
from bitserve.metrics.plugins import PluginCollector
from bitserve.metrics.prometheus import PrometheusStatsSink
from bitserve.metrics.versions import VersionCollector
from bitserve.server.batches.config import BatchConfig
from bitserve.server.batches.service import BatchService
from bitserve.server.breakers import Breakers
from bitserve.server.compression import CompressionMiddleware
from bitserve.server.errors import INTERNAL_ERROR, install_error_handlers, send_error
from bitserve.server.limits import BodyLimitMiddleware
from bitserve.server.plugins.config import PluginConfig
from bitserve.server.plugins.registry import load_plugins
from bitserve.server.response_cache.cache import ResponseCache
from bitserve.server.response_fields import valid_request_id
from bitserve.server.routes import batch_endpoints, register_routes
from bitserve.server.security.config import SecurityConfig
from bitserve.server.security.guard import Guard
from bitserve.server.security.install import install_security
from bitserve.server.state import AppState, read_build_info
from bitserve.server.tracing import TRACER_NAME, TracingMiddleware, build_tracer_provider

logger = logging.getLogger(__name__)

MULTIPART_OVERHEAD_BYTES = 64 * 1024  # a batch file's multipart framing and form fields
UPLOAD_PATH = "/v1/files"


class RequestContextMiddleware:
    """Outermost: the request id (client's if valid, else new) in logs and on every response, and
    the last-resort handler that turns an unhandled exception into a logged 500."""

    def __init__(self, app: ASGIApp, on_error: Callable[[int, str], None]) -> None:
        self.app = app
        self.on_error = on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        header = next((value for name, value in scope["headers"] if name == b"x-request-id"), b"")
        request_id = valid_request_id(header) or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        REQUEST_ID.set(request_id)  # this request's task only
        if scope["type"] == "websocket":  # the socket's id; each of its requests logs its own
            await self.app(scope, receive, send)
            return
        is_started = False

        async def send_with_id(message: Message) -> None:
            nonlocal is_started
            if message["type"] == "http.response.start":
                is_started = True
                message = {
                    **message,
                    "headers": [*message.get("headers", []), (b"x-request-id", request_id.encode())],
                }
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:  # noqa: BLE001 - the last-resort handler: log with the request id, answer 500
            logger.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            self.on_error(INTERNAL_ERROR.status, INTERNAL_ERROR.code)
            if not is_started:
                await send_error(send_with_id, exc, path=scope.get("path", ""))


def served_model_id(reference: str, served_model_name: str | None) -> str:
    """The startup model's alias: --served-model-name, else the catalog name, else the file stem."""
    if served_model_name:
        return served_model_name
    return default_alias(reference)


async def _load_startup_model(state: AppState, on_fatal: Callable[[], None] | None) -> None:
    """Load --model as the default alias (no root check: the operator chose it); fatal on failure."""
    reference = state.engine_config.model.model
    try:
        source = await asyncio.to_thread(state.models.files.trusted, reference)
        operation = state.models.submit(
            "load", served_model_id(reference, state.server_config.served_model_name), source=source
        )
        await operation.wait()
        if operation.error is not None:
            raise operation.error
    except Exception as exc:  # noqa: BLE001 - any load failure is reported the same way
        state.load_error = f"{type(exc).__name__}: {exc}"
        logger.critical("model load failed: %s", state.load_error)
        if on_fatal is not None:
            on_fatal()
    finally:
        state.is_starting = False


def build_state(server_config: ServerConfig, engine_config: EngineConfig) -> AppState:
    stats = PrometheusStatsSink()
    roots = [root for root in (server_config.model_roots or "").split(os.pathsep) if root]
    files = ModelFiles(roots)
    models = ModelManager(engine_config, server_config, stats, files)
    response_cache = ResponseCache.from_config(server_config)
    if response_cache is not None:
        stats.watch_response_cache(response_cache.stats)
    breakers = Breakers(server_config.breaker_failure_threshold, server_config.breaker_cooldown_s)
    stats.registry.register(BreakerCollector(breakers.stats))
    stats.registry.register(
        VersionCollector(
            lambda: [row for alias, entry in models.aliases.items() for row in entry.version_counters(alias)]
        )
    )
    return AppState(
        server_config,
        engine_config,
        stats,
        read_build_info(),
        models,
        response_cache=response_cache,
        breakers=breakers,
    )


def _batch_service(state: AppState, batch: BatchConfig | None) -> BatchService:
    """The app's Batch API (off without `batch`), its counts exported to /metrics when on."""
    breaker = state.breakers.get("batch_db") if batch is not None else None
    service = BatchService(batch, batch_endpoints(), state.server_config.max_body_bytes, breaker)
    if batch is not None:
        state.stats.watch_batches(service.stats)
    return service


def build_app(
    server_config: ServerConfig | None = None,
    engine_config: EngineConfig | None = None,
    *,
    instance: ModelInstance | Mapping[str, ModelInstance] | None = None,
    on_fatal: Callable[[], None] | None = None,
    security: SecurityConfig | None = None,
    tracer_provider: Any | None = None,
    batch: BatchConfig | None = None,
    plugins: PluginConfig | None = None,
) -> FastAPI:
    """The bitserve ASGI app. With `instance` (tests), serve that already-loaded model (the caller
    closes it), or a mapping of device -> instance as the replicas of one model; otherwise load
    `engine_config`'s model in the background after startup, answering 503 + Retry-After until it is
    warm. `on_fatal` runs if the model cannot be loaded. More models
    come and go through the admin routes (ModelManager). `security`: keys, JWT, limits, CORS / IP rules
    and the audit log (default: none, which serves only on a loopback address). `tracer_provider`: an
    OpenTelemetry TracerProvider (tests); by default one is built when an OTLP endpoint is configured.
    `batch`: the Batch API's database and worker settings (default: the Batch API is off, its routes
    answer 503; `bitserve serve` always passes one). `plugins`: which server plugins run (default: none);
    one that is not installed or cannot start raises InvalidRequest here, failing the start."""
    server_config = server_config or ServerConfig()
    state = build_state(server_config, engine_config or EngineConfig())
    tracer_provider = _start_tracing(state, tracer_provider)
    state.batches = _batch_service(state, batch)
    state.plugins = load_plugins(plugins or PluginConfig())
    state.stats.registry.register(PluginCollector(lambda: dict(state.plugins.num_events)))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        load_task: asyncio.Task[Any] | None = None
        if instance is not None:
            first = next(iter(instance.values())) if isinstance(instance, Mapping) else instance
            await state.models.adopt(instance, served_model_id(first.name, server_config.served_model_name))
            state.is_starting = False
        else:
            load_task = asyncio.create_task(_load_startup_model(state, on_fatal))
        await state.batches.start(app, is_ready=lambda: state.phase == "ready")
        try:
            yield
        finally:
            await state.batches.stop()  # before the engines: unfinished batch requests run again next start
            if load_task is not None:
                load_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await load_task
            await state.models.shutdown()
            if state.response_cache is not None:
                await state.response_cache.flush()
            await guard.close()
            if tracer_provider is not None:
                tracer_provider.shutdown()  # flushes the spans still batched
            logger.info("engines stopped")

    app = FastAPI(title="bitserve", version=state.build.version, lifespan=lifespan)
    app.state.bitserve = state
    register_routes(app)
    install_error_handlers(app, state.retry_after_s, state.stats.record_http_error)
    guard = _install_middleware(app, state, security, batch)
    return app


def _start_tracing(state: AppState, tracer_provider: Any | None) -> Any | None:
    """The app's TracerProvider: the one given, else one built when an OTLP endpoint is configured
    (None: tracing is off); its tracer goes on `state`."""
    endpoint = state.server_config.otel_endpoint
    if tracer_provider is None and endpoint is not None:
        tracer_provider = build_tracer_provider(endpoint, state.breakers.get("otlp"))
        logger.info("OpenTelemetry tracing to %s", endpoint)
    if tracer_provider is not None:
        state.tracer = tracer_provider.get_tracer(TRACER_NAME)
    return tracer_provider


def _install_middleware(
    app: FastAPI, state: AppState, security: SecurityConfig | None, batch: BatchConfig | None
) -> Guard:
    """Body limits, security, tracing and the request context around the routes; the security guard
    (closed by the lifespan)."""
    server_config = state.server_config
    # add_middleware wraps: the last added is outermost.
    app.add_middleware(
        BodyLimitMiddleware,
        max_body_bytes=server_config.max_body_bytes,
        body_read_timeout_s=server_config.body_read_timeout_s,
        max_header_bytes=server_config.max_header_bytes,
        on_error=state.stats.record_http_error,
        path_limits={UPLOAD_PATH: batch.batch_max_file_bytes + MULTIPART_OVERHEAD_BYTES} if batch else None,
    )
    guard = install_security(
        app,
        security or SecurityConfig(),
        server_config.host,
        on_error=state.stats.record_http_error,
        on_limiter_error=state.stats.record_limiter_error,
        limiter_breaker=state.breakers.get("redis") if security and security.rate_limit_url else None,
    )
    if server_config.compression:  # around the limits and security: their JSON errors are bodies too
        app.add_middleware(CompressionMiddleware, min_bytes=server_config.compression_min_bytes)
    if state.tracer is not None:  # inside the request context: the request id is known to the span
        app.add_middleware(TracingMiddleware, tracer=state.tracer)
    app.add_middleware(RequestContextMiddleware, on_error=state.stats.record_http_error)
    return guard
