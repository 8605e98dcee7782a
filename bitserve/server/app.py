"""build_app(): the FastAPI application. Lifespan (load the model in a worker thread, start the
engine, warm up), middleware order (request context -> body limits -> routes), error handlers.
The only importer of metrics/prometheus.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from bitserve.config import EngineConfig, ServerConfig
from bitserve.frontend.async_engine import AdmissionLimits, AsyncEngine
from bitserve.log import REQUEST_ID
from bitserve.metrics.prometheus import PrometheusStatsSink
from bitserve.model_instance import ModelInstance
from bitserve.sampling_params import SamplingParams
from bitserve.server.errors import INTERNAL_ERROR, install_error_handlers, send_error
from bitserve.server.limits import BodyLimitMiddleware
from bitserve.server.routes import register_routes
from bitserve.server.state import AppState, model_info, read_build_info

logger = logging.getLogger(__name__)

MAX_REQUEST_ID_CHARS = 128
WARMUP_PROMPT = "Hello"


def valid_request_id(value: bytes) -> str | None:
    """A client X-Request-Id is kept if it is 1..128 printable ASCII characters without spaces."""
    if not 1 <= len(value) <= MAX_REQUEST_ID_CHARS or not all(0x21 <= byte <= 0x7E for byte in value):
        return None
    return value.decode("ascii")


class RequestContextMiddleware:
    """Outermost: the request id (client's if valid, else new) in logs and on every response, and
    the last-resort handler that turns an unhandled exception into a logged 500."""

    def __init__(self, app: ASGIApp, on_error: Callable[[int, str], None]) -> None:
        self.app = app
        self.on_error = on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        header = next((value for name, value in scope["headers"] if name == b"x-request-id"), b"")
        request_id = valid_request_id(header) or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        REQUEST_ID.set(request_id)  # this request's task only
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
                await send_error(send_with_id, exc)


async def _warm_up(engine: AsyncEngine) -> None:
    """One short greedy generation so the first client does not pay for lazy initialisation."""
    prompt_ids = engine.instance.tokenizer.encode(WARMUP_PROMPT) or [0]
    async for _ in engine.generate(
        prompt_ids, SamplingParams(max_tokens=2, temperature=0.0), request_id="warmup"
    ):
        pass


async def activate(state: AppState, instance: ModelInstance) -> None:
    """Start an engine over `instance`, warm it, then publish it (readiness turns green)."""
    config = state.server_config
    engine = AsyncEngine(instance, limits=AdmissionLimits.from_config(config), stats=state.stats)
    engine.start()
    try:
        if config.warmup:
            await _warm_up(engine)
    except BaseException:
        await engine.shutdown()
        raise
    state.model = model_info(instance, config.served_model_name)
    state.engine = engine
    logger.info("serving %s (%s, backend %s)", state.model.id, state.model.file_name, state.model.backend)


async def _load_and_activate(state: AppState, on_fatal: Callable[[], None] | None) -> ModelInstance | None:
    try:
        instance = await asyncio.to_thread(ModelInstance.load, state.engine_config)
    except Exception as exc:  # noqa: BLE001 - any load failure is reported the same way
        state.load_error = f"{type(exc).__name__}: {exc}"
        logger.critical("model load failed: %s", state.load_error)
        if on_fatal is not None:
            on_fatal()
        return None
    try:
        await activate(state, instance)
    except Exception as exc:  # noqa: BLE001
        state.load_error = f"warm-up failed: {type(exc).__name__}: {exc}"
        logger.critical("%s", state.load_error)
        if on_fatal is not None:
            on_fatal()
    return instance


def build_app(server_config: ServerConfig | None = None, engine_config: EngineConfig | None = None, *,
              instance: ModelInstance | None = None, on_fatal: Callable[[], None] | None = None) -> FastAPI:  # fmt: skip
    """The bitserve ASGI app. With `instance` (tests), serve that already-loaded model (the caller
    closes it); otherwise load `engine_config`'s model in the background after startup, answering
    503 + Retry-After until it is warm. `on_fatal` runs if the model cannot be loaded."""
    server_config = server_config or ServerConfig()
    state = AppState(server_config, engine_config or EngineConfig(), PrometheusStatsSink(), read_build_info())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        load_task: asyncio.Task[Any] | None = None
        if instance is not None:
            await activate(state, instance)
        else:
            load_task = asyncio.create_task(_load_and_activate(state, on_fatal))
        try:
            yield
        finally:
            loaded = None
            if load_task is not None:
                load_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    loaded = await load_task
            if state.engine is not None:
                await state.engine.shutdown()
                logger.info("engine stopped")
            if loaded is not None:
                loaded.close()

    app = FastAPI(title="bitserve", version=state.build.version, lifespan=lifespan)
    app.state.bitserve = state
    register_routes(app)
    install_error_handlers(app, state.retry_after_s, state.stats.record_http_error)
    # add_middleware wraps: the last added is outermost.
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=server_config.max_body_bytes,
                       body_read_timeout_s=server_config.body_read_timeout_s,
                       max_header_bytes=server_config.max_header_bytes, on_error=state.stats.record_http_error)  # fmt: skip
    app.add_middleware(RequestContextMiddleware, on_error=state.stats.record_http_error)
    return app
