"""API keys: the `--auth-file` TOML ([[keys]] and [[jwt_limits]]), key generation, and lookup of a
presented key by its SHA-256 in constant time. A key itself is never stored, logged or kept after the
lookup; the file holds `hash = "sha256:<hex>"`.

    [[keys]]
    name = "alice"
    hash = "sha256:9f86d0..."
    scopes = ["inference", "models:read"]
    models = ["chat"]              # optional: the aliases this key may use (default: all)
    requests_per_minute = 60       # optional limits
    tokens_per_minute = 20000
    tokens_per_day = 1000000

    [[jwt_limits]]                 # limits (and models) for JWT principals, matched by a claim's value
    claim = "sub"                  # default "sub"
    value = "batch-service"        # "*" matches every token
    tokens_per_minute = 100000
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from bitserve.server.security.principal import Limits, Principal, check_scopes

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

HASH_PREFIX = "sha256:"
KEY_PREFIX = "bsk_"
KEY_RANDOM_BYTES = 32  # 256 bits: beyond guessing, so one unsalted SHA-256 is enough to store it
MAX_KEY_CHARS = 512  # longer presented keys are refused before hashing
API_KEY_NAME = "api-key"  # the principal of --api-key


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _LimitFields(_Strict):
    requests_per_minute: int | None = Field(None, ge=1)
    tokens_per_minute: int | None = Field(None, ge=1)
    tokens_per_day: int | None = Field(None, ge=1)
    models: list[str] | None = None


class _KeyEntry(_LimitFields):
    name: str = Field(min_length=1, max_length=128)
    hash: str = Field(pattern=r"^sha256:[0-9a-f]{64}$")
    scopes: list[str]


class _JwtLimitEntry(_LimitFields):
    claim: str = Field("sub", min_length=1, max_length=128)
    value: str = Field(min_length=1, max_length=512)


class _AuthFileModel(_Strict):
    keys: list[_KeyEntry] = []
    jwt_limits: list[_JwtLimitEntry] = []


@dataclass(frozen=True, slots=True)
class KeyRecord:
    principal: Principal
    digest: bytes  # SHA-256 of the key


@dataclass(frozen=True, slots=True)
class JwtLimitRule:
    claim: str
    value: str  # "*" matches any value
    limits: Limits
    models: frozenset[str] | None

    def matches(self, claims: dict[str, Any]) -> bool:
        return self.claim in claims and (self.value == "*" or str(claims[self.claim]) == self.value)


@dataclass(frozen=True, slots=True)
class AuthFile:
    keys: tuple[KeyRecord, ...]
    jwt_limits: tuple[JwtLimitRule, ...]


def generate_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(KEY_RANDOM_BYTES)


def hash_key(key: str) -> str:
    """The `hash` value an auth file stores for `key`."""
    return HASH_PREFIX + hashlib.sha256(key.encode("utf-8")).hexdigest()


def _limits(entry: _LimitFields) -> tuple[Limits, frozenset[str] | None]:
    limits = Limits(entry.requests_per_minute, entry.tokens_per_minute, entry.tokens_per_day)
    return limits, frozenset(entry.models) if entry.models is not None else None


def load_auth_file(path: str) -> AuthFile:
    """Parse and check an auth file; a problem raises ValueError naming the file and entry."""
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        parsed = _AuthFileModel.model_validate(data)
    except OSError as exc:
        raise ValueError(f"cannot read the auth file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"the auth file {path} is not valid TOML: {exc}") from None
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ()))
        raise ValueError(f"the auth file {path}: {where}: {first.get('msg')}") from None
    records: list[KeyRecord] = []
    for index, entry in enumerate(parsed.keys):
        scopes = check_scopes(entry.scopes, f"{path} keys[{index}] ({entry.name})")
        limits, models = _limits(entry)
        digest = bytes.fromhex(entry.hash.removeprefix(HASH_PREFIX))
        records.append(KeyRecord(Principal(f"key:{entry.name}", scopes, models, limits), digest))
    names = [record.principal.name for record in records]
    digests = [record.digest for record in records]
    if len(set(names)) != len(names) or len(set(digests)) != len(digests):
        raise ValueError(f"the auth file {path} repeats a key name or hash")
    rules = tuple(JwtLimitRule(entry.claim, entry.value, *_limits(entry)) for entry in parsed.jwt_limits)
    return AuthFile(tuple(records), rules)


class KeyStore:
    """Presented key -> Principal. Every stored digest is compared, in constant time, on every lookup,
    so the time taken says nothing about which key (or how much of one) matched."""

    def __init__(self, records: tuple[KeyRecord, ...], api_key: str | None = None) -> None:
        if api_key is not None:
            digest = hashlib.sha256(api_key.encode("utf-8")).digest()
            records = (KeyRecord(Principal(API_KEY_NAME, frozenset({"admin"})), digest), *records)
        self.records = records

    def __len__(self) -> int:
        return len(self.records)

    def lookup(self, key: str) -> Principal | None:
        if not key or len(key) > MAX_KEY_CHARS:
            return None
        presented = hashlib.sha256(key.encode("utf-8", errors="surrogateescape")).digest()
        found: Principal | None = None
        for record in self.records:
            # NOTE: no early exit: each digest is compared whatever matched before.
            if hmac.compare_digest(presented, record.digest):
                found = record.principal
        return found
