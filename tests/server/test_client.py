"""bitserve.Client and bitserve.AsyncClient against a real server (uvicorn on a socket, tiny synthetic
model versions in a model root): models load / swap / rollback / unload with progress, health,
stats, tokenize, and errors as typed exceptions holding the server's error JSON; the batch calls
against `bitserve serve`'s Batch API (and an older server's route 404 as BatchAPIUnavailable)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest
from http_testing import ServerProcess, free_port
from lifecycle_testing import ModelRoot, ThreadServer, lifecycle_server, version_of

import bitserve
from bitserve.client import (
    APIConnectionError,
    AsyncClient,
    BadRequestError,
    BatchAPIUnavailable,
    Client,
    ConflictError,
    NotFoundError,
    Operation,
    OperationFailed,
    RateLimitError,
)

ALIAS = "v1"  # the startup model's alias: its file stem


@pytest.fixture(scope="module")
def server(model_root: ModelRoot) -> Iterator[ThreadServer]:
    with lifecycle_server(model_root) as running:
        yield running


@pytest.fixture
def client(server: ThreadServer) -> Iterator[Client]:
    with bitserve.Client(server.url, poll_s=0.05) as api:
        yield api


def test_health_stats_and_the_tokenizer(client: Client, model_root: ModelRoot) -> None:
    assert client.health().status == "ready"
    assert client.live().is_ok and client.ready().is_ok and client.ready().checks["model_ready"]
    stats = client.stats()
    assert stats.phase == "ready" and stats.response_cache == {"enabled": False}
    assert stats.model_extra is not None and "kv_cache" in stats.model_extra  # extras pass through
    assert "bitserve_model_info" in client.metrics()
    listing = client.list_models()
    assert [(m.id, m.version, m.state, m.is_default) for m in listing.data] == [
        (ALIAS, version_of(model_root.files["v1"]), "ready", True)
    ]
    assert client.model(ALIAS).devices == ["cpu"]
    tokens = client.tokenize("Hello world")
    assert tokens.count == len(tokens.tokens) > 0
    assert client.detokenize(tokens.tokens).prompt.endswith("Hello world")


def test_load_swap_rollback_unload_with_progress(client: Client, model_root: ModelRoot) -> None:
    v1, v2 = version_of(model_root.files["v1"]), version_of(model_root.files["v2"])
    seen: list[Operation] = []
    loaded = client.load("v2", alias="second", on_progress=seen.append)
    assert loaded.state == "succeeded" and loaded.progress == 1.0 and loaded.result["version"] == v2
    assert seen[0].state == "running" and seen[-1].state == "succeeded"  # every polled state, in order
    assert {m.id for m in client.list_models().data} == {ALIAS, "second"}
    swapped = client.swap(ALIAS, "v2")
    assert swapped.action == "swap" and client.model(ALIAS).version == v2
    client.rollback(ALIAS)
    assert client.model(ALIAS).version == v1
    running = client.unload("second", wait=False)
    assert running.status_url == f"/v1/models/operations/{running.id}"
    assert client.wait_operation(running).state == "succeeded"
    assert [m.id for m in client.list_models().data] == [ALIAS]


def test_errors_are_typed_and_carry_the_servers_json(client: Client) -> None:
    with pytest.raises(NotFoundError) as missing:
        client.model("nope")
    assert missing.value.status_code == 404 and missing.value.code == "model_not_found"
    assert missing.value.body["error"]["hint"].startswith("available:") and missing.value.request_id
    with pytest.raises(BadRequestError) as bad:
        client.swap(ALIAS, "v2", devices=["cpu", "cuda:9"])
    assert "'cuda:9' is not available" in str(bad.value) and bad.value.param is not None
    with pytest.raises(OperationFailed) as failed:
        client.load("badgolden", alias="bad")
    assert "golden prompt 0" in str(failed.value) and failed.value.operation.state == "failed"
    first = client.swap(ALIAS, "v2", wait=False)
    with pytest.raises(ConflictError):
        client.swap(ALIAS, "v2", wait=False)
    client.wait_operation(first.id)
    client.rollback(ALIAS)


def test_a_server_without_the_batch_api_is_named_as_such() -> None:
    """An older bitserve (no /v1/files, /v1/batches) answers the route 404 below: BatchAPIUnavailable
    with a hint, not a bare 404 (a missing batch on a server with the API stays NotFoundError)."""
    route_404 = {"error": {"message": "no route for POST /v1/files", "type": "invalid_request_error",
                           "param": None, "code": "not_found", "hint": None}}  # fmt: skip

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(404, json=route_404)

    transport = httpx.Client(base_url="http://test", transport=httpx.MockTransport(answer))
    with Client("http://test", http_client=transport) as api, pytest.raises(BatchAPIUnavailable) as missing:
        api.create_batch_from_requests([{"model": ALIAS, "prompt": "hi"}], endpoint="/v1/completions")
    assert missing.value.status_code == 404 and "Batch API" in (missing.value.hint or "")


def test_batches_round_trip(blackbox: ServerProcess) -> None:
    """Against `bitserve serve` (embedded SmolLM2, its Batch API on): upload the bodies, wait with
    progress, read every answer by custom id."""
    bodies = [
        {
            "model": "smollm2-135m-instruct",
            "messages": [{"role": "user", "content": f"Count to {i}."}],
            "max_tokens": 4,
            "temperature": 0,
        }
        for i in range(2)
    ]
    with Client(blackbox.url, poll_s=0.2) as api:
        created = api.create_batch_from_requests(bodies, custom_ids=["a", "b"], metadata={"job": "client"})
        assert created.metadata == {"job": "client"} and created.endpoint == "/v1/chat/completions"
        statuses: list[str] = []
        finished = api.wait_batch(
            created.id, on_progress=lambda batch: statuses.append(batch.status), timeout_s=180
        )
        assert finished.status == "completed" and statuses[-1] == "completed"
        assert finished.request_counts is not None and finished.request_counts.completed == 2
        results = {result.custom_id: result for result in api.batch_results(created.id)}
        assert set(results) == {"a", "b"}
        assert all(
            r.error is None and r.body is not None and r.body["object"] == "chat.completion"
            for r in results.values()
        )
        with pytest.raises(NotFoundError):
            api.batch("batch_does_not_exist")


def test_the_async_client_has_the_same_calls(server: ThreadServer, model_root: ModelRoot) -> None:
    v2 = version_of(model_root.files["v2"])

    async def scenario() -> None:
        async with bitserve.AsyncClient(server.url, poll_s=0.05) as api:
            assert (await api.stats()).phase == "ready"
            assert (await api.tokenize("hi", model=ALIAS)).count > 0
            seen: list[str] = []
            swapped = await api.swap(ALIAS, "v2", on_progress=lambda op: seen.append(op.state))
            assert swapped.result["version"] == v2 and seen[-1] == "succeeded"
            assert (await api.model(ALIAS)).version == v2
            await api.rollback(ALIAS)
            with pytest.raises(NotFoundError):
                await api.unload("nope")

    asyncio.run(scenario())


def test_an_unreachable_server_is_a_connection_error() -> None:
    with Client(f"http://127.0.0.1:{free_port()}") as api, pytest.raises(APIConnectionError):
        api.health()


def test_a_429_carries_retry_after() -> None:
    """Status mapping without a server (a server at its limit is the admission tests' subject)."""
    body = {
        "error": {"message": "queue full", "type": "rate_limit_error", "code": "queue_full", "param": None}
    }

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(429, json=body, headers={"Retry-After": "3"})

    transport = httpx.Client(base_url="http://test", transport=httpx.MockTransport(answer))
    with Client("http://test", http_client=transport) as api, pytest.raises(RateLimitError) as limited:
        api.stats()
    assert limited.value.retry_after_s == 3.0 and limited.value.code == "queue_full"


def test_async_client_is_exported_lazily() -> None:
    assert bitserve.AsyncClient is AsyncClient and bitserve.Client is Client
