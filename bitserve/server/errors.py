"""THE error table: exception type -> HTTP status, OpenAI error `type` and `code`; and the one place
that renders an error as a JSON body, an SSE error event or a raw ASGI response. No other module
knows status codes.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Send

from bitserve.errors import (
    BitserveError,
    CircuitOpen,
    Conflict,
    ContextLengthExceeded,
    DeadlineExceeded,
    EngineDead,
    Forbidden,
    InvalidModelFile,
    InvalidRequest,
    LimiterUnavailable,
    ModelLoadError,
    ModelNotFound,
    ModelUnavailable,
    NotFound,
    PayloadTooLarge,
    PluginFailed,
    QueueFull,
    RateLimited,
    RequestFailed,
    RequestRefused,
    ServerShuttingDown,
    ServiceUnavailable,
    Unauthenticated,
)

logger = logging.getLogger(__name__)

# Retry-After when the engine gives no estimate (model loading, no engine yet).
DEFAULT_RETRY_AFTER_S = 5.0
# Retry-After bounds (seconds): never tell a client "0", never send it away for minutes.
MIN_RETRY_AFTER_S = 1
MAX_RETRY_AFTER_S = 60
# Health probes: pass / fail (fail carries Retry-After).
PROBE_PASS_STATUS = 200
PROBE_FAIL_STATUS = 503


class UnsupportedParameter(InvalidRequest):
    """A known OpenAI field whose behaviour bitserve does not implement (tools, response_format, ...)."""


class RequestTimeout(BitserveError):
    """The client sent its request body (or headers) too slowly."""


class HeadersTooLarge(BitserveError):
    """The request line plus headers exceed `max_header_bytes`."""


@dataclass(frozen=True, slots=True)
class ErrorSpec:
    status: int
    type: str  # OpenAI error "type"
    code: str
    has_retry_after: bool = False
    # RFC 6750: a 401 names the scheme the client should use
    has_www_authenticate: bool = False


# Most specific first: the first entry the exception is an instance of wins.
ERROR_TABLE: tuple[tuple[type[BaseException], ErrorSpec], ...] = (
    (ContextLengthExceeded, ErrorSpec(400, "invalid_request_error", "context_length_exceeded")),
    (UnsupportedParameter, ErrorSpec(400, "invalid_request_error", "unsupported_parameter")),
    (RequestRefused, ErrorSpec(400, "invalid_request_error", "request_refused")),
    (InvalidRequest, ErrorSpec(400, "invalid_request_error", "invalid_value")),
    (RequestTimeout, ErrorSpec(408, "invalid_request_error", "request_timeout")),
    (PayloadTooLarge, ErrorSpec(413, "invalid_request_error", "payload_too_large")),
    (HeadersTooLarge, ErrorSpec(431, "invalid_request_error", "headers_too_large")),
    (
        Unauthenticated,
        ErrorSpec(401, "authentication_error", "invalid_api_key", has_www_authenticate=True),
    ),
    (Forbidden, ErrorSpec(403, "permission_error", "forbidden")),
    (ModelNotFound, ErrorSpec(404, "invalid_request_error", "model_not_found")),
    (NotFound, ErrorSpec(404, "invalid_request_error", "not_found")),
    (Conflict, ErrorSpec(409, "invalid_request_error", "conflict")),
    (RateLimited, ErrorSpec(429, "rate_limit_error", "rate_limit_exceeded", has_retry_after=True)),
    (QueueFull, ErrorSpec(429, "rate_limit_error", "queue_full", has_retry_after=True)),
    (
        LimiterUnavailable,
        ErrorSpec(503, "service_unavailable", "rate_limiter_unavailable", has_retry_after=True),
    ),
    (ServerShuttingDown, ErrorSpec(503, "service_unavailable", "server_shutting_down", has_retry_after=True)),
    (ModelUnavailable, ErrorSpec(503, "service_unavailable", "model_unavailable", has_retry_after=True)),
    (CircuitOpen, ErrorSpec(503, "service_unavailable", "dependency_unavailable", has_retry_after=True)),
    (ServiceUnavailable, ErrorSpec(503, "service_unavailable", "service_unavailable")),
    (EngineDead, ErrorSpec(503, "server_error", "engine_dead", has_retry_after=True)),
    (RequestFailed, ErrorSpec(500, "server_error", "request_failed")),
    (PluginFailed, ErrorSpec(500, "server_error", "plugin_error")),
    # the client's own deadline passed (request `timeout` / X-Request-Timeout): a gateway timeout
    (DeadlineExceeded, ErrorSpec(504, "timeout_error", "deadline_exceeded")),
    # A model an admin asked for was rejected (bad file, failed validation): the old one serves on.
    (InvalidModelFile, ErrorSpec(422, "invalid_request_error", "model_rejected")),
    (ModelLoadError, ErrorSpec(422, "invalid_request_error", "model_rejected")),
)
INTERNAL_ERROR = ErrorSpec(500, "server_error", "internal_error")
# Errors Starlette raises itself (no route, wrong method), keyed by status.
HTTP_STATUS_SPECS: dict[int, ErrorSpec] = {
    404: ErrorSpec(404, "invalid_request_error", "not_found"),
    405: ErrorSpec(405, "invalid_request_error", "method_not_allowed"),
}


# The Anthropic Messages API's routes answer errors in Anthropic's shape (its SDKs read `error.type`
# and pick their exception class by status); every other route in OpenAI's.
ANTHROPIC_PATH = "/v1/messages"
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def speaks_anthropic(path: str) -> bool:
    return path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")


def lookup(exc: BaseException) -> ErrorSpec:
    for exc_type, spec in ERROR_TABLE:
        if isinstance(exc, exc_type):
            return spec
    return INTERNAL_ERROR


def error_payload(exc: BaseException, spec: ErrorSpec | None = None) -> dict[str, Any]:
    """`{"error": {message, type, param, code, hint}}`. Unknown exceptions never leak their text."""
    spec = spec or lookup(exc)
    if isinstance(exc, BitserveError):
        message, param, hint = exc.message, exc.param, exc.hint
    else:
        message, param, hint = "internal server error", None, "retry; if it persists, report the X-Request-Id"
    return {"error": {"message": message, "type": spec.type, "param": param, "code": spec.code, "hint": hint}}


def error_body(exc: BaseException, spec: ErrorSpec | None = None, path: str = "") -> dict[str, Any]:
    """The error body for a request to `path`: OpenAI's (error_payload), or on the Anthropic routes
    `{"type": "error", "error": {type, message, ...}}` with Anthropic's type for the status."""
    spec = spec or lookup(exc)
    payload = error_payload(exc, spec)
    if not speaks_anthropic(path):
        return payload
    fallback = "api_error" if spec.status >= 500 else "invalid_request_error"
    detail = {**payload["error"], "type": ANTHROPIC_ERROR_TYPES.get(spec.status, fallback)}
    return {"type": "error", "error": detail}


def retry_after_value(seconds: float | None) -> str:
    """Integer seconds, at least 1 (RFC 9110 delay-seconds)."""
    if seconds is None or not math.isfinite(seconds):
        seconds = DEFAULT_RETRY_AFTER_S
    return str(min(MAX_RETRY_AFTER_S, max(MIN_RETRY_AFTER_S, math.ceil(seconds))))


def error_headers(exc: BaseException, spec: ErrorSpec, retry_after_s: float | None) -> dict[str, str]:
    headers: dict[str, str] = {}
    if spec.has_retry_after:
        hinted = (
            exc.retry_after_s if isinstance(exc, QueueFull | RateLimited | CircuitOpen) else retry_after_s
        )
        headers["Retry-After"] = retry_after_value(hinted)
    if spec.has_www_authenticate:
        headers["WWW-Authenticate"] = "Bearer"
    return headers  # X-Request-Id is added to every response by the request-context middleware


def sse_error_event(exc: BaseException) -> bytes:
    """The SSE frame that ends a stream that already began: `data: {"error": {...}}`."""
    return b"data: " + json.dumps(error_payload(exc)).encode() + b"\n\n"


def socket_error_message(
    exc: BaseException, request_id: str | None, retry_after_s: float | None = None
) -> dict[str, Any]:
    """A WebSocket `error` message (server/websocket.py): the table's body, the HTTP status it stands
    for, and `retry_after_s` where the HTTP answer would carry Retry-After."""
    spec = lookup(exc)
    message: dict[str, Any] = {"type": "error", "id": request_id, "status": spec.status}
    retry_after = error_headers(exc, spec, retry_after_s).get("Retry-After")
    if retry_after is not None:
        message["retry_after_s"] = int(retry_after)
    return {**message, **error_payload(exc, spec)}


async def send_error(
    send: Send,
    exc: BaseException,
    *,
    close: bool = False,
    retry_after_s: float | None = None,
    path: str = "",
) -> None:
    """Answer with a JSON error from raw ASGI (middleware, before any response started); `path`: the
    request's, which picks the body's dialect."""
    spec = lookup(exc)
    body = json.dumps(error_body(exc, spec, path)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in error_headers(exc, spec, retry_after_s).items()]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": spec.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def validation_param(loc: tuple[Any, ...] | list[Any]) -> str | None:
    """A pydantic/FastAPI error location as `messages[0].content`, without `body` and union tags."""
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif isinstance(item, str) and item.isidentifier() and item not in ("body", "query", "path"):
            parts.append(("." if parts else "") + item)
    return "".join(parts) or None


def invalid_request_from_errors(errors: list[Any]) -> InvalidRequest:
    """The first of pydantic's errors as an InvalidRequest naming the field (the rest are counted)."""
    first = errors[0]
    param = validation_param(first.get("loc", ()))
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    text = f"{param}: {message}" if param else message
    if len(errors) > 1:
        text += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return InvalidRequest(text, param=param)


def allowed_methods(request: Request) -> str:
    """`Allow` for the request's path: the methods of every route with the path template of the first
    route that matches it (a template like /v1/files/{file_id} is served by one route per method)."""
    routes = [route for route in request.app.router.routes if getattr(route, "path_regex", None)]
    template = next((route.path for route in routes if route.path_regex.match(request.url.path)), None)
    methods: set[str] = set()
    for route in routes:
        if route.path == template:
            methods |= getattr(route, "methods", None) or set()
    return ", ".join(sorted(methods))


def install_error_handlers(
    app: FastAPI, retry_after_s: Callable[[], float | None], on_error: Callable[[int, str], None]
) -> None:
    """Route every handled exception through the table. `on_error(status, type)` counts it."""

    def respond(
        request: Request, exc: BaseException, spec: ErrorSpec, headers: dict[str, str] | None = None
    ) -> JSONResponse:
        on_error(spec.status, spec.code)
        if spec.status >= 500:  # 503s (loading, draining, overload) are expected; other 5xx are failures
            logger.log(
                logging.WARNING if spec.status == 503 else logging.ERROR,
                "request failed: %s %s",
                spec.code,
                exc,
            )
        return JSONResponse(
            error_body(exc, spec, request.url.path),
            status_code=spec.status,
            headers={**error_headers(exc, spec, retry_after_s()), **(headers or {})},
        )

    async def on_bitserve_error(request: Request, exc: Exception) -> JSONResponse:
        return respond(request, exc, lookup(exc))

    async def on_validation_error(request: Request, exc: Exception) -> JSONResponse:
        errors = exc.errors() if isinstance(exc, RequestValidationError) else []
        error = invalid_request_from_errors(errors) if errors else InvalidRequest("invalid request")
        return respond(request, error, lookup(error))

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        status = exc.status_code if isinstance(exc, StarletteHTTPException) else 500
        spec = HTTP_STATUS_SPECS.get(status, ErrorSpec(status, "invalid_request_error", "http_error"))
        detail = exc.detail if isinstance(exc, StarletteHTTPException) else "error"
        message = (
            f"no route for {request.method} {request.url.path[:200]}" if status in (404, 405) else str(detail)
        )
        # a 405 names every method the path has (RFC 9110): Starlette's names only its first route's
        headers = exc.headers if isinstance(exc, StarletteHTTPException) else None
        if status == 405:
            headers = {**(headers or {}), "Allow": allowed_methods(request)}
        return respond(request, BitserveError(message, hint="see GET /docs for the routes"), spec, headers)

    app.add_exception_handler(BitserveError, on_bitserve_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
