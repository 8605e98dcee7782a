"""Canary rollouts over real HTTP: a swap with `canary` stages v2 beside v1 and sends it its share of
32 streaming clients' requests (the split within 5 points over 500+ requests, none failed), sticky by
`user` and X-Session-Id, forced by X-Canary; /v1/models compares the two; promotion by the admin API
and automatically after the window; a broken canary is rolled back on its own while v1 serves on."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
from lifecycle_testing import (
    ModelRoot,
    admin,
    failed,
    lifecycle_server,
    metric_value,
    run_clients,
    version_of,
)

ALIAS = "v1"
NUM_CLIENTS = 32
MIN_REQUESTS = 500


def load_until(server: Any, num_clients: int, enough: Any, timeout_s: float = 240.0) -> list[Any]:
    """Streaming clients until `enough(results)` holds (or the timeout); their results."""
    results: list[Any] = []

    async def scenario() -> None:
        stop = asyncio.Event()
        clients = asyncio.create_task(run_clients(server.url, num_clients, stop, results))
        deadline = time.monotonic() + timeout_s
        while not enough(results) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        stop.set()
        await clients

    asyncio.run(scenario())
    return results


def completion_version(url: str, **request: Any) -> str:
    headers = request.pop("headers", {})
    body = {"prompt": "Hello", "max_tokens": 2, "temperature": 0.0, **request}
    response = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60.0)
    assert response.status_code == 200, response.text
    return response.headers["x-model-version"]


def test_a_canary_takes_its_share_then_is_promoted(model_root: ModelRoot) -> None:
    v1, v2 = version_of(model_root.files["v1"]), version_of(model_root.files["v2"])
    with lifecycle_server(model_root, canary_window_s=3600.0) as server:
        staged = admin(
            server.url, f"/v1/models/{ALIAS}/swap", {"model": "v2", "canary": {"percent": 10}, "wait": True}
        )
        assert staged.status_code == 200, staged.text
        assert staged.json()["result"]["version"] == v1 and staged.json()["result"]["canary"]["version"] == v2
        results = load_until(server, NUM_CLIENTS, lambda done: len(done) >= MIN_REQUESTS)
        assert len(results) >= MIN_REQUESTS and failed(results) == []
        versions = [result.header_version for _, _, result in results]
        assert set(versions) == {v1, v2}
        share = versions.count(v2) / len(versions)
        assert abs(share - 0.10) <= 0.05, share
        for _, _, result in results:
            assert result.versions == {result.header_version}  # a stream is served by one version
        # sticky: a user's or a session's requests stay on one version; a tester forces the canary
        for key in ("alice", "bob", "carol"):
            assert len({completion_version(server.url, user=key) for _ in range(4)}) == 1
            session = {"X-Session-Id": f"session-{key}"}
            assert len({completion_version(server.url, headers=session) for _ in range(4)}) == 1
        assert completion_version(server.url, headers={"X-Canary": "always"}) == v2
        assert completion_version(server.url, headers={"X-Canary": "never"}) == v1
        described = httpx.get(f"{server.url}/v1/models/{ALIAS}").json()
        assert described["version"] == v1 and described["canary"]["version"] == v2
        assert described["canary"]["canary"]["num_finished"] >= versions.count(v2)
        assert described["canary"]["canary"]["num_failed"] == 0
        canary_metric = metric_value(server.url, "bitserve_version_requests_total", version=v2, role="canary")
        assert canary_metric == described["canary"]["canary"]["num_finished"]
        assert metric_value(server.url, "bitserve_version_traffic_weight", version=v2, role="canary") == 0.1
        assert (
            metric_value(server.url, "bitserve_version_request_failures_total", version=v1, role="stable")
            == 0
        )
        assert admin(server.url, f"/v1/models/{ALIAS}/swap", {"model": "v2"}).status_code == 409
        promoted = admin(server.url, f"/v1/models/{ALIAS}/canary/promote", {"wait": True})
        assert promoted.status_code == 200 and promoted.json()["result"]["version"] == v2
        assert completion_version(server.url) == v2
        assert httpx.get(f"{server.url}/v1/models/{ALIAS}").json()["canary"] is None
        assert (
            metric_value(server.url, "bitserve_model_swaps_total", action="canary_promote", result="success")
            == 1
        )
        assert admin(server.url, f"/v1/models/{ALIAS}/canary/promote", {"wait": True}).status_code == 409


def test_a_canary_within_bounds_is_promoted_after_its_window(model_root: ModelRoot) -> None:
    v2 = version_of(model_root.files["v2"])
    with lifecycle_server(model_root) as server:
        body = {"model": "v2", "canary": {"percent": 50, "window_s": 1.0}, "wait": True}
        assert admin(server.url, f"/v1/models/{ALIAS}/swap", body).status_code == 200
        results = load_until(server, 8, lambda _: server.state.models.aliases[ALIAS].canary is None, 60.0)
        assert server.state.models.aliases[ALIAS].current.version == v2
        assert failed(results) == []
        assert (
            metric_value(server.url, "bitserve_model_swaps_total", action="canary_promote", result="success")
            == 1
        )


def test_a_broken_canary_is_rolled_back_while_the_stable_version_serves(model_root: ModelRoot) -> None:
    v1, v2 = version_of(model_root.files["v1"]), version_of(model_root.files["v2"])
    with lifecycle_server(model_root, canary_window_s=3600.0) as server:
        body = {"model": "v2", "canary": {"percent": 20}, "wait": True}
        assert admin(server.url, f"/v1/models/{ALIAS}/swap", body).status_code == 200

        async def break_the_canary() -> None:
            runner = server.state.models.aliases[ALIAS].canary.slot.instance.engine.runner

            def broken_execute(*args: Any, **kwargs: Any) -> Any:
                raise RuntimeError("injected fault inside the canary's step")

            runner.execute = broken_execute

        server.run(break_the_canary())
        rolled_back: list[float] = []

        def enough(results: list[Any]) -> bool:
            if not rolled_back and server.state.models.aliases[ALIAS].canary is None:
                rolled_back.append(time.monotonic())
            return (
                bool(rolled_back)
                and sum(1 for started, _, _ in results if started > rolled_back[0] + 0.2) >= 100
            )

        results = load_until(server, NUM_CLIENTS, enough, 120.0)
        assert rolled_back, "the broken canary was not rolled back"
        assert server.state.models.aliases[ALIAS].current.version == v1
        assert (
            metric_value(server.url, "bitserve_model_swaps_total", action="canary_rollback", result="success")
            == 1
        )
        bad = failed(results)
        assert bad, "the injected fault failed no request"
        assert all(result.header_version in (v2, None) for result in bad)  # only the canary's requests
        after = [result for started, _, result in results if started > rolled_back[0] + 0.2]
        assert len(after) >= 100 and failed([(0, 0, r) for r in after]) == []
        assert {result.header_version for result in after} == {v1}
