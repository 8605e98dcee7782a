"""Model lifecycle over real HTTP: load beside, swap under load, rejected swaps, probation rollback,
manual rollback, path tricks, 409 on concurrent admin actions, several models with an LRU budget.
The models are tiny synthetic BitNet versions (TQ2_0) in a model root."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
from lifecycle_testing import (
    KV_CACHE_BYTES,
    ModelRoot,
    admin,
    failed,
    lifecycle_server,
    metric_value,
    run_clients,
    stream_completion,
    version_of,
)

ALIAS = "v1"  # the startup model's alias: its file stem


# ----------------------------------------------------------------- acceptance: swap under load


def test_swap_under_load_loses_nothing(model_root: ModelRoot) -> None:
    """100 streaming clients, >= 1,000 requests, the alias swapped back and forth >= 5 times."""
    v1, v2 = version_of(model_root.files["v1"]), version_of(model_root.files["v2"])
    with lifecycle_server(model_root) as server:
        results: list[Any] = []
        swaps: list[str] = []

        async def scenario() -> None:
            stop = asyncio.Event()
            clients = asyncio.create_task(run_clients(server.url, 100, stop, results))
            async with httpx.AsyncClient(base_url=server.url, timeout=300.0) as admin_client:
                for index in range(6):
                    await asyncio.sleep(0.5)
                    target = "v2" if index % 2 == 0 else "v1"
                    response = await admin_client.post(
                        f"/v1/models/{ALIAS}/swap", json={"model": target, "wait": True}
                    )
                    assert response.status_code == 200, response.text
                    swaps.append(response.json()["result"]["version"])
                deadline = time.monotonic() + 300
                while len(results) < 1000 and time.monotonic() < deadline:
                    await asyncio.sleep(0.2)
            stop.set()
            await clients

        asyncio.run(scenario())
        assert swaps == [v2, v1, v2, v1, v2, v1]
        assert len(results) >= 1000
        assert failed(results) == []
        for _, _, result in results:  # every response from exactly one version, header and chunks agreeing
            assert len(result.versions) == 1 and result.header_version in result.versions, result
        served = Counter(next(iter(r.versions)) for _, _, r in results)
        assert set(served) == {v1, v2} and min(served.values()) > 0
        assert metric_value(server.url, "bitserve_model_swaps_total", action="swap", result="success") == 6
        models = httpx.get(f"{server.url}/v1/models").json()["data"]
        assert [(m["id"], m["version"], m["state"]) for m in models] == [(ALIAS, v1, "ready")]


# ----------------------------------------------------------------- rejected swaps


def test_rejected_swaps_keep_the_old_version_serving(model_root: ModelRoot) -> None:
    v1 = version_of(model_root.files["v1"])
    with lifecycle_server(model_root) as server:
        results: list[Any] = []
        answers: dict[str, httpx.Response] = {}

        async def scenario() -> None:
            stop = asyncio.Event()
            clients = asyncio.create_task(run_clients(server.url, 8, stop, results))
            async with httpx.AsyncClient(base_url=server.url, timeout=300.0) as admin_client:
                for name in ("truncated", "wrongarch", "badgolden", "badsha"):
                    answers[name] = await admin_client.post(
                        f"/v1/models/{ALIAS}/swap", json={"model": name, "wait": True}
                    )
            stop.set()
            await clients

        asyncio.run(scenario())
        for name, reason in (
            ("truncated", "truncated.gguf"),
            ("wrongarch", "mamba"),
            ("badgolden", "golden prompt 0"),
            ("badsha", "sha256 mismatch"),
        ):
            response = answers[name]
            assert response.status_code == 422, (name, response.text)
            assert (
                response.json()["error"]["code"] == "model_rejected"
                and reason in response.json()["error"]["message"]
            ), response.text
        assert results and failed(results) == []
        assert {v for _, _, r in results for v in r.versions} == {v1}
        assert metric_value(server.url, "bitserve_model_swaps_total", action="swap", result="rejected") == 4
        models = httpx.get(f"{server.url}/v1/models").json()["data"]
        assert [(m["id"], m["version"], m["state"], m["pending"]) for m in models] == [
            (ALIAS, v1, "ready", None)
        ]


# ----------------------------------------------------------------- probation and rollback


def _break_engine_step(server: Any) -> None:
    """Fault injection: the serving version's next engine step raises (as a kernel bug would)."""

    async def inject() -> None:
        runner = server.state.models.aliases[ALIAS].current.instance.engine.runner

        def broken_execute(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("injected fault inside the step")

        runner.execute = broken_execute

    server.run(inject())


def test_probation_failure_rolls_back_automatically(model_root: ModelRoot) -> None:
    v1, v2 = version_of(model_root.files["v1"]), version_of(model_root.files["v2"])
    with lifecycle_server(model_root, swap_probation_s=30.0) as server:
        response = admin(server.url, f"/v1/models/{ALIAS}/swap", {"model": "v2", "wait": True})
        assert response.status_code == 200 and response.json()["result"]["version"] == v2
        _break_engine_step(server)
        results: list[Any] = []

        async def scenario() -> None:
            stop = asyncio.Event()
            clients = asyncio.create_task(run_clients(server.url, 8, stop, results))
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and server.state.models.aliases[ALIAS].current.version != v1:
                await asyncio.sleep(0.05)
            rolled_back_at = time.monotonic()
            while sum(1 for started, _, _ in results if started > rolled_back_at + 0.2) < 40:
                await asyncio.sleep(0.05)
            stop.set()
            await clients
            results.append(rolled_back_at)

        asyncio.run(scenario())
        rolled_back_at = results.pop()
        assert httpx.get(f"{server.url}/v1/models/{ALIAS}").json()["version"] == v1
        assert (
            metric_value(server.url, "bitserve_model_swaps_total", action="auto_rollback", result="success")
            == 1
        )
        bad = failed(results)
        assert bad, "the injected fault failed no request"
        for result in bad:  # only requests that hit the broken version fail
            assert (
                result.error is not None
                and (result.versions <= {v2})
                and result.error["code"] in ("engine_dead", "model_unavailable")
            ), result
        later = [item for item in results if item[0] > rolled_back_at + 0.2]
        assert (
            len(later) >= 40 and failed(later) == [] and {v for _, _, r in later for v in r.versions} == {v1}
        )


def test_manual_rollback_reloads_the_previous_version(model_root: ModelRoot) -> None:
    v1, v2 = version_of(model_root.files["v1"]), version_of(model_root.files["v2"])
    with lifecycle_server(model_root) as server:
        assert (
            admin(server.url, f"/v1/models/{ALIAS}/swap", {"model": "v2", "wait": True}).json()["result"][
                "version"
            ]
            == v2
        )
        rollback = admin(server.url, f"/v1/models/{ALIAS}/rollback", {"wait": True})
        assert rollback.status_code == 200, rollback.text
        assert rollback.json()["result"] == {"version": v1, "rolled_back_from": v2, "reloaded": True}
        result = asyncio.run(_one(server.url))
        assert result.versions == {v1} and failed([(0, 0, result)]) == []
        assert (
            metric_value(server.url, "bitserve_model_swaps_total", action="rollback", result="success") == 1
        )


async def _one(url: str, model: str | None = None) -> Any:
    async with httpx.AsyncClient(base_url=url, timeout=60.0) as client:
        return await stream_completion(client, "Hello", 4, model)


# ----------------------------------------------------------------- admin edge


@pytest.mark.parametrize(
    "reference",
    [
        "../outside/secret.gguf",
        "%2e%2e/outside/secret.gguf",
        "%252e%252e%252foutside%252fsecret.gguf",
        "escape.gguf",
        "sub/../../outside/secret.gguf",
        "/etc/passwd",
    ],
)
def test_path_tricks_are_refused(
    model_root: ModelRoot, reference: str, caplog: pytest.LogCaptureFixture
) -> None:
    from bitserve.config import EngineConfig, ServerConfig
    from bitserve.server.app import build_state

    state = build_state(ServerConfig(model_roots=str(model_root.root)), EngineConfig())
    from bitserve.errors import Forbidden

    with pytest.raises(Forbidden):
        state.models.files.resolve(reference)
    assert "refused model reference" in caplog.text


def test_admin_http_edge(model_root: ModelRoot) -> None:
    """403 for escapes (absolute, ../, encoded, symlink), 409 for a second action on one alias,
    404 for unknown aliases, 400 for unknown fields, 202 + status URL without wait."""
    v2 = version_of(model_root.files["v2"])
    with lifecycle_server(model_root) as server:
        for reference in (
            str(model_root.outside),
            "../outside/secret.gguf",
            "%2e%2e%2foutside%2fsecret.gguf",
            "escape.gguf",
        ):
            response = admin(server.url, "/v1/models/load", {"model": reference, "alias": "x", "wait": True})
            assert response.status_code == 403 and response.json()["error"]["code"] == "forbidden", (
                response.text
            )
        first = admin(server.url, f"/v1/models/{ALIAS}/swap", {"model": "v2"})
        second = admin(server.url, f"/v1/models/{ALIAS}/swap", {"model": "v2"})
        assert first.status_code == 202 and second.status_code == 409, (first.text, second.text)
        assert second.json()["error"]["code"] == "conflict"
        status_url = first.json()["status_url"]
        assert first.headers["location"] == status_url
        deadline = time.monotonic() + 60
        while (operation := httpx.get(f"{server.url}{status_url}").json())[
            "state"
        ] == "running" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (
            operation["state"] == "succeeded"
            and operation["result"]["version"] == v2
            and operation["progress"] == 1.0
        )
        assert admin(server.url, "/v1/models/nope/rollback").status_code == 404
        assert admin(server.url, "/v1/models/load", {"model": "v2", "colour": "red"}).status_code == 400
        assert (
            admin(server.url, "/v1/models/load", {"model": "v2", "alias": ALIAS, "wait": True}).status_code
            == 409
        )
        assert admin(server.url, "/v1/models/load", {"model": "v2", "device": "cuda:7"}).status_code == 400


# ----------------------------------------------------------------- several models


def test_several_models_routed_by_name_with_lru_budget(model_root: ModelRoot) -> None:
    files = model_root.files
    v1, v2 = version_of(files["v1"]), version_of(files["v2"])
    per_model = files["v1"].stat().st_size + KV_CACHE_BYTES
    with lifecycle_server(model_root, max_models_memory_bytes=int(per_model * 2.5)) as server:
        loaded = admin(server.url, "/v1/models/load", {"model": "v2", "alias": "second", "wait": True})
        assert loaded.status_code == 200, loaded.text
        assert asyncio.run(_one(server.url, "second")).versions == {v2}
        assert asyncio.run(_one(server.url, ALIAS)).versions == {v1}
        assert asyncio.run(_one(server.url)).versions == {v1}  # no `model`: the default alias
        unknown = asyncio.run(_one(server.url, "nope"))
        assert unknown.status == 404 and "second, v1" in unknown.error["hint"]
        listed = {m["id"]: m for m in httpx.get(f"{server.url}/v1/models").json()["data"]}
        assert set(listed) == {ALIAS, "second"} and listed["second"]["quant_formats"] == [
            "F32",
            "Q8_0",
            "TQ2_0",
        ]
        assert (
            listed["second"]["memory_bytes"] > files["v2"].stat().st_size
            and listed["second"]["state"] == "ready"
        )

        # v1 is now the least recently used, but busy (a held lease = a request in flight): the
        # third load must evict "second", never v1.
        lease = server.run(_acquire(server, ALIAS))
        time.sleep(0.01)
        asyncio.run(_one(server.url, "second"))
        third = admin(server.url, "/v1/models/load", {"model": "v1", "alias": "third", "wait": True})
        assert third.status_code == 200, third.text
        assert set(server.state.models.aliases) == {ALIAS, "third"}
        assert (
            metric_value(
                server.url, "bitserve_model_lifecycle_events_total", action="evict", result="success"
            )
            == 1
        )
        # both resident models busy: no room, a clear 503, nothing evicted
        lease_third = server.run(_acquire(server, "third"))
        fourth = admin(server.url, "/v1/models/load", {"model": "v2", "alias": "fourth", "wait": True})
        assert fourth.status_code == 503 and "not enough model memory" in fourth.json()["error"]["message"]
        assert set(server.state.models.aliases) == {ALIAS, "third"}
        server.run(_release(lease))
        server.run(_release(lease_third))
        unload = admin(server.url, "/v1/models/third/unload", {"wait": True})
        assert unload.status_code == 200 and set(server.state.models.aliases) == {ALIAS}


async def _acquire(server: Any, alias: str) -> Any:
    return server.state.models.acquire(alias)


async def _release(lease: Any) -> None:
    lease.release()


# ----------------------------------------------------------------- CLI


def test_models_cli_against_a_running_server(
    model_root: ModelRoot, capsys: pytest.CaptureFixture[str]
) -> None:
    from bitserve.cli.main import main

    v2 = version_of(model_root.files["v2"])
    with lifecycle_server(model_root) as server:
        assert main(["models", "--url", server.url, "swap", ALIAS, "v2"]) == 0
        captured = capsys.readouterr()
        assert (
            f"'version': '{v2}'" in captured.out and "100.0%" in captured.err
        )  # the progress bar's last frame
        assert main(["models", "--url", server.url, "list"]) == 0
        table = capsys.readouterr().out.splitlines()
        assert table[0].split()[:3] == ["ALIAS", "VERSION", "STATE"] and table[1].split()[:4] == [
            ALIAS,
            "*",
            v2,
            "ready",
        ]
        assert main(["models", "--url", server.url, "load", "badgolden", "--alias", "bad"]) == 2
        assert "golden prompt 0" in capsys.readouterr().err
        assert main(["models", "--url", server.url, "unload", "nope"]) == 2
        assert "404" in capsys.readouterr().err
        assert "cpu" in table[1].split()  # the DEVICES column
        assert main(["models", "--url", server.url, "swap", ALIAS, "v1", "--device", "cpu,cuda:9"]) == 2
        assert "'cuda:9' is not available" in capsys.readouterr().err


def test_pull_checks_and_hashes_a_catalog_model(
    smollm2_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from bitserve.cli.main import main
    from bitserve.loader.catalog import DEFAULT_MODEL

    assert main(["pull", DEFAULT_MODEL, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["path"] == str(smollm2_path) and result["architecture"] == "llama"
    assert result["sha256"] == hashlib.sha256(smollm2_path.read_bytes()).hexdigest()
    assert main(["pull", "no-such-model"]) == 2


# ----------------------------------------------------------------- black box


def test_blackbox_serve_with_a_model_root_and_the_openai_client(
    model_root: ModelRoot, tmp_path: Path
) -> None:
    """`bitserve serve --model-root` in a subprocess: the official client sees the version that served
    it change with a swap made by `bitserve models`, and GET /v1/models lists the new version."""
    import subprocess
    import sys

    import openai
    from http_testing import ServerProcess

    v1, v2 = version_of(model_root.files["v1"]), version_of(model_root.files["v2"])
    server = ServerProcess(
        tmp_path / "server.log",
        "--model",
        str(model_root.files["v1"]),
        "--model-root",
        str(model_root.root),
        "--swap-probation-s",
        "0",
        "--max-model-len",
        "256",
    )
    try:
        server.wait_ready()
        with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60.0) as api:
            first = api.completions.with_raw_response.create(
                model=ALIAS, prompt="Hello", max_tokens=3, temperature=0
            )
            assert first.headers["x-model-version"] == v1 and first.parse().model_extra["model_version"] == v1
            swap = subprocess.run(
                [sys.executable, "-m", "bitserve", "models", "--url", server.url, "swap", ALIAS, "v2"],
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )
            assert swap.returncode == 0, swap.stderr
            second = api.completions.create(model=ALIAS, prompt="Hello", max_tokens=3, temperature=0)
            assert second.model_extra["model_version"] == v2
            assert [(m.id, m.model_extra["version"]) for m in api.models.list()] == [(ALIAS, v2)]
    finally:
        server.stop()


def test_load_progress_is_visible_while_loading(
    model_root: ModelRoot, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a load runs (held at the weights phase here), GET /v1/models lists the new alias as
    loading with its phase and progress, and the running operation; requests to it get 503."""
    import threading

    from bitserve.lifecycle import manager as model_manager

    release = threading.Event()
    real_load = model_manager.ModelInstance.load

    def held_load(config: Any) -> Any:
        assert release.wait(60), "the test never released the load"
        return real_load(config)

    with lifecycle_server(model_root) as server:
        monkeypatch.setattr(model_manager.ModelInstance, "load", staticmethod(held_load))
        started = admin(server.url, "/v1/models/load", {"model": "v2", "alias": "second"})
        assert started.status_code == 202
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            listing = httpx.get(f"{server.url}/v1/models").json()
            loading = [m for m in listing["data"] if m["id"] == "second"]
            if loading and loading[0]["phase"] == "loading":
                break
            time.sleep(0.05)
        assert loading and loading[0]["state"] == "loading" and 0 < loading[0]["progress"] < 1, listing
        assert [(op["action"], op["alias"], op["state"]) for op in listing["operations"]] == [
            ("load", "second", "running")
        ]
        assert asyncio.run(_one(server.url, "second")).status == 503
        release.set()
        operation_url = started.json()["status_url"]
        while (
            httpx.get(f"{server.url}{operation_url}").json()["state"] == "running"
            and time.monotonic() < deadline
        ):
            time.sleep(0.05)
        assert httpx.get(f"{server.url}{operation_url}").json()["state"] == "succeeded"
        assert asyncio.run(_one(server.url, "second")).versions == {version_of(model_root.files["v2"])}


# ----------------------------------------------------------------- checkpoint directories


def test_a_checkpoint_directory_in_a_root_loads_and_serves(
    hf_checkpoint_dir: Any, smollm2_path: Path, tmp_path: Path
) -> None:
    """A Hugging Face checkpoint directory in a model root: listed by its folder name, loaded over the admin
    API, and served by alias, its version the hash of its files (lifecycle/model_files.file_sha256)."""
    import shutil

    from lifecycle_testing import build_model_root

    from bitserve.lifecycle.model_files import file_sha256

    root = build_model_root(tmp_path, smollm2_path)
    _, folder = hf_checkpoint_dir("bitnet", "packed")
    shutil.copytree(folder, root.root / "bitnet-tiny")
    version = file_sha256(root.root / "bitnet-tiny")[:12]
    with lifecycle_server(root) as server:
        loaded = admin(server.url, "/v1/models/load", {"model": "bitnet-tiny", "alias": "hf", "wait": True})
        assert loaded.status_code == 200, loaded.text
        result = asyncio.run(_one(server.url, "hf"))
        assert result.status == 200 and result.has_done and result.versions == {version}
        listed = {m["id"]: m for m in httpx.get(f"{server.url}/v1/models").json()["data"]}
        assert "I2_S" in listed["hf"]["quant_formats"]
