"""JWT bearer tokens (PyJWT): HS256 with a secret file, or RS256 / ES256 with a JWKS file; issuer,
audience, exp / nbf (with leeway) checked; scopes from `scope` (space-separated) or `scp`; `sub` is
the principal. The algorithm list is fixed at startup from the key kind: an HMAC algorithm is never
accepted with public keys (the RS256 -> HS256 confusion), and `none` never at all."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import jwt
from jwt import PyJWK

from bitserve.errors import Unauthenticated
from bitserve.server.security.config import SecurityConfig, split_list
from bitserve.server.security.keys import JwtLimitRule
from bitserve.server.security.principal import NO_LIMITS, SCOPES, Principal

logger = logging.getLogger(__name__)

HMAC_ALGORITHMS = frozenset({"HS256", "HS384", "HS512"})
ASYMMETRIC_ALGORITHMS = frozenset(
    {"RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA"}
)
# the JWK `kty` each algorithm family needs (by the algorithm's first two letters)
KEY_TYPE_OF = {"RS": "RSA", "PS": "RSA", "ES": "EC", "Ed": "OKP"}
DEFAULT_JWKS_ALGORITHMS = ("RS256", "ES256")
DEFAULT_SECRET_ALGORITHMS = ("HS256",)
MIN_SECRET_BYTES = 32  # RFC 7518 3.2: an HS256 key of at least the hash size
MAX_TOKEN_CHARS = 8192
MAX_SUB_CHARS = 256


def looks_like_jwt(token: str) -> bool:
    """Three dot-separated segments: what a compact JWS is (API keys contain no dots)."""
    return token.count(".") == 2


def _algorithms(config: SecurityConfig, allowed: frozenset[str], default: tuple[str, ...]) -> list[str]:
    names = list(split_list(config.jwt_algorithms)) or list(default)
    wrong = [name for name in names if name not in allowed]
    if wrong:
        kind = "a secret file" if allowed is HMAC_ALGORITHMS else "a JWKS file"
        raise ValueError(f"jwt_algorithms: {', '.join(wrong)} cannot be used with {kind}")
    return names


class JwtVerifier:
    """Checks a bearer JWT and turns its claims into a Principal (limits from [[jwt_limits]])."""

    def __init__(self, config: SecurityConfig, limit_rules: tuple[JwtLimitRule, ...] = ()) -> None:
        self.issuer = config.jwt_issuer
        self.audience = config.jwt_audience
        self.leeway_s = config.jwt_leeway_s
        self.limit_rules = limit_rules
        self.keys: dict[str | None, Any] = {}  # kid -> key (None: the one key of a secret / 1-key JWKS)
        if config.jwt_secret_file:
            secret = _read(config.jwt_secret_file).strip()
            if len(secret) < MIN_SECRET_BYTES:
                raise ValueError(
                    f"the JWT secret in {config.jwt_secret_file} is under {MIN_SECRET_BYTES} bytes"
                )
            self.algorithms = _algorithms(config, HMAC_ALGORITHMS, DEFAULT_SECRET_ALGORITHMS)
            self.keys[None] = secret
        elif config.jwt_jwks_file:
            self.algorithms = _algorithms(config, ASYMMETRIC_ALGORITHMS, DEFAULT_JWKS_ALGORITHMS)
            self.keys = _load_jwks(config.jwt_jwks_file)
        else:
            raise ValueError("JwtVerifier needs jwt_secret_file or jwt_jwks_file")

    def _key_for(self, token: str) -> Any:
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError:
            raise Unauthenticated("the bearer token is not a valid JWT") from None
        if header.get("alg") not in self.algorithms:
            raise Unauthenticated(f"JWT algorithm {str(header.get('alg'))[:16]!r} is not accepted")
        kid = header.get("kid")
        if kid in self.keys:
            entry = self.keys[kid]
        elif len(self.keys) == 1 and kid is None:
            entry = next(iter(self.keys.values()))
        else:
            raise Unauthenticated("the JWT's key id (kid) is not one of the configured keys")
        if isinstance(entry, tuple):  # a JWKS key: its type must be the algorithm's family
            key_type, key = entry
            if KEY_TYPE_OF.get(str(header["alg"])[:2]) != key_type:
                raise Unauthenticated("the JWT's algorithm does not match its key's type")
            return key
        return entry

    def verify(self, token: str) -> Principal:
        """The token's principal; Unauthenticated for any defect (the reason goes to the client)."""
        if len(token) > MAX_TOKEN_CHARS:
            raise Unauthenticated("the bearer token is too long")
        key = self._key_for(token)
        try:
            claims = jwt.decode(
                token,
                key,
                algorithms=self.algorithms,
                issuer=self.issuer,
                audience=self.audience,
                leeway=self.leeway_s,
                options={"require": ["exp", "sub"], "verify_aud": self.audience is not None},
            )
        except jwt.PyJWTError as exc:
            raise Unauthenticated(f"the JWT was rejected: {_reason(exc)}") from None
        return self._principal(claims)

    def _principal(self, claims: dict[str, Any]) -> Principal:
        sub = claims.get("sub")
        if not isinstance(sub, str) or not 0 < len(sub) <= MAX_SUB_CHARS:
            raise Unauthenticated("the JWT's sub claim must be a non-empty string")
        raw = claims.get("scope", claims.get("scp", ""))
        names = raw.split() if isinstance(raw, str) else raw if isinstance(raw, list) else []
        # Unknown scopes in a token are ignored (issuers add their own), not an error.
        scopes = frozenset(name for name in names if isinstance(name, str) and name in SCOPES)
        rule = next((rule for rule in self.limit_rules if rule.matches(claims)), None)
        if rule is None:
            return Principal(f"jwt:{sub}", scopes, None, NO_LIMITS)
        return Principal(f"jwt:{sub}", scopes, rule.models, rule.limits)


def _reason(exc: jwt.PyJWTError) -> str:
    """Short, fixed texts: the token's content is never echoed back."""
    for kind, text in (
        (jwt.ExpiredSignatureError, "expired"),
        (jwt.ImmatureSignatureError, "not yet valid (nbf / iat)"),
        (jwt.InvalidIssuerError, "wrong issuer"),
        (jwt.InvalidAudienceError, "wrong audience"),
        (jwt.MissingRequiredClaimError, "a required claim (exp, sub) is missing"),
        (jwt.InvalidSignatureError, "bad signature"),
        (jwt.InvalidAlgorithmError, "algorithm not accepted"),
    ):
        if isinstance(exc, kind):
            return text
    return "malformed"


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}") from None


def _load_jwks(path: str) -> dict[str | None, Any]:
    """kid -> (key type, public key). Private or symmetric (`oct`) keys in the set are refused."""
    try:
        data = json.loads(_read(path))
        entries = data["keys"] if isinstance(data, dict) and "keys" in data else [data]
        keys: dict[str | None, Any] = {}
        for entry in entries:
            _check_public(entry, path)
            jwk = PyJWK.from_dict(entry)
            keys[jwk.key_id] = (jwk.key_type, jwk.key)
    except (ValueError, TypeError, KeyError, jwt.PyJWTError) as exc:
        raise ValueError(f"the JWKS file {path} is not usable: {exc}") from None
    if not keys:
        raise ValueError(f"the JWKS file {path} holds no keys")
    return keys


def _check_public(entry: Any, path: str) -> None:
    if not isinstance(entry, dict):
        raise ValueError("each key must be a JSON object")
    if entry.get("kty") == "oct":
        raise ValueError(f"{path}: a symmetric (oct) key does not belong in a JWKS file; use jwt_secret_file")
    if "d" in entry:  # a private key: the server needs only the public half
        raise ValueError(f"{path}: the JWKS holds a private key; publish only the public keys")
