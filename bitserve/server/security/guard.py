"""Guard: the security decisions, built once from SecurityConfig: who is calling (API key or JWT),
from where (allowed CIDRs, X-Forwarded-For only from trusted proxies), their limits, the audit log.
The middleware asks it; handlers reach the per-request part (RequestSecurity) through the request.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.types import Scope

from bitserve.errors import Unauthenticated
from bitserve.server.breakers import CircuitBreaker
from bitserve.server.security.audit import AuditLog
from bitserve.server.security.config import SecurityConfig, split_list
from bitserve.server.security.jwt_auth import JwtVerifier, looks_like_jwt
from bitserve.server.security.keys import AuthFile, KeyStore, load_auth_file
from bitserve.server.security.principal import ANONYMOUS, NOBODY, Principal
from bitserve.server.security.rate_limits import MemoryRateLimiter, RateLimiter, RateState, token_specs

logger = logging.getLogger(__name__)

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
MAX_FORWARDED_HOPS = 32  # X-Forwarded-For entries looked at (a longer chain is cut)
NO_CREDENTIALS = "no credentials: send `Authorization: Bearer KEY` or `x-api-key: KEY`"


def is_loopback_host(host: str) -> bool:
    """Whether binding `host` exposes the server to this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name that resolves elsewhere, or a typo: treat as exposed


def check_bind(config: SecurityConfig, host: str) -> None:
    """Refuse to serve openly on a non-loopback address unless the operator said so."""
    if config.has_auth or is_loopback_host(host):
        return
    if not config.allow_unauthenticated:
        raise ValueError(
            f"refusing to serve {host} without authentication: set --api-key (or BITSERVE_API_KEY), "
            "--auth-file, --jwt-jwks-file or --jwt-secret-file, or pass --allow-unauthenticated to serve "
            "openly on purpose"
        )
    logger.warning(
        "serving %s WITHOUT authentication (--allow-unauthenticated): anyone may call any route", host
    )


def parse_networks(value: str | None, name: str) -> tuple[Network, ...]:
    try:
        return tuple(ipaddress.ip_network(item, strict=False) for item in split_list(value))
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None


def _in(address: str, networks: tuple[Network, ...]) -> bool:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # ::ffff:10.0.0.1 is 10.0.0.1
    return any(ip in network for network in networks)


def header_values(scope: Scope, name: bytes) -> list[str]:
    return [value.decode("latin-1") for key, value in scope["headers"] if key == name]


@dataclass(slots=True)
class RequestSecurity:
    """One request's principal and rate state (the x-ratelimit-* headers read it at response start)."""

    guard: Guard
    principal: Principal
    client: str
    rate: RateState = field(default_factory=RateState)


class Guard:
    def __init__(
        self,
        config: SecurityConfig,
        on_limiter_error: Callable[[str], None] | None = None,
        limiter_breaker: CircuitBreaker | None = None,
    ) -> None:
        self.config = config
        self.has_auth = config.has_auth
        auth = load_auth_file(config.auth_file) if config.auth_file else AuthFile((), ())
        self.keys = KeyStore(auth.keys, config.api_key)
        has_jwt = bool(config.jwt_jwks_file or config.jwt_secret_file)
        self.jwt = JwtVerifier(config, auth.jwt_limits) if has_jwt else None
        self.allowed_networks = parse_networks(config.allow_cidrs, "allow_cidrs")
        self.trusted_proxies = parse_networks(config.trusted_proxies, "trusted_proxies")
        self.limiter: RateLimiter = MemoryRateLimiter()
        if config.rate_limit_url:
            from bitserve.server.security.redis_limiter import RedisRateLimiter

            self.limiter = RedisRateLimiter(
                config.rate_limit_url,
                on_error=config.rate_limit_on_error,
                on_backend_error=on_limiter_error,
                breaker=limiter_breaker,
            )
        self.audit = AuditLog(config.audit_log, config.audit_log_max_bytes) if config.audit_log else None
        self._tasks: set[asyncio.Task[Any]] = set()  # refunds in flight, referenced until done

    def describe(self) -> str:
        parts = [f"{len(self.keys)} key(s)"] if len(self.keys) else []
        if self.jwt is not None:
            parts.append(f"JWT ({', '.join(self.jwt.algorithms)})")
        return ", ".join(parts) or "none"

    # ----------------------------------------------------------------- where from

    def client_address(self, scope: Scope) -> str:
        """The peer, or with a trusted proxy as the peer, the nearest untrusted X-Forwarded-For hop."""
        peer = scope["client"][0] if scope.get("client") else ""
        if not self.trusted_proxies or not _in(peer, self.trusted_proxies):
            return peer  # no one else's X-Forwarded-For is believed
        hops = [hop.strip() for value in header_values(scope, b"x-forwarded-for") for hop in value.split(",")]
        for hop in reversed(hops[-MAX_FORWARDED_HOPS:]):
            if not _in(hop, self.trusted_proxies):
                return hop
        return peer

    def is_allowed_address(self, address: str) -> bool:
        return not self.allowed_networks or _in(address, self.allowed_networks)

    # ----------------------------------------------------------------- who

    def _credential(self, scope: Scope) -> str | None:
        """The presented key or token; Unauthenticated when the headers are malformed or disagree."""
        candidates = [value.strip() for value in header_values(scope, b"x-api-key")]
        for value in header_values(scope, b"authorization"):
            scheme, _, token = value.strip().partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                raise Unauthenticated("the Authorization header must be `Bearer KEY`")
            candidates.append(token.strip())
        if len(set(candidates)) > 1:
            raise Unauthenticated("send one credential (Authorization and x-api-key disagree)")
        return candidates[0] if candidates else None

    def authenticate(self, scope: Scope) -> Principal:
        """The caller's principal (ANONYMOUS when no auth is configured); Unauthenticated otherwise."""
        if not self.has_auth:
            return ANONYMOUS
        credential = self._credential(scope)
        if credential is None:
            raise Unauthenticated(NO_CREDENTIALS)
        return self.verify_credential(credential)

    def has_credentials(self, scope: Scope) -> bool:
        """Whether the request carries a key or token (Unauthenticated when its headers are malformed)."""
        return self._credential(scope) is not None

    def verify_credential(self, credential: str) -> Principal:
        """The principal of an API key or JWT (a WebSocket may send it in its first message)."""
        if not self.has_auth:
            return ANONYMOUS
        if self.jwt is not None and looks_like_jwt(credential):
            return self.jwt.verify(credential)
        principal = self.keys.lookup(credential)
        if principal is None:
            raise Unauthenticated("invalid API key", hint="check the key; `bitserve keys create` makes one")
        return principal

    def authenticate_optional(self, scope: Scope) -> Principal:
        """For public routes: a valid credential's principal, else NOBODY (never raises)."""
        try:
            return self.authenticate(scope)
        except Unauthenticated:
            return NOBODY

    # ----------------------------------------------------------------- limits

    def refund_later(self, principal: Principal, num_tokens: int) -> None:
        """Give back unused tokens from a synchronous callback (a stream's on_close)."""
        if num_tokens <= 0 or not token_specs(principal.limits):
            return
        task = asyncio.get_running_loop().create_task(self.limiter.refund(principal, num_tokens))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.limiter.close()
        if self.audit is not None:
            self.audit.close()
