"""Helpers for the security tests: auth files with known keys, RSA / EC key pairs, JWKS files, tokens."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from bitserve.server.security.keys import hash_key

# name -> (key, scopes, extra TOML lines)
KEYS: dict[str, tuple[str, list[str], list[str]]] = {
    "admin": ("bsk_test_admin_key_0000000000000000", ["admin"], []),
    "infer": ("bsk_test_inference_key_00000000000000", ["inference", "models:read"], []),
    "reader": ("bsk_test_reader_key_000000000000000000", ["models:read"], []),
    "ops": ("bsk_test_metrics_key_00000000000000000", ["metrics"], []),
    "modeladmin": ("bsk_test_models_admin_key_0000000000", ["models:admin", "models:read"], []),
    "scopeless": ("bsk_test_scopeless_key_0000000000000", [], []),
    "only_a": ("bsk_test_only_model_a_key_0000000000", ["inference", "models:read"], ['models = ["a"]']),
    "limited": (
        "bsk_test_limited_key_000000000000000000",
        ["inference", "models:read"],
        ["requests_per_minute = 3"],
    ),
    "tokens": ("bsk_test_token_quota_key_00000000000", ["inference"], ["tokens_per_minute = 100"]),
}
ISSUER = "https://issuer.test"
AUDIENCE = "bitserve-test"
HMAC_SECRET = b"0123456789abcdef0123456789abcdef-test-secret"


def key_of(name: str) -> str:
    return KEYS[name][0]


def bearer(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key_of(name)}"}


def write_auth_file(path: Path, *, jwt_limits: str = "") -> Path:
    blocks = []
    for name, (key, scopes, extra) in KEYS.items():
        lines = [
            "[[keys]]",
            f'name = "{name}"',
            f'hash = "{hash_key(key)}"',
            f"scopes = {json.dumps(scopes)}",
        ]
        blocks.append("\n".join(lines + extra))
    path.write_text("\n\n".join(blocks) + "\n" + jwt_limits, encoding="utf-8")
    return path


@dataclass
class SigningKeys:
    rsa_private: Any
    ec_private: Any
    rsa_public_pem: bytes
    jwks_path: Path


def make_signing_keys(folder: Path) -> SigningKeys:
    rsa_private = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    ec_private = ec.generate_private_key(ec.SECP256R1())
    keys = []
    for kid, private in (("rsa-1", rsa_private), ("ec-1", ec_private)):
        algorithm = jwt.algorithms.RSAAlgorithm if kid.startswith("rsa") else jwt.algorithms.ECAlgorithm
        jwk = json.loads(algorithm.to_jwk(private.public_key()))
        keys.append({**jwk, "kid": kid, "use": "sig"})
    jwks_path = folder / "jwks.json"
    jwks_path.write_text(json.dumps({"keys": keys}))
    pem = rsa_private.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return SigningKeys(rsa_private, ec_private, pem, jwks_path)


def claims(**overrides: Any) -> dict[str, Any]:
    now = int(time.time())
    base = {
        "sub": "user-1",
        "iss": ISSUER,
        "aud": AUDIENCE,
        "iat": now,
        "exp": now + 300,
        "scope": "inference",
    }
    base.update(overrides)
    return {key: value for key, value in base.items() if value is not None}


def rs256(keys: SigningKeys, **overrides: Any) -> str:
    return jwt.encode(claims(**overrides), keys.rsa_private, algorithm="RS256", headers={"kid": "rsa-1"})


def es256(keys: SigningKeys, **overrides: Any) -> str:
    return jwt.encode(claims(**overrides), keys.ec_private, algorithm="ES256", headers={"kid": "ec-1"})


def b64(data: bytes) -> str:
    import base64

    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def unsigned(**overrides: Any) -> str:
    """alg: none, no signature."""
    header = b64(json.dumps({"alg": "none", "typ": "JWT"}).encode())
    return f"{header}.{b64(json.dumps(claims(**overrides)).encode())}."


def hs256_with_public_key(keys: SigningKeys, **overrides: Any) -> str:
    """The RS256 -> HS256 confusion: an HMAC signed with the server's public key (built by hand:
    PyJWT itself refuses a PEM as an HMAC secret)."""
    import hashlib
    import hmac

    header = b64(json.dumps({"alg": "HS256", "typ": "JWT", "kid": "rsa-1"}).encode())
    payload = b64(json.dumps(claims(**overrides)).encode())
    signature = hmac.new(keys.rsa_public_pem, f"{header}.{payload}".encode(), hashlib.sha256).digest()
    return f"{header}.{payload}.{b64(signature)}"


def tampered(token: str, **overrides: Any) -> str:
    """The same signature over a changed payload."""
    header, _, signature = token.split(".")
    return f"{header}.{b64(json.dumps(claims(**overrides)).encode())}.{signature}"
