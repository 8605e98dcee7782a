"""SecurityMiddleware (ASGI): every HTTP request passes here after the request id and CORS, before the
body is read and before routing. In order:

1. the client address (X-Forwarded-For only from --trusted-proxy peers) against --allow-cidr: 403;
2. the route, matched by the app's own router (the same code and order that will dispatch it, so no
   path trick can be judged as one route and served as another) and its rule from routes.py;
3. credentials: public routes take them optionally; every other path, unknown ones included, needs
   them when auth is configured: 401 with `WWW-Authenticate: Bearer`;
4. the route's scope, and a model named in the path against the key's models: 403;
5. the principal's request budget: 429 with Retry-After.
A WebSocket upgrade is checked for the address and any credentials it carries (server/websocket.py
takes a token in the first message otherwise, and charges budgets per request message).
Responses get the security headers, and authenticated ones the x-ratelimit-* headers. Denials and
admin actions go to the audit log.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from bitserve.errors import BitserveError, Forbidden, LimiterUnavailable, RateLimited, Unauthenticated
from bitserve.server.errors import lookup, send_error
from bitserve.server.security.guard import Guard, RequestSecurity
from bitserve.server.security.principal import (
    CURRENT_PRINCIPAL,
    NOBODY,
    PUBLIC,
    Principal,
    check_model_access,
)

logger = logging.getLogger(__name__)

SECURITY_HEADERS = (
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
)
NO_STORE = (b"cache-control", b"no-store")
AUDITED_STATUSES = {401: "auth_failure", 403: "permission_denied", 429: "rate_limited"}
ADMIN_SCOPE = "models:admin"
MAX_AUDITED_PATH_CHARS = 256
SECURITY_STATE = "security"  # the RequestSecurity's key in the ASGI scope's state
POLICY_VIOLATION = 1008  # the WebSocket close code of a refused socket (RFC 6455)


class SecurityMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        *,
        guard: Guard,
        router: Any,
        rules: dict[int, Any],
        on_error: Callable[[int, str], None] | None = None,
    ) -> None:
        self.app = app
        self.guard = guard
        self.router = router
        self.rules = rules  # id(route) -> routes.RouteRule
        self.on_error = on_error

    def _match(self, scope: Scope) -> tuple[Any, dict[str, Any]]:
        """(rule, path params) of the route the router will pick (FULL first, else the first PARTIAL,
        which answers 405), or (None, {}) when none matches (404)."""
        partial: tuple[Any, dict[str, Any]] | None = None
        for route in self.router.routes:
            match, child = route.matches(scope)
            if match is Match.FULL:
                return self.rules.get(id(route)), child.get("path_params", {})
            if match is Match.PARTIAL and partial is None:
                partial = (self.rules.get(id(route)), child.get("path_params", {}))
        return partial if partial is not None else (None, {})

    def _identify(self, scope: Scope, client: str, rule: Any, *, may_defer: bool = False) -> Principal:
        """The caller, from an allowed address; `may_defer` (a WebSocket): NOBODY when auth is on and
        the upgrade carries no credentials."""
        if not self.guard.is_allowed_address(client):
            raise Forbidden("this client address may not use the server", hint="see --allow-cidr")
        if may_defer and self.guard.has_auth and not self.guard.has_credentials(scope):
            return NOBODY
        return self._authenticate(scope, rule)

    def _authenticate(self, scope: Scope, rule: Any) -> Principal:
        if rule is not None and rule.scope == PUBLIC:
            return self.guard.authenticate_optional(scope)
        return self.guard.authenticate(scope)  # unknown paths too: a 404 is for callers only

    @staticmethod
    def _authorize(principal: Principal, rule: Any, path_params: dict[str, Any]) -> None:
        if rule is None:
            return
        if not principal.has_scope(rule.scope):
            raise Forbidden(
                f"this credential lacks the {rule.scope!r} scope",
                hint=f"ask for a key or token with the {rule.scope} scope",
            )
        if rule.model_param is not None:
            check_model_access(str(path_params.get(rule.model_param, "")), principal)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await self._open_socket(scope, receive, send)
            return
        client = self.guard.client_address(scope)
        rule, path_params = self._match(scope)
        principal: Principal | None = None
        try:
            principal = self._identify(scope, client, rule)
            self._authorize(principal, rule, path_params)
            rate = await self.guard.limiter.admit(principal)
        except (Unauthenticated, Forbidden, RateLimited, LimiterUnavailable) as exc:
            await self._refuse(scope, send, exc, client, principal, rule)
            return
        context = RequestSecurity(self.guard, principal, client, rate)
        scope.setdefault("state", {})[SECURITY_STATE] = context
        status = 0

        async def send_secured(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": self._headers(message.get("headers", []), context)}
            await send(message)

        token = CURRENT_PRINCIPAL.set(principal)
        try:
            await self.app(scope, receive, send_secured)
        finally:
            CURRENT_PRINCIPAL.reset(token)
            self._audit_response(scope, status or 500, client, principal, rule)

    async def _open_socket(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A WebSocket upgrade. The address, and credentials the upgrade carries with the route's scope,
        are checked now; a refusal closes the handshake (the client sees HTTP 403). Without
        credentials where auth is on, the principal is NOBODY and the socket's handler takes a token
        in the first message. Request budgets are charged per request message, by the handler."""
        client = self.guard.client_address(scope)
        rule, path_params = self._match(scope)
        principal: Principal | None = None
        try:
            principal = self._identify(scope, client, rule, may_defer=True)
            if principal is not NOBODY:  # NOBODY: the handler asks for a token in the first message
                self._authorize(principal, rule, path_params)
        except (Unauthenticated, Forbidden) as exc:
            spec = lookup(exc)
            if self.on_error is not None:
                self.on_error(spec.status, spec.code)
            logger.warning("refused a WebSocket on %s from %s: %s", scope.get("path", "")[:256], client, exc)
            self._audit(scope, spec.status, client, principal, rule, reason=exc.message)
            await receive()  # websocket.connect
            await send({"type": "websocket.close", "code": POLICY_VIOLATION})
            return
        scope.setdefault("state", {})[SECURITY_STATE] = RequestSecurity(self.guard, principal, client)
        await self.app(scope, receive, send)

    @staticmethod
    def _headers(headers: Any, context: RequestSecurity | None) -> list[tuple[bytes, bytes]]:
        out = [(name, value) for name, value in headers if name.lower() != b"server"]
        names = {name.lower() for name, _ in out}
        out += [header for header in SECURITY_HEADERS if header[0] not in names]
        if b"cache-control" not in names:
            out.append(NO_STORE)
        if context is not None:
            out += context.rate.headers()
        return out

    async def _refuse(
        self,
        scope: Scope,
        send: Send,
        exc: BitserveError,
        client: str,
        principal: Principal | None,
        rule: Any,
    ) -> None:
        spec = lookup(exc)
        if self.on_error is not None:
            self.on_error(spec.status, spec.code)
        logger.warning(
            "refused %s %s from %s: %s %s",
            scope.get("method"),
            scope.get("path", "")[:MAX_AUDITED_PATH_CHARS],
            client,
            spec.status,
            exc.message,
        )
        self._audit(scope, spec.status, client, principal, rule, reason=exc.message)
        retry_after = exc.retry_after_s if isinstance(exc, RateLimited) else None

        async def send_secured(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": self._headers(message.get("headers", []), None)}
            await send(message)

        await send_error(send_secured, exc, retry_after_s=retry_after, path=scope.get("path", ""))

    def _audit_response(
        self, scope: Scope, status: int, client: str, principal: Principal, rule: Any
    ) -> None:
        is_admin_action = rule is not None and rule.scope == ADMIN_SCOPE and scope.get("method") != "GET"
        if status in AUDITED_STATUSES or is_admin_action:
            self._audit(scope, status, client, principal, rule)

    def _audit(
        self,
        scope: Scope,
        status: int,
        client: str,
        principal: Principal | None,
        rule: Any,
        reason: str | None = None,
    ) -> None:
        audit = self.guard.audit
        if audit is None:
            return
        is_admin_action = rule is not None and rule.scope == ADMIN_SCOPE and scope.get("method") != "GET"
        event = AUDITED_STATUSES.get(status) or ("admin_action" if is_admin_action else "denied")
        try:
            audit.record(
                event,
                request_id=scope.get("state", {}).get("request_id"),
                principal=principal.name if principal is not None else None,
                source=client,
                method=scope.get("method"),
                route=rule.path if rule is not None else None,
                path=scope.get("path", "")[:MAX_AUDITED_PATH_CHARS],
                outcome=status,
                reason=reason,
            )
        except OSError:
            logger.exception("could not write the audit log")
