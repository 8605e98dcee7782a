"""THE route table: method, path, handler, scope, one line each. The scope is what a caller's
credential must grant (security/middleware.py checks it, for every route, before the handler runs):
`inference`, `models:read`, `models:admin`, `metrics`, or `public` (no credential: the probes).
A route the app serves without a scope here makes build_app fail (route_rules). Method WEBSOCKET marks
a WebSocket route (its scope is checked at the upgrade and again per request message)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import FastAPI
from pydantic import BaseModel
from starlette.routing import Route as StarletteRoute
from starlette.routing import WebSocketRoute

from bitserve.server import (
    health,
    playground,
    serving_admin,
    serving_batches,
    serving_chat,
    serving_completions,
    serving_embeddings,
    serving_messages,
    serving_native,
    websocket,
)
from bitserve.server.anthropic_protocol import MessagesInput, MessagesRequest
from bitserve.server.batches.executor import Endpoint
from bitserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    InferenceRequest,
    TokenizeRequest,
)
from bitserve.server.security.principal import ROUTE_SCOPES

Scope = Literal["public", "inference", "models:read", "models:admin", "metrics"]
WEBSOCKET = "WEBSOCKET"  # Route.method of a WebSocket route
MODEL = "model"  # Route.model_param of the admin actions: the path parameter naming an alias


@dataclass(frozen=True, slots=True)
class Route:
    method: str
    path: str
    handler: Callable[..., Any]
    scope: Scope
    body: type[BaseModel] | None = None  # the JSON body the handler parses itself (shown in /docs)
    # the path parameter naming a model alias: a key limited to some models may only name those
    model_param: str | None = None
    in_schema: bool = True  # described in /openapi.json (the playground's page and files are not API)
    media_type: str = "application/json"  # of `body`


ROUTES: tuple[Route, ...] = (
    Route(
        "POST",
        "/v1/chat/completions",
        serving_chat.create_chat_completion,
        "inference",
        ChatCompletionRequest,
    ),
    Route("POST", "/v1/completions", serving_completions.create_completion, "inference", CompletionRequest),
    # The Anthropic Messages API (serving_messages.py): its own body and error shapes, the same pipeline.
    Route("POST", "/v1/messages", serving_messages.create_message, "inference", MessagesRequest),
    Route(
        "POST",
        "/v1/messages/count_tokens",
        serving_messages.count_message_tokens,
        "inference",
        MessagesInput,
    ),
    Route(
        "POST",
        "/v1/embeddings",
        serving_embeddings.create_embeddings,
        "inference",
        serving_embeddings.EmbeddingRequest,
    ),
    Route("POST", "/v1/inference", serving_native.inference, "inference", InferenceRequest),
    Route("POST", "/v1/inference/stream", serving_native.inference_stream, "inference", InferenceRequest),
    Route(WEBSOCKET, "/v1/ws", websocket.serve_socket, "inference"),
    Route("POST", "/tokenize", serving_native.tokenize, "inference", TokenizeRequest),
    Route("POST", "/detokenize", serving_native.detokenize, "inference", DetokenizeRequest),
    # The Batch API: the same scope as the requests a batch runs; files and batches belong to their creator.
    Route(
        "POST",
        "/v1/files",
        serving_batches.create_file,
        "inference",
        serving_batches.FileUploadForm,
        media_type="multipart/form-data",
    ),
    Route("GET", "/v1/files", serving_batches.list_files, "inference"),
    Route("GET", "/v1/files/{file_id}", serving_batches.get_file, "inference"),
    Route("DELETE", "/v1/files/{file_id}", serving_batches.delete_file, "inference"),
    Route("GET", "/v1/files/{file_id}/content", serving_batches.get_file_content, "inference"),
    Route(
        "POST", "/v1/batches", serving_batches.create_batch, "inference", serving_batches.CreateBatchRequest
    ),
    Route("GET", "/v1/batches", serving_batches.list_batches, "inference"),
    Route("GET", "/v1/batches/{batch_id}", serving_batches.get_batch, "inference"),
    Route("POST", "/v1/batches/{batch_id}/cancel", serving_batches.cancel_batch, "inference"),
    Route("GET", "/v1/models", serving_admin.list_models, "models:read"),
    # Admin: one scope, so one auth policy covers every action that changes what is served.
    Route("GET", "/v1/models/operations/{operation_id}", serving_admin.get_operation, "models:admin"),
    Route(
        "POST", "/v1/models/load", serving_admin.load_model, "models:admin", serving_admin.LoadModelRequest
    ),
    Route(
        "POST",
        "/v1/models/{alias:path}/swap",
        serving_admin.swap_model,
        "models:admin",
        serving_admin.SwapModelRequest,
        model_param="alias",
    ),
    Route(
        "POST",
        "/v1/models/{alias:path}/canary/promote",
        serving_admin.promote_canary,
        "models:admin",
        None,
        "alias",
    ),
    Route(
        "POST",
        "/v1/models/{alias:path}/rollback",
        serving_admin.rollback_model,
        "models:admin",
        None,
        "alias",
    ),
    Route(
        "POST", "/v1/models/{alias:path}/unload", serving_admin.unload_model, "models:admin", None, "alias"
    ),
    Route("GET", "/v1/models/{model_id:path}", serving_admin.get_model, "models:read", None, "model_id"),
    Route("GET", "/v1/stats", serving_native.stats, "metrics"),
    # /health is open; its build details are shown only to the metrics scope (health.py).
    Route("GET", "/health", health.health, "public"),
    Route("GET", "/health/live", health.live, "public"),
    Route("GET", "/health/ready", health.ready, "public"),
    Route("GET", "/metrics", health.metrics, "metrics"),
    # The web playground (server/playground.py): a static page, public; its API calls carry the user's key.
    Route("GET", "/", playground.index, "public", in_schema=False),
    Route("GET", f"{playground.ASSET_PREFIX}{{name}}", playground.asset, "public", in_schema=False),
)
# Routes FastAPI adds itself: the API description and its viewers, public like the API they describe.
FRAMEWORK_ROUTE_SCOPES: dict[str, Scope] = {
    "/openapi.json": "public",
    "/docs": "public",
    "/docs/oauth2-redirect": "public",
    "/redoc": "public",
}


def batch_endpoints() -> dict[str, Endpoint]:
    """The routes a batch line may name (url -> handler and body model), from this table."""
    table = {route.path: route for route in ROUTES if route.method == "POST"}
    endpoints = {}
    for url in serving_batches.BATCH_URLS:
        body = table[url].body
        assert body is not None, url
        endpoints[url] = Endpoint(table[url].handler, body)
    return endpoints


@dataclass(frozen=True, slots=True)
class RouteRule:
    """What the security middleware enforces for one served route."""

    scope: Scope
    path: str  # the template, for the audit log
    model_param: str | None = None


def route_rules(app: FastAPI) -> dict[int, RouteRule]:
    """id(served route) -> its rule, for every route the app serves. A route the table does not give a
    scope is a bug that would leave it unguarded: raise instead of serving it."""
    table = {(route.path, route.method): route for route in ROUTES}
    rules: dict[int, RouteRule] = {}
    for served in app.router.routes:
        path = getattr(served, "path", None)
        methods = getattr(served, "methods", None) or set()
        if isinstance(served, WebSocketRoute):
            methods = {WEBSOCKET}
        entries = [table.get((path, method)) for method in sorted(methods - {"HEAD"})] if path else []
        if entries and all(entries) and isinstance(served, StarletteRoute | WebSocketRoute):
            first = entries[0]
            assert first is not None
            rules[id(served)] = RouteRule(first.scope, first.path, first.model_param)
        elif path in FRAMEWORK_ROUTE_SCOPES:
            rules[id(served)] = RouteRule(FRAMEWORK_ROUTE_SCOPES[path], path)
        else:
            raise RuntimeError(
                f"the route {path or served!r} has no scope in server/routes.py: refusing to serve it"
            )
    for rule in rules.values():
        assert rule.scope in ROUTE_SCOPES, rule.scope
    return rules


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str
    hint: str | None


class ErrorBody(BaseModel):
    """Every error response: OpenAI's shape (server/errors.py renders it)."""

    error: ErrorDetail


# The error statuses any route may answer (server/errors.py's table, the body and header limits, auth,
# limits), documented on every route so /openapi.json describes each response the server can send.
ERROR_STATUSES = (400, 401, 403, 404, 405, 408, 409, 413, 422, 429, 431, 500, 503, 504)
ACCEPTED_STATUS = 202  # admin actions without `wait`
# 200 bodies that are not JSON, by path: Prometheus text, and SSE where a request may stream
TEXT_BODIES = {
    "/metrics": "text/plain",
    "/v1/chat/completions": "text/event-stream",
    "/v1/completions": "text/event-stream",
    "/v1/messages": "text/event-stream",
    "/v1/inference/stream": "text/event-stream",
    "/v1/files/{file_id}/content": serving_batches.JSONL_MEDIA_TYPE,
}


def _responses(route: Route) -> dict[int | str, dict[str, Any]]:
    responses: dict[int | str, dict[str, Any]] = {
        status: {"model": ErrorBody, "description": "error"} for status in ERROR_STATUSES
    }
    if route.path in TEXT_BODIES:
        responses[200] = {"description": "success", "content": {TEXT_BODIES[route.path]: {}}}
    if route.scope == "models:admin" and route.method == "POST":
        responses[ACCEPTED_STATUS] = {"description": "accepted: poll the operation's status_url"}
    return responses


def _body_schema(model: type[BaseModel]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(schema, nested definitions), with references pointing at the OpenAPI components."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    return schema, schema.pop("$defs", {})


def register_routes(app: FastAPI) -> None:
    """Add every route; bodies the handlers parse themselves are described in /openapi.json."""
    definitions: dict[str, Any] = {}
    for route in ROUTES:
        if route.method == WEBSOCKET:
            app.add_api_websocket_route(route.path, route.handler, name=route.handler.__name__)
            continue
        extra = None
        if route.body is not None:
            schema, nested = _body_schema(route.body)
            definitions.update(nested)
            extra = {"requestBody": {"required": True, "content": {route.media_type: {"schema": schema}}}}
        app.add_api_route(
            route.path,
            route.handler,
            methods=[route.method],
            tags=[route.scope],
            name=route.handler.__name__,
            openapi_extra=extra,
            responses=_responses(route),
            include_in_schema=route.in_schema,
        )
    build_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        document = build_openapi()
        document.setdefault("components", {}).setdefault("schemas", {}).update(definitions)
        return document

    app.openapi = openapi  # type: ignore[method-assign]
