"""The security layer in the app (in process): 401 / 403 / 429 bodies and headers, every route's scope
for every kind of key, models a key may use, request and token limits, /health's build details, CORS,
security headers and the audit trail."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import security_testing as st
from conftest import IN_PROCESS_SERVER
from fastapi.testclient import TestClient

from bitserve.server.routes import ROUTES, WEBSOCKET
from bitserve.server.security.audit import verify_chain
from bitserve.server.security.config import SecurityConfig

ERROR_KEYS = {"message", "type", "param", "code", "hint"}
ORIGIN = "https://app.example"
SERVED = "a"  # the synthetic model's alias here; key `only_a` may use it and nothing else


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory, synthetic_instance: object) -> Iterator[TestClient]:
    from dataclasses import replace

    from bitserve.server.app import build_app

    folder = tmp_path_factory.mktemp("secured")
    security = SecurityConfig(
        auth_file=str(st.write_auth_file(folder / "auth.toml")),
        cors_origins=ORIGIN,
        audit_log=str(folder / "audit.log"),
    )
    app = build_app(
        replace(IN_PROCESS_SERVER, served_model_name=SERVED), instance=synthetic_instance, security=security
    )  # type: ignore[arg-type]
    with TestClient(app) as client:
        client.audit_path = folder / "audit.log"  # type: ignore[attr-defined]
        yield client


def error_of(response: object, status: int, error_type: str) -> dict[str, object]:
    assert response.status_code == status, response.text  # type: ignore[attr-defined]
    error = response.json()["error"]  # type: ignore[attr-defined]
    assert set(error) == ERROR_KEYS and error["type"] == error_type
    return error


def call(client: TestClient, method: str, path: str, key: str | None = None, **kwargs: object) -> object:
    headers = {**st.bearer(key)} if key else {}
    headers.update(kwargs.pop("headers", {}))  # type: ignore[arg-type]
    return client.request(method, path, headers=headers, **kwargs)  # type: ignore[arg-type]


def concrete(path: str) -> str:
    return (
        path.replace("{alias:path}", SERVED)
        .replace("{model_id:path}", SERVED)
        .replace("{operation_id}", "op-1")
    )


@pytest.mark.parametrize(
    "route",
    [r for r in ROUTES if r.scope != "public" and r.method != WEBSOCKET],  # test_websocket.py: /v1/ws
    ids=lambda r: f"{r.method} {r.path}",
)
def test_every_guarded_route_needs_credentials(secured: TestClient, route: object) -> None:
    response = call(secured, route.method, concrete(route.path), json={})  # type: ignore[attr-defined]
    error = error_of(response, 401, "authentication_error")
    assert response.headers["www-authenticate"] == "Bearer"  # type: ignore[attr-defined]
    assert "Bearer" in str(error["message"])


# which test key holds which route scope
HOLDERS = {
    "inference": {"admin", "infer", "only_a", "limited", "tokens"},
    "models:read": {"admin", "infer", "reader", "modeladmin", "only_a", "limited"},
    "models:admin": {"admin", "modeladmin"},
    "metrics": {"admin", "ops"},
}


@pytest.mark.parametrize("key", ["admin", "infer", "reader", "ops", "modeladmin", "scopeless"])
def test_scopes_are_enforced_on_every_route(secured: TestClient, key: str) -> None:
    for route in ROUTES:
        if route.scope == "public" or route.method == WEBSOCKET:
            continue
        # invalid bodies: a caller that passes the scope check gets a 400 (or a 404), never a real action
        response = call(secured, route.method, concrete(route.path), key, json={"wait": "no"})
        if key in HOLDERS[route.scope]:
            assert response.status_code not in (401, 403), (route.path, response.text)
        else:
            assert response.status_code == 403, (key, route.path, response.status_code)
            assert route.scope in error_of(response, 403, "permission_error")["message"]


def test_x_api_key_and_bad_credentials(secured: TestClient) -> None:
    assert secured.get("/v1/models", headers={"x-api-key": st.key_of("reader")}).status_code == 200
    for headers in (
        {"Authorization": "Bearer bsk_wrong"},
        {"Authorization": f"Basic {st.key_of('admin')}"},
        {"Authorization": "Bearer"},
        {"x-api-key": ""},
        {"Authorization": f"Bearer {st.key_of('reader')}", "x-api-key": st.key_of("admin")},
    ):
        response = secured.get("/v1/models", headers=headers)
        error_of(response, 401, "authentication_error")
        assert response.headers["www-authenticate"] == "Bearer"


def test_a_scopeless_key_gets_no_metrics(secured: TestClient) -> None:
    assert call(secured, "GET", "/metrics", "scopeless").status_code == 403
    assert call(secured, "GET", "/metrics", "infer").status_code == 403
    assert call(secured, "GET", "/metrics", "ops").status_code == 200


def test_a_key_uses_only_its_models(secured: TestClient) -> None:
    body = {"prompt": "hi", "max_tokens": 2, "temperature": 0}
    ok = call(secured, "POST", "/v1/completions", "only_a", json={**body, "model": SERVED})
    assert ok.status_code == 200, ok.text  # type: ignore[attr-defined]
    # no model: the default, which is `a` here
    assert call(secured, "POST", "/v1/completions", "only_a", json=body).status_code == 200  # type: ignore[attr-defined]
    for path, payload in (
        ("/v1/completions", {**body, "model": "b"}),
        ("/tokenize", {"prompt": "hi", "model": "b"}),
        ("/v1/inference", {**body, "model": "b"}),
    ):
        error = error_of(call(secured, "POST", path, "only_a", json=payload), 403, "permission_error")
        assert error["param"] == "model"
    assert error_of(call(secured, "GET", "/v1/models/b", "only_a"), 403, "permission_error")
    listed = call(secured, "GET", "/v1/models", "only_a").json()["data"]  # type: ignore[attr-defined]
    assert [model["id"] for model in listed] == [SERVED]


def test_health_shows_build_details_only_to_metrics(secured: TestClient) -> None:
    for path in ("/health/live", "/health/ready"):
        assert secured.get(path).status_code == 200
    assert "build" not in secured.get("/health").json()
    assert "build" not in call(secured, "GET", "/health", "infer").json()  # type: ignore[attr-defined]
    assert "git_sha" in call(secured, "GET", "/health", "ops").json()["build"]  # type: ignore[attr-defined]
    assert secured.get("/health", headers={"Authorization": "Bearer wrong"}).status_code == 200


def test_request_limit_429_with_retry_after_and_headers(secured: TestClient) -> None:
    remaining = []
    for _ in range(3):
        response = call(secured, "GET", "/v1/models", "limited")
        assert response.status_code == 200  # type: ignore[attr-defined]
        assert response.headers["x-ratelimit-limit-requests"] == "3"  # type: ignore[attr-defined]
        assert response.headers["x-ratelimit-reset-requests"].endswith("s")  # type: ignore[attr-defined]
        remaining.append(int(response.headers["x-ratelimit-remaining-requests"]))  # type: ignore[attr-defined]
    assert remaining == [2, 1, 0]
    refused = call(secured, "GET", "/v1/models", "limited")
    error = error_of(refused, 429, "rate_limit_error")
    assert error["code"] == "rate_limit_exceeded"
    assert 1 <= int(refused.headers["retry-after"]) <= 20  # type: ignore[attr-defined]
    assert "x-ratelimit-limit-requests" not in call(secured, "GET", "/v1/models", "infer").headers  # type: ignore[attr-defined]


def test_tokens_are_charged_at_admission_and_refunded(secured: TestClient) -> None:
    body = {"prompt": "hello", "model": SERVED, "temperature": 0}
    too_many = call(secured, "POST", "/v1/completions", "tokens", json={**body, "max_tokens": 150})
    assert "more than the limit" in str(error_of(too_many, 429, "rate_limit_error")["message"])
    first = call(secured, "POST", "/v1/completions", "tokens", json={**body, "max_tokens": 40})
    assert first.status_code == 200, first.text  # type: ignore[attr-defined]
    usage = first.json()["usage"]  # type: ignore[attr-defined]
    charged = usage["prompt_tokens"] + 40
    assert first.headers["x-ratelimit-limit-tokens"] == "100"  # type: ignore[attr-defined]
    assert int(first.headers["x-ratelimit-remaining-tokens"]) in range(100 - charged, 100 - charged + 3)  # type: ignore[attr-defined]
    # the unused part came back when the stream closed: the next request sees it
    second = call(secured, "POST", "/tokenize", "tokens", json={"prompt": "x", "model": SERVED})
    used = usage["total_tokens"]
    assert int(second.headers["x-ratelimit-remaining-tokens"]) >= 100 - used - 1  # type: ignore[attr-defined]


def test_security_headers_on_every_response(secured: TestClient) -> None:
    for response in (
        secured.get("/health/live"),
        secured.get("/v1/models"),
        call(secured, "GET", "/v1/models", "reader"),
        call(secured, "GET", "/nowhere", "reader"),
    ):
        assert response.headers["x-content-type-options"] == "nosniff"  # type: ignore[attr-defined]
        assert response.headers["cache-control"] == "no-store"  # type: ignore[attr-defined]
        assert "server" not in response.headers  # type: ignore[attr-defined]


def test_unknown_paths_need_credentials_before_a_404(secured: TestClient) -> None:
    error_of(secured.get("/v2/anything"), 401, "authentication_error")
    assert call(secured, "GET", "/v2/anything", "reader").status_code == 404


def test_cors(secured: TestClient) -> None:
    preflight = {
        "Origin": ORIGIN,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    allowed = secured.options("/v1/chat/completions", headers=preflight)
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == ORIGIN
    assert "access-control-allow-credentials" not in allowed.headers
    denied = secured.options("/v1/chat/completions", headers={**preflight, "Origin": "https://evil.example"})
    assert denied.status_code == 400 and "access-control-allow-origin" not in denied.headers
    simple = call(secured, "GET", "/v1/models", "limited", headers={"Origin": ORIGIN})
    assert simple.headers["access-control-allow-origin"] == ORIGIN  # type: ignore[attr-defined]
    assert "x-ratelimit-remaining-requests" in simple.headers["access-control-expose-headers"]  # type: ignore[attr-defined]
    # a preflight is not a request: without CORS headers an OPTIONS is an unauthenticated call
    assert secured.options("/v1/models/load").status_code == 401


def test_admin_actions_and_refusals_are_audited(secured: TestClient) -> None:
    call(secured, "POST", "/v1/models/load", "admin", json={"model": "nope", "wait": True})
    call(secured, "POST", "/v1/models/load", "reader", json={})
    secured.post("/v1/models/load", json={})
    import json

    path: Path = secured.audit_path  # type: ignore[attr-defined]
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    events = {line["event"] for line in lines}
    assert {"admin_action", "auth_failure", "permission_denied", "rate_limited"} <= events
    action = next(line for line in lines if line["event"] == "admin_action")
    assert action["principal"] == "key:admin" and action["route"] == "/v1/models/load"
    assert action["method"] == "POST" and action["source"] and action["request_id"]
    assert verify_chain([str(path)]).error is None
    assert "bsk_test" not in path.read_text()
