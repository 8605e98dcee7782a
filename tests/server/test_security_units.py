"""Security parts in isolation: keys and their constant-time lookup, the auth file, the bind rule,
route scopes (every route has one), JWT checks and attacks, token buckets, X-Forwarded-For, redaction."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import pytest
import security_testing as st
from fastapi import FastAPI

from bitserve.errors import RateLimited, Unauthenticated
from bitserve.log import RedactionFilter
from bitserve.server.routes import ROUTES, route_rules
from bitserve.server.security.config import SecurityConfig
from bitserve.server.security.guard import Guard, check_bind, is_loopback_host
from bitserve.server.security.jwt_auth import JwtVerifier
from bitserve.server.security.keys import KeyStore, generate_key, hash_key, load_auth_file
from bitserve.server.security.principal import ROUTE_SCOPES, Limits, Principal
from bitserve.server.security.rate_limits import MemoryRateLimiter, duration_text


def test_keys_are_random_and_stored_as_hashes(tmp_path: Path) -> None:
    first, second = generate_key(), generate_key()
    assert first != second and len(first) > 40
    assert hash_key("abc") == "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    auth = load_auth_file(str(st.write_auth_file(tmp_path / "auth.toml")))
    store = KeyStore(auth.keys)
    assert store.lookup(st.key_of("admin")).name == "key:admin"  # type: ignore[union-attr]
    assert store.lookup(st.key_of("only_a")).models == frozenset({"a"})  # type: ignore[union-attr]
    for wrong in ("", "x", st.key_of("admin")[:-1], st.key_of("admin") + "x", "a" * 10_000):
        assert store.lookup(wrong) is None
    assert "bsk_test" not in (tmp_path / "auth.toml").read_text()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[[keys]]\nname = "a"\nhash = "abc"\nscopes = []\n', "hash"),
        ('[[keys]]\nname = "a"\nhash = "sha256:' + "0" * 64 + '"\nscopes = ["root"]\n', "unknown scope"),
        ('[[keys]]\nname = "a"\nhash = "sha256:' + "0" * 64 + '"\nscopes = []\nextra = 1\n', "extra"),
        ("[[keys]]\nname = 'a'\n", "hash"),
        ("not toml [", "TOML"),
    ],
)
def test_bad_auth_files_are_refused(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "auth.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_auth_file(str(path))


def test_a_non_loopback_bind_needs_auth_or_the_explicit_flag() -> None:
    assert is_loopback_host("127.0.0.1") and is_loopback_host("::1") and is_loopback_host("localhost")
    assert not is_loopback_host("0.0.0.0") and not is_loopback_host("example.com")
    check_bind(SecurityConfig(), "127.0.0.1")
    with pytest.raises(ValueError, match="--api-key.*--auth-file.*--allow-unauthenticated"):
        check_bind(SecurityConfig(), "0.0.0.0")
    check_bind(SecurityConfig(allow_unauthenticated=True), "0.0.0.0")
    check_bind(SecurityConfig(api_key="k" * 32), "0.0.0.0")


def test_every_served_route_has_a_scope() -> None:
    from bitserve.server.app import build_app

    app = build_app()
    rules = route_rules(app)
    assert len(rules) == len(app.router.routes)
    assert {rule.scope for rule in rules.values()} <= set(ROUTE_SCOPES)
    public = sorted(rule.path for rule in rules.values() if rule.scope == "public")
    assert public == sorted(
        [
            "/",
            "/playground/{name}",
            "/health",
            "/health/live",
            "/health/ready",
            "/openapi.json",
            "/docs",
            "/docs/oauth2-redirect",
            "/redoc",
        ]
    )
    admin = {route.path for route in ROUTES if route.scope == "models:admin"}
    assert "/v1/models/load" in admin and "/v1/models/{alias:path}/swap" in admin


def test_a_route_without_a_scope_fails_the_build() -> None:
    app = FastAPI()

    async def sneaky() -> dict[str, str]:
        return {}

    app.add_api_route("/v1/backdoor", sneaky, methods=["POST"])
    with pytest.raises(RuntimeError, match="/v1/backdoor.*no scope"):
        route_rules(app)


def test_scopes() -> None:
    reader = Principal("k", frozenset({"models:read"}))
    assert reader.has_scope("models:read") and reader.has_scope("public")
    assert not reader.has_scope("models:admin") and not reader.has_scope("metrics")
    root = Principal("r", frozenset({"admin"}))
    assert all(root.has_scope(scope) for scope in ROUTE_SCOPES)


# ----------------------------------------------------------------- JWT


@pytest.fixture(scope="module")
def signing(tmp_path_factory: pytest.TempPathFactory) -> st.SigningKeys:
    return st.make_signing_keys(tmp_path_factory.mktemp("jwks"))


@pytest.fixture(scope="module")
def verifier(signing: st.SigningKeys) -> JwtVerifier:
    config = SecurityConfig(
        jwt_jwks_file=str(signing.jwks_path), jwt_issuer=st.ISSUER, jwt_audience=st.AUDIENCE
    )
    return JwtVerifier(config)


def test_jwt_accepts_rs256_and_es256(verifier: JwtVerifier, signing: st.SigningKeys) -> None:
    principal = verifier.verify(st.rs256(signing, scope="inference models:read bogus"))
    assert principal.name == "jwt:user-1" and principal.scopes == frozenset({"inference", "models:read"})
    assert verifier.verify(st.es256(signing, scope=None, scp=["metrics"])).scopes == frozenset({"metrics"})
    # leeway: expired 5 s ago is still within the default 30 s
    assert verifier.verify(st.rs256(signing, exp=int(time.time()) - 5)).name == "jwt:user-1"


@pytest.mark.parametrize(
    "attack",
    [
        "alg_none",
        "hs256_with_rsa_public_key",
        "expired",
        "not_yet_valid",
        "wrong_issuer",
        "wrong_audience",
        "tampered_payload",
        "no_exp",
        "unknown_kid",
        "es256_header_on_rsa_key",
        "garbage",
    ],
)
def test_jwt_attacks_are_refused(verifier: JwtVerifier, signing: st.SigningKeys, attack: str) -> None:
    now = int(time.time())
    tokens = {
        "alg_none": lambda: st.unsigned(scope="admin"),
        "hs256_with_rsa_public_key": lambda: st.hs256_with_public_key(signing, scope="admin"),
        "expired": lambda: st.rs256(signing, exp=now - 120),
        "not_yet_valid": lambda: st.rs256(signing, nbf=now + 120),
        "wrong_issuer": lambda: st.rs256(signing, iss="https://evil.test"),
        "wrong_audience": lambda: st.rs256(signing, aud="other"),
        "tampered_payload": lambda: st.tampered(st.rs256(signing), scope="admin"),
        "no_exp": lambda: st.rs256(signing, exp=None),
        "unknown_kid": lambda: st.rs256(signing).replace(
            st.rs256(signing).split(".")[0], st.b64(b'{"alg":"RS256","kid":"x"}')
        ),
        "es256_header_on_rsa_key": lambda: st.tampered(st.rs256(signing)).replace(
            st.rs256(signing).split(".")[0], st.b64(b'{"alg":"ES256","kid":"rsa-1"}')
        ),
        "garbage": lambda: "a.b.c",
    }
    with pytest.raises(Unauthenticated):
        verifier.verify(tokens[attack]())


def test_jwt_configuration_refuses_algorithm_confusion(signing: st.SigningKeys, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="HS256"):
        JwtVerifier(SecurityConfig(jwt_jwks_file=str(signing.jwks_path), jwt_algorithms="RS256,HS256"))
    secret = tmp_path / "secret"
    secret.write_bytes(st.HMAC_SECRET)
    with pytest.raises(ValueError, match="none"):
        JwtVerifier(SecurityConfig(jwt_secret_file=str(secret), jwt_algorithms="none"))
    secret.write_bytes(b"short")
    with pytest.raises(ValueError, match="under 32 bytes"):
        JwtVerifier(SecurityConfig(jwt_secret_file=str(secret)))


def test_jwt_limits_by_claim(tmp_path: Path, signing: st.SigningKeys) -> None:
    rules = '\n[[jwt_limits]]\nclaim = "tier"\nvalue = "free"\nrequests_per_minute = 5\nmodels = ["a"]\n'
    auth = load_auth_file(str(st.write_auth_file(tmp_path / "auth.toml", jwt_limits=rules)))
    verifier = JwtVerifier(SecurityConfig(jwt_jwks_file=str(signing.jwks_path)), auth.jwt_limits)
    free = verifier.verify(st.rs256(signing, tier="free", aud=None, iss=None))
    assert free.limits.requests_per_minute == 5 and free.models == frozenset({"a"})
    assert verifier.verify(st.rs256(signing, tier="paid", aud=None, iss=None)).limits == Limits()


# ----------------------------------------------------------------- limits


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_token_buckets_refill_and_refund() -> None:
    clock = FakeClock()
    limiter = MemoryRateLimiter(clock=clock)
    principal = Principal("p", frozenset(), None, Limits(requests_per_minute=2, tokens_per_minute=60))

    async def run() -> None:
        state = await limiter.admit(principal)
        assert state.requests.remaining == 1 and state.tokens.remaining == 60  # type: ignore[union-attr]
        await limiter.admit(principal)
        with pytest.raises(RateLimited) as refused:
            await limiter.admit(principal)
        assert 29 < refused.value.retry_after_s <= 30  # one request per 30 s
        clock.now += 30
        await limiter.admit(principal)
        charged = await limiter.charge(principal, 50)
        assert charged.tokens.remaining == 10  # type: ignore[union-attr]
        with pytest.raises(RateLimited):
            await limiter.charge(principal, 20)
        await limiter.refund(principal, 40)  # used 10 of the 50
        assert (await limiter.charge(principal, 45)).tokens.remaining == 5  # type: ignore[union-attr]
        with pytest.raises(RateLimited, match="more than the limit"):
            await limiter.charge(principal, 61)

    asyncio.run(run())


def test_reset_durations_read_like_openai() -> None:
    assert [duration_text(s) for s in (0.02, 1, 59.5, 360, 3723)] == ["20ms", "1s", "1m0s", "6m0s", "1h2m3s"]


# ----------------------------------------------------------------- where from


def _scope(peer: str, forwarded: str | None = None) -> dict[str, object]:
    headers = [(b"x-forwarded-for", forwarded.encode())] if forwarded is not None else []
    return {"type": "http", "client": (peer, 1234), "headers": headers}


def test_x_forwarded_for_is_believed_only_from_trusted_proxies() -> None:
    guard = Guard(SecurityConfig(trusted_proxies="10.0.0.0/8", allow_cidrs="192.0.2.0/24,10.9.9.9/32"))
    assert guard.client_address(_scope("203.0.113.5", "192.0.2.7")) == "203.0.113.5"  # spoofed: ignored
    assert guard.client_address(_scope("10.0.0.2", "198.51.100.1, 192.0.2.7")) == "192.0.2.7"
    assert guard.client_address(_scope("10.0.0.2", "192.0.2.7, 10.0.0.3")) == "192.0.2.7"  # proxy chain
    assert guard.client_address(_scope("10.0.0.2")) == "10.0.0.2"
    assert guard.is_allowed_address("192.0.2.7") and not guard.is_allowed_address("203.0.113.5")
    assert guard.is_allowed_address("::ffff:192.0.2.8") and not guard.is_allowed_address("not-an-ip")


def test_credentials_never_reach_a_log_line(caplog: pytest.LogCaptureFixture) -> None:
    record = logging.LogRecord(
        "x", logging.INFO, "", 0, "headers %s", ([(b"authorization", b"Bearer sk-1")],), None
    )
    RedactionFilter().filter(record)
    assert "sk-1" not in record.getMessage() and "[REDACTED]" in record.getMessage()
    record = logging.LogRecord("x", logging.INFO, "", 0, "x-api-key: bsk_abc and Bearer eyJ.a.b", (), None)
    RedactionFilter().filter(record)
    assert "bsk_abc" not in record.getMessage() and "eyJ" not in record.getMessage()
