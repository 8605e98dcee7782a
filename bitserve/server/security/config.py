"""SecurityConfig: the single home of every auth, limit, CORS / IP and audit default. `server/settings.py`
fills it from flags, `BITSERVE_*` variables and TOML like the other config dataclasses. Imports no
other bitserve module."""

from __future__ import annotations

from dataclasses import dataclass, field

RATE_LIMIT_ON_ERROR = ("open", "closed")
DEFAULT_AUDIT_LOG_MAX_BYTES = 100 * 1024 * 1024
# exp / nbf tolerance: clocks of the token issuer and this host drift by seconds, not minutes.
DEFAULT_JWT_LEEWAY_S = 30.0


def _help(text: str) -> dict[str, str]:
    return {"help": text}


def split_list(value: str | None) -> tuple[str, ...]:
    """A comma-separated setting ("a, b,") as a tuple of its non-empty, stripped items."""
    return tuple(item.strip() for item in (value or "").split(",") if item.strip())


@dataclass(frozen=True, slots=True)
class SecurityConfig:
    """Who may call what, how often, from where, and the audit trail. Invalid values raise ValueError."""

    api_key: str | None = field(
        default=None,
        metadata=_help("one API key with every scope (prefer BITSERVE_API_KEY: flags show in `ps`)"),
    )
    auth_file: str | None = field(
        default=None,
        metadata=_help("TOML file of [[keys]] (sha256 hashes, scopes, models, limits) and [[jwt_limits]]"),
    )
    jwt_jwks_file: str | None = field(
        default=None, metadata=_help("JSON Web Key Set file of the public keys that sign accepted JWTs")
    )
    jwt_secret_file: str | None = field(
        default=None, metadata=_help("file holding the shared secret of HS256-signed JWTs")
    )
    jwt_issuer: str | None = field(default=None, metadata=_help("required JWT `iss` claim (unset: any)"))
    jwt_audience: str | None = field(default=None, metadata=_help("required JWT `aud` claim (unset: none)"))
    jwt_algorithms: str | None = field(
        default=None,
        metadata=_help(
            "accepted JWT algorithms, comma-separated (default RS256,ES256 with a JWKS, HS256 "
            "with a secret; `none` is never accepted)"
        ),
    )
    jwt_leeway_s: float = field(
        default=DEFAULT_JWT_LEEWAY_S, metadata=_help("seconds of clock skew allowed on JWT exp / nbf")
    )
    allow_unauthenticated: bool = field(
        default=False,
        metadata=_help("serve without keys or JWT on a non-loopback address (refused otherwise)"),
    )
    rate_limit_url: str | None = field(
        default=None,
        metadata=_help("redis://HOST:PORT/N: share the per-principal limits across replicas (unset: memory)"),
    )
    rate_limit_on_error: str = field(
        default="closed",
        metadata=_help("when the Redis limiter fails: closed (refuse with 503) or open (serve unlimited)"),
    )
    cors_origins: str | None = field(
        default=None,
        metadata=_help("browser origins allowed by CORS, comma-separated; --cors-origin is repeatable"),
    )
    allow_cidrs: str | None = field(
        default=None,
        metadata=_help(
            "client networks allowed to connect, comma-separated CIDRs (default: all); "
            "--allow-cidr is repeatable"
        ),
    )
    trusted_proxies: str | None = field(
        default=None,
        metadata=_help(
            "proxy CIDRs whose X-Forwarded-For is believed, comma-separated; --trusted-proxy "
            "is repeatable (default: none)"
        ),
    )
    audit_log: str | None = field(
        default=None,
        metadata=_help("hash-chained JSON-lines audit log of admin actions, auth failures and denials"),
    )
    audit_log_max_bytes: int = field(
        default=DEFAULT_AUDIT_LOG_MAX_BYTES,
        metadata=_help("rotate the audit log to PATH.1, PATH.2, ... past this size (0: never)"),
    )

    def __post_init__(self) -> None:
        if self.rate_limit_on_error not in RATE_LIMIT_ON_ERROR:
            raise ValueError(f"rate_limit_on_error must be open or closed, got {self.rate_limit_on_error!r}")
        if self.jwt_jwks_file and self.jwt_secret_file:
            raise ValueError("give jwt_jwks_file or jwt_secret_file, not both")
        if not 0 <= self.jwt_leeway_s <= 300:
            raise ValueError(f"jwt_leeway_s must be in [0, 300], got {self.jwt_leeway_s}")
        if self.audit_log_max_bytes < 0:
            raise ValueError(f"audit_log_max_bytes must be >= 0, got {self.audit_log_max_bytes}")
        if self.api_key is not None and len(self.api_key) < 16:
            raise ValueError("api_key must be at least 16 characters (`bitserve keys create` makes one)")
        if self.rate_limit_url is not None and not self.rate_limit_url.startswith(("redis://", "rediss://")):
            raise ValueError("rate_limit_url must be a redis:// or rediss:// URL")

    @property
    def has_auth(self) -> bool:
        """Keys or JWT configured: every non-public route needs credentials."""
        return bool(self.api_key or self.auth_file or self.jwt_jwks_file or self.jwt_secret_file)
