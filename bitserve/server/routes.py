"""THE route table: method, path, handler, scope (inference | admin | ops), one line each.
Scopes are what auth will check; ops routes (probes, metrics) stay open to the orchestrator."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import FastAPI

from bitserve.server import health, serving_admin, serving_chat, serving_completions, serving_native

Scope = Literal["inference", "admin", "ops"]


@dataclass(frozen=True, slots=True)
class Route:
    method: str
    path: str
    handler: Callable[..., Any]
    scope: Scope


ROUTES: tuple[Route, ...] = (
    Route("POST", "/v1/chat/completions", serving_chat.create_chat_completion, "inference"),
    Route("POST", "/v1/completions", serving_completions.create_completion, "inference"),
    Route("POST", "/v1/inference", serving_native.inference, "inference"),
    Route("POST", "/v1/inference/stream", serving_native.inference_stream, "inference"),
    Route("POST", "/tokenize", serving_native.tokenize, "inference"),
    Route("POST", "/detokenize", serving_native.detokenize, "inference"),
    Route("GET", "/v1/models", serving_admin.list_models, "inference"),
    Route("GET", "/v1/models/{model_id:path}", serving_admin.get_model, "inference"),
    Route("GET", "/v1/stats", serving_native.stats, "ops"),
    Route("GET", "/health", health.health, "ops"),
    Route("GET", "/health/live", health.live, "ops"),
    Route("GET", "/health/ready", health.ready, "ops"),
    Route("GET", "/metrics", health.metrics, "ops"),
)


def register_routes(app: FastAPI) -> None:
    for route in ROUTES:
        app.add_api_route(route.path, route.handler, methods=[route.method], tags=[route.scope], name=route.handler.__name__)
