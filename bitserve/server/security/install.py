"""install_security(): the security layer of build_app. Checks the bind rule, builds the Guard, and adds
SecurityMiddleware (and CORS when origins are configured) around the app's routes."""

from __future__ import annotations

import logging
from collections.abc import Callable

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

from bitserve.errors import InvalidRequest
from bitserve.server.breakers import CircuitBreaker
from bitserve.server.routes import route_rules
from bitserve.server.security.config import SecurityConfig, split_list
from bitserve.server.security.guard import Guard, check_bind, is_loopback_host
from bitserve.server.security.middleware import SecurityMiddleware

logger = logging.getLogger(__name__)

CORS_METHODS = ["GET", "POST"]
CORS_HEADERS = ["authorization", "content-type", "x-api-key", "x-request-id"]
CORS_EXPOSED_HEADERS = [
    "x-request-id",
    "x-model-version",
    "x-cache",  # hit | miss from the response cache
    "retry-after",
    *(
        f"x-ratelimit-{what}-{kind}"
        for what in ("limit", "remaining", "reset")
        for kind in ("requests", "tokens")
    ),
]
CORS_MAX_AGE_S = 600


def install_security(
    app: FastAPI,
    config: SecurityConfig,
    host: str,
    *,
    on_error: Callable[[int, str], None] | None = None,
    on_limiter_error: Callable[[str], None] | None = None,
    limiter_breaker: CircuitBreaker | None = None,
) -> Guard:
    """Add the security middleware (call after the routes are registered and the inner middleware is
    added: it wraps what exists). Raises InvalidRequest for a configuration that must not serve."""
    try:
        check_bind(config, host)
        guard = Guard(config, on_limiter_error, limiter_breaker)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    if not config.has_auth and is_loopback_host(host):
        logger.warning("no keys or JWT configured: serving openly on loopback %s", host)
    else:
        logger.info("authentication: %s", guard.describe())
    app.add_middleware(
        SecurityMiddleware, guard=guard, router=app.router, rules=route_rules(app), on_error=on_error
    )
    origins = list(split_list(config.cors_origins))
    if origins:
        # Credentials travel in headers, never cookies: allow_credentials stays off.
        app.add_middleware(
            CORSMiddleware,
            allow_origins=origins,
            allow_methods=CORS_METHODS,
            allow_headers=CORS_HEADERS,
            expose_headers=CORS_EXPOSED_HEADERS,
            max_age=CORS_MAX_AGE_S,
        )
    return guard
