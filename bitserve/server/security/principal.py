"""Principal (who is calling: its scopes, models and limits) and the scope vocabulary. Imports nothing
from bitserve but the exception types."""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass

from bitserve.errors import Forbidden

# What a credential may grant. `admin` grants every other scope.
SCOPES = ("inference", "models:read", "models:admin", "metrics", "admin")
# What a route may require: a scope, or `public` (no credentials needed).
PUBLIC = "public"
ROUTE_SCOPES = (PUBLIC, "inference", "models:read", "models:admin", "metrics")


@dataclass(frozen=True, slots=True)
class Limits:
    """Per-principal budgets; None is unlimited."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    tokens_per_day: int | None = None

    @property
    def is_limited(self) -> bool:
        return any(value is not None for value in (self.requests_per_minute, *self.token_limits))

    @property
    def token_limits(self) -> tuple[int | None, int | None]:
        return self.tokens_per_minute, self.tokens_per_day


NO_LIMITS = Limits()


@dataclass(frozen=True, slots=True)
class Principal:
    """An authenticated caller. `name` is what logs and the audit log show ("key:alice", "jwt:sub"),
    never a credential; `models` None means every model."""

    name: str
    scopes: frozenset[str]
    models: frozenset[str] | None = None
    limits: Limits = NO_LIMITS

    def has_scope(self, scope: str) -> bool:
        return scope == PUBLIC or "admin" in self.scopes or scope in self.scopes

    def may_use(self, model: str) -> bool:
        return self.models is None or model in self.models


# The server's own access when no auth is configured (loopback, or --allow-unauthenticated).
ANONYMOUS = Principal("anonymous", frozenset({"admin"}))
# The caller of a public route who sent no (valid) credentials.
NOBODY = Principal("unauthenticated", frozenset())

# The principal of the request the current asyncio task is handling (set by SecurityMiddleware).
# NOTE: a ContextVar, like log.REQUEST_ID, so the model checks in AppState.acquire need no request
# object threaded through; None outside a request (tests, the startup load) means no restriction.
CURRENT_PRINCIPAL: ContextVar[Principal | None] = ContextVar("bitserve_principal", default=None)


def check_model_access(model: str | None, principal: Principal | None = None) -> None:
    """Raise Forbidden when `principal` (default: the current request's) may not use `model` (an
    alias; None: the default model, which a key limited to some models must name)."""
    principal = principal or CURRENT_PRINCIPAL.get()
    if principal is None or principal.models is None:
        return
    if model is None or not principal.may_use(model):
        shown = "the default model" if model is None else repr(model[:100])
        raise Forbidden(
            f"this credential may not use {shown}",
            param="model",
            hint=f"allowed models: {', '.join(sorted(principal.models)) or '(none)'}",
        )


def check_scopes(scopes: list[str] | tuple[str, ...], where: str) -> frozenset[str]:
    """Validated scope names (unknown ones are a configuration error, raised as ValueError)."""
    unknown = sorted(set(scopes) - set(SCOPES))
    if unknown:
        raise ValueError(f"{where}: unknown scope(s) {', '.join(unknown)}; known: {', '.join(SCOPES)}")
    return frozenset(scopes)
