"""THE route table: method, path, handler, scope (inference | admin | ops), one line each.
Scopes are what auth will check; ops routes (probes, metrics) stay open to the orchestrator."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import FastAPI
from pydantic import BaseModel

from bitserve.server import health, serving_admin, serving_chat, serving_completions, serving_native
from bitserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    InferenceRequest,
    TokenizeRequest,
)

Scope = Literal["inference", "admin", "ops"]


@dataclass(frozen=True, slots=True)
class Route:
    method: str
    path: str
    handler: Callable[..., Any]
    scope: Scope
    body: type[BaseModel] | None = None  # the JSON body the handler parses itself (shown in /docs)


ROUTES: tuple[Route, ...] = (
    Route(
        "POST",
        "/v1/chat/completions",
        serving_chat.create_chat_completion,
        "inference",
        ChatCompletionRequest,
    ),
    Route("POST", "/v1/completions", serving_completions.create_completion, "inference", CompletionRequest),
    Route("POST", "/v1/inference", serving_native.inference, "inference", InferenceRequest),
    Route("POST", "/v1/inference/stream", serving_native.inference_stream, "inference", InferenceRequest),
    Route("POST", "/tokenize", serving_native.tokenize, "inference", TokenizeRequest),
    Route("POST", "/detokenize", serving_native.detokenize, "inference", DetokenizeRequest),
    Route("GET", "/v1/models", serving_admin.list_models, "inference"),
    # Admin: one scope, so one auth policy covers every action that changes what is served.
    Route("GET", "/v1/models/operations/{operation_id}", serving_admin.get_operation, "admin"),
    Route("POST", "/v1/models/load", serving_admin.load_model, "admin", serving_admin.LoadModelRequest),
    Route(
        "POST",
        "/v1/models/{alias:path}/swap",
        serving_admin.swap_model,
        "admin",
        serving_admin.SwapModelRequest,
    ),
    Route("POST", "/v1/models/{alias:path}/rollback", serving_admin.rollback_model, "admin"),
    Route("POST", "/v1/models/{alias:path}/unload", serving_admin.unload_model, "admin"),
    Route("GET", "/v1/models/{model_id:path}", serving_admin.get_model, "inference"),
    Route("GET", "/v1/stats", serving_native.stats, "ops"),
    Route("GET", "/health", health.health, "ops"),
    Route("GET", "/health/live", health.live, "ops"),
    Route("GET", "/health/ready", health.ready, "ops"),
    Route("GET", "/metrics", health.metrics, "ops"),
)


def _body_schema(model: type[BaseModel]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(schema, nested definitions), with references pointing at the OpenAPI components."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    return schema, schema.pop("$defs", {})


def register_routes(app: FastAPI) -> None:
    """Add every route; bodies the handlers parse themselves are described in /openapi.json."""
    definitions: dict[str, Any] = {}
    for route in ROUTES:
        extra = None
        if route.body is not None:
            schema, nested = _body_schema(route.body)
            definitions.update(nested)
            extra = {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}
        app.add_api_route(
            route.path,
            route.handler,
            methods=[route.method],
            tags=[route.scope],
            name=route.handler.__name__,
            openapi_extra=extra,
        )
    build_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        document = build_openapi()
        document.setdefault("components", {}).setdefault("schemas", {}).update(definitions)
        return document

    app.openapi = openapi  # type: ignore[method-assign]
