"""Device routing over HTTP with two replicas of the synthetic model, both on the CPU: "cuda:0" stands
for a fast device and "cpu" is artificially slowed (a sleep in its runner: a test double, only here).
The router takes the lowest predicted completion time, honours a `device` hint (400 for one the model
does not run on), skips a saturated replica, moves a request whose replica dies before its first token
to the other one, and /health, /v1/models, /v1/stats and /metrics show each replica. Then replicas
through the admin API on a pretend GPU machine (faked discovery): `auto`, device errors, a swap under
load that replaces both replicas without losing a request, rollback to the devices a version had."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from lifecycle_testing import (
    ModelRoot,
    admin,
    failed,
    lifecycle_server,
    run_clients,
    version_of,
)
from prometheus_client.parser import text_string_to_metric_families

from bitserve.config import EngineConfig, ModelConfig, SchedulerConfig, ServerConfig

SLOW_STEP_S = 0.04
BODY = {"prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0}


def load_instance(path: Path) -> Any:
    from bitserve.engine.instance import ModelInstance

    return ModelInstance.load(
        EngineConfig(model=ModelConfig(model=str(path)), scheduler=SchedulerConfig(max_model_len=128))
    )


def wrap_execute(instance: Any, wrapper: Callable[[Callable[..., Any], Any], Any]) -> None:
    """Fault or delay injection: every engine step of `instance` goes through `wrapper`."""
    execute = instance.engine.runner.execute
    instance.engine.runner.execute = lambda scheduler_output: wrapper(execute, scheduler_output)


def slowed(execute: Callable[..., Any], scheduler_output: Any) -> Any:
    time.sleep(SLOW_STEP_S)
    return execute(scheduler_output)


@pytest.fixture()
def two_replicas(tq2_model_path: Path) -> Iterator[dict[str, Any]]:
    """A fast "cuda:0" replica listed first and a slowed "cpu" replica (fresh instances each test)."""
    replicas = {"cuda:0": load_instance(tq2_model_path), "cpu": load_instance(tq2_model_path)}
    wrap_execute(replicas["cpu"], slowed)
    try:
        yield replicas
    finally:
        for instance in replicas.values():
            instance.close()


def serve(replicas: dict[str, Any], **options: Any) -> TestClient:
    from bitserve.server.app import build_app

    return TestClient(build_app(ServerConfig(sse_keepalive_s=1.0, **options), instance=replicas))


def served_by_device(client: TestClient) -> Counter[str]:
    """Finished requests per replica, from bitserve_requests_total's device label."""
    counts: Counter[str] = Counter()
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if sample.name == "bitserve_requests_total":
                counts[sample.labels["device"]] += int(sample.value)
    return counts


def complete(client: TestClient, **fields: Any) -> Any:
    return client.post("/v1/completions", json=BODY | fields)


def test_lowest_predicted_time_hint_and_observability(two_replicas: dict[str, Any]) -> None:
    with serve(two_replicas) as client:  # warm-up measures both replicas' step times
        before = served_by_device(client)
        for _ in range(4):
            assert complete(client).status_code == 200
        assert served_by_device(client) - before == Counter({"cuda:0": 4})  # ~ms steps beat 40 ms ones
        pinned = complete(client, device="cpu")
        assert pinned.status_code == 200 and pinned.json()["choices"][0]["finish_reason"] == "length"
        chat = client.post(
            "/v1/inference", json={"prompt": "Hello", "max_tokens": 2, "temperature": 0, "device": "CPU"}
        )
        assert chat.status_code == 200
        assert served_by_device(client) - before == Counter({"cuda:0": 4, "cpu": 2})
        for hint in ("cuda:1", "gpu"):
            refused = complete(client, device=hint)
            error = refused.json()["error"]
            assert refused.status_code == 400 and error["param"] == "device", refused.text
            assert repr(hint) in error["message"] and "this model runs on: cuda:0, cpu" in error["hint"]

        model = client.get("/v1/models").json()["data"][0]
        assert model["device"] == "cuda:0" and model["devices"] == ["cuda:0", "cpu"]
        replicas = {entry["device"]: entry for entry in model["replicas"]}
        assert replicas["cpu"]["mean_step_time_s"] > replicas["cuda:0"]["mean_step_time_s"]
        health = client.get("/health").json()["components"]
        assert [r["device"] for r in health["replicas"]] == ["cuda:0", "cpu"]
        for replica in health["replicas"]:  # each replica's kernel choices (ISA variant on the cpu backend)
            assert replica["kernels"]["backend"] == replica["backend"]
            assert replica["kernels"]["block_activations"] in ("f32", "q8")
            assert replica["backend"] != "cpu" or replica["kernels"]["isa"] in ("vnni", "avx2", "generic")
        assert all(r["is_alive"] for r in health["replicas"]) and health["model"]["devices"] == [
            "cuda:0",
            "cpu",
        ]
        stats = client.get("/v1/stats").json()
        assert [r["device"] for r in stats["replicas"]] == ["cuda:0", "cpu"]
        assert 'bitserve_step_duration_seconds_count{device="cpu"' in client.get("/metrics").text


def test_a_saturated_replica_is_skipped_then_429(two_replicas: dict[str, Any]) -> None:
    long_body = BODY | {"max_tokens": 100, "ignore_eos": True, "stream": True}

    def less_slowed(execute: Callable[..., Any], scheduler_output: Any) -> Any:
        time.sleep(SLOW_STEP_S / 4)  # still the faster replica, and busy for > 1 s with 100 tokens
        return execute(scheduler_output)

    wrap_execute(two_replicas["cuda:0"], less_slowed)
    with serve(two_replicas, max_num_waiting=1) as client:
        before = served_by_device(client)
        with client.stream("POST", "/v1/completions", json=long_body | {"device": "cuda:0"}) as pinned:
            assert pinned.status_code == 200
            # the fast replica holds one request (its admission limit): the next one goes to the slow
            # replica, although the fast one's predicted time is still lower
            with client.stream("POST", "/v1/completions", json=long_body) as second:
                assert second.status_code == 200
                refused = complete(client)
                assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
                assert refused.json()["error"]["code"] == "queue_full"
                assert sum(1 for line in second.iter_lines() if line == "data: [DONE]") == 1
            assert sum(1 for line in pinned.iter_lines() if line == "data: [DONE]") == 1
        assert served_by_device(client) - before == Counter({"cuda:0": 1, "cpu": 1})


def test_a_replica_that_dies_before_the_first_token_hands_the_request_over(
    two_replicas: dict[str, Any],
) -> None:
    """No warm-up: both replicas unmeasured, so the first listed ("cuda:0") takes the request and dies
    in its first step; the stream (already answered 200) continues on "cpu" without an error."""

    def dead(execute: Callable[..., Any], scheduler_output: Any) -> Any:
        raise RuntimeError("injected device failure")

    wrap_execute(two_replicas["cuda:0"], dead)
    with serve(two_replicas, warmup=False) as client:
        with client.stream("POST", "/v1/completions", json=BODY | {"stream": True}) as response:
            assert response.status_code == 200
            frames = [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]
        assert frames[-1] == "[DONE]" and not any('"error"' in frame for frame in frames), frames
        chunks = [json.loads(frame) for frame in frames[:-1]]
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
        assert complete(client).status_code == 200  # the dead replica is skipped from now on
        assert served_by_device(client) == Counter({"cpu": 2, "cuda:0": 1})  # the handed-over attempt
        assert 'bitserve_requests_aborted_total{reason="replica_failover"} 1.0' in client.get("/metrics").text
        replicas = {r["device"]: r for r in client.get("/health").json()["components"]["replicas"]}
        assert replicas["cuda:0"]["is_alive"] is False and replicas["cpu"]["is_alive"] is True
        assert client.get("/health/live").status_code == 200  # one replica serves: no restart
        assert client.get("/health/ready").status_code == 200
        pinned = complete(client, device="cuda:0")  # a hint to the dead replica is not rerouted
        assert pinned.status_code == 503 and "failed on cuda:0" in pinned.json()["error"]["message"]


# ----------------------------------------------------------------- replicas through the admin API

GB = 10**9


class FakeGPUs:
    """Device discovery of a machine with GPUs of `free` bytes free each (test double)."""

    def __init__(self, *free: int) -> None:
        self.free = free

    def cuda_device_count(self) -> int:
        return len(self.free)

    def cuda_free_bytes(self, index: int) -> int:
        return self.free[index]


def load_on_the_cpu(config: EngineConfig) -> Any:
    """The fake GPUs' replicas are CPU instances (labelled with their GPU by the router all the same)."""
    from bitserve.engine.instance import ModelInstance

    return ModelInstance.load(
        dataclasses.replace(config, model=dataclasses.replace(config.model, device="cpu"))
    )


def pretend_gpus(server: Any, *free: int) -> None:
    async def install() -> None:
        server.state.models.replica_builder.probe = FakeGPUs(*free)
        server.state.models.replica_builder.load_instance = load_on_the_cpu

    server.run(install())


def requests_on(url: str, model: str, device: str) -> float:
    families = text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10.0).text)
    return sum(
        sample.value
        for family in families
        for sample in family.samples
        if sample.name == "bitserve_requests_total"
        and (sample.labels["model"], sample.labels["device"]) == (model, device)
    )


def test_swap_under_load_replaces_both_replicas_and_loses_nothing(model_root: ModelRoot) -> None:
    v1, v2 = version_of(model_root.files["v1"]), version_of(model_root.files["v2"])
    with lifecycle_server(model_root) as server:
        pretend_gpus(server, 8 * GB)
        body = {"model": "v1", "alias": "pair", "devices": ["cuda:0", "cpu"], "wait": True}
        loaded = admin(server.url, "/v1/models/load", body)
        assert loaded.status_code == 200 and loaded.json()["result"]["devices"] == ["cuda:0", "cpu"], (
            loaded.text
        )
        before = {device: requests_on(server.url, "pair", device) for device in ("cuda:0", "cpu")}
        results: list[Any] = []
        swaps: list[tuple[str, list[str]]] = []

        async def scenario() -> None:
            stop = asyncio.Event()
            clients = asyncio.create_task(run_clients(server.url, 16, stop, results, model="pair"))
            async with httpx.AsyncClient(base_url=server.url, timeout=300.0) as admin_client:
                for index in range(4):
                    await asyncio.sleep(0.5)
                    target = "v2" if index % 2 == 0 else "v1"
                    response = await admin_client.post(
                        "/v1/models/pair/swap", json={"model": target, "wait": True}
                    )
                    assert response.status_code == 200, response.text
                    swaps.append((response.json()["result"]["version"], response.json()["result"]["devices"]))
                deadline = time.monotonic() + 120
                while len(results) < 200 and time.monotonic() < deadline:
                    await asyncio.sleep(0.2)
            stop.set()
            await clients

        asyncio.run(scenario())
        both = ["cuda:0", "cpu"]
        assert swaps == [(v2, both), (v1, both), (v2, both), (v1, both)]  # a swap keeps the alias's devices
        assert len(results) >= 200 and failed(results) == []
        for _, _, result in results:  # every response from exactly one version
            assert len(result.versions) == 1 and result.header_version in result.versions, result
        assert {next(iter(r.versions)) for _, _, r in results} == {v1, v2}
        for device in (
            "cuda:0",
            "cpu",
        ):  # each swap validates each replica with one request: clients came too
            assert requests_on(server.url, "pair", device) - before[device] > len(swaps), device
        pair = next(m for m in httpx.get(f"{server.url}/v1/models").json()["data"] if m["id"] == "pair")
        assert (pair["version"], pair["state"], pair["devices"]) == (v1, "ready", both)
        assert [(r["device"], r["is_alive"]) for r in pair["replicas"]] == [("cuda:0", True), ("cpu", True)]


def test_device_fields_of_load_swap_and_rollback(
    model_root: ModelRoot, caplog: pytest.LogCaptureFixture
) -> None:
    with lifecycle_server(model_root) as server, caplog.at_level(logging.INFO, "bitserve.engine.devices"):
        pretend_gpus(server, 8 * GB)
        for body, message in (
            ({"device": "cuda:3"}, "'cuda:3' is not available: this machine has 1 GPU(s)"),
            ({"device": "gpu"}, "device 'gpu' is not a device"),
            ({"devices": ["cpu", "CPU"]}, "devices lists cpu more than once"),
            ({"devices": ["auto", "cpu"]}, "auto picks one device"),
            ({"device": "cpu", "devices": ["cpu"]}, "give device or devices, not both"),
            ({"devices": []}, "devices"),
        ):
            refused = admin(server.url, "/v1/models/load", {"model": "v2", "alias": "x", **body})
            assert refused.status_code == 400 and message in refused.json()["error"]["message"], refused.text
        fits = admin(
            server.url, "/v1/models/load", {"model": "v2", "alias": "gpu", "device": "auto", "wait": True}
        )
        assert fits.status_code == 200 and fits.json()["result"]["devices"] == ["cuda:0"], fits.text
        pretend_gpus(server, 1000)  # too little free memory for the model: auto takes the CPU, and says why
        full = admin(
            server.url, "/v1/models/load", {"model": "v2", "alias": "host", "device": "auto", "wait": True}
        )
        assert full.status_code == 200 and full.json()["result"]["devices"] == ["cpu"], full.text
        assert "device auto -> cpu: the model needs about" in caplog.text
        swapped = admin(
            server.url, "/v1/models/gpu/swap", {"model": "v1", "devices": ["cpu", "cuda:0"], "wait": True}
        )
        assert swapped.status_code == 200 and swapped.json()["result"]["devices"] == ["cpu", "cuda:0"]
        pretend_gpus(server, 8 * GB)
        # the previous version is reloaded with the devices it asked for: `auto`, resolved again (a GPU
        # that has no room for two versions at the time sends it to the CPU instead of out of memory)
        back = admin(server.url, "/v1/models/gpu/rollback", {"wait": True})
        assert back.status_code == 200 and back.json()["result"]["reloaded"] is True, back.text
        models = {m["id"]: m for m in httpx.get(f"{server.url}/v1/models").json()["data"]}
        assert models["gpu"]["devices"] == ["cuda:0"] and models["host"]["devices"] == ["cpu"]
        assert models["v1"]["devices"] == ["cpu"]  # the startup model: the configured device
