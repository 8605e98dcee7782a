"""The Batch API under the security layer (in process, synthetic model served as `a`): the `inference`
scope, files and batches owned by the key that made them (another key gets 404), a key limited to some
models may not upload lines naming others, a batch runs to completion inside the app, and an app
without a batch configuration answers 503."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import security_testing as st
from conftest import IN_PROCESS_SERVER
from fastapi.testclient import TestClient

from bitserve.server.batches.config import BatchConfig
from bitserve.server.security.config import SecurityConfig

SERVED = "a"


def completion_line(custom_id: str, model: str = SERVED) -> dict[str, Any]:
    body = {"model": model, "prompt": "hello", "max_tokens": 3, "temperature": 0}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body}


def upload(client: TestClient, key: str, lines: list[dict[str, Any]]) -> Any:
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    return client.post(
        "/v1/files", headers=st.bearer(key), files={"file": ("in.jsonl", content)}, data={"purpose": "batch"}
    )


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory, synthetic_instance: object) -> Iterator[TestClient]:
    from bitserve.server.app import build_app

    folder = tmp_path_factory.mktemp("batches-secured")
    security = SecurityConfig(auth_file=str(st.write_auth_file(folder / "auth.toml")))
    app = build_app(
        replace(IN_PROCESS_SERVER, served_model_name=SERVED),
        instance=synthetic_instance,  # type: ignore[arg-type]
        security=security,
        batch=BatchConfig(batch_db=str(folder / "batches.sqlite3")),
    )
    with TestClient(app) as client:
        yield client


def test_files_and_batches_belong_to_their_key(secured: TestClient) -> None:
    uploaded = upload(secured, "admin", [completion_line("x")])
    assert uploaded.status_code == 200, uploaded.text
    file_id = uploaded.json()["id"]
    assert secured.get(f"/v1/files/{file_id}", headers=st.bearer("admin")).status_code == 200
    for path in (f"/v1/files/{file_id}", f"/v1/files/{file_id}/content"):
        response = secured.get(path, headers=st.bearer("infer"))  # another key: as if it did not exist
        assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"
    create = {"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h"}
    assert secured.post("/v1/batches", headers=st.bearer("infer"), json=create).status_code == 404
    batch = secured.post("/v1/batches", headers=st.bearer("admin"), json=create).json()
    assert secured.get(f"/v1/batches/{batch['id']}", headers=st.bearer("infer")).status_code == 404
    assert secured.post(f"/v1/batches/{batch['id']}/cancel", headers=st.bearer("infer")).status_code == 404
    assert batch["id"] not in [
        b["id"] for b in secured.get("/v1/batches", headers=st.bearer("infer")).json()["data"]
    ]
    assert secured.delete(f"/v1/files/{file_id}", headers=st.bearer("infer")).status_code == 404


def test_scope_and_model_restrictions(secured: TestClient) -> None:
    refused = upload(secured, "reader", [completion_line("x")])  # models:read only
    assert refused.status_code == 403 and "inference" in refused.json()["error"]["message"]
    assert secured.get("/v1/batches").status_code == 401
    other_model = upload(secured, "only_a", [completion_line("ok"), completion_line("no", model="b")])
    assert other_model.status_code == 403
    assert other_model.json()["error"]["message"].startswith("line 2: this credential may not use 'b'")
    assert upload(secured, "only_a", [completion_line("ok")]).status_code == 200


def test_a_batch_runs_inside_the_app(secured: TestClient) -> None:
    file_id = upload(secured, "infer", [completion_line(f"c{index}") for index in range(3)]).json()["id"]
    create = {"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h"}
    batch = secured.post("/v1/batches", headers=st.bearer("infer"), json=create).json()
    deadline = time.monotonic() + 60
    while batch["status"] not in ("completed", "failed"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.1)
        batch = secured.get(f"/v1/batches/{batch['id']}", headers=st.bearer("infer")).json()
    assert batch["status"] == "completed" and batch["request_counts"]["completed"] == 3
    content = secured.get(f"/v1/files/{batch['output_file_id']}/content", headers=st.bearer("infer"))
    assert content.headers["content-type"].startswith("application/jsonl")
    lines = [json.loads(line) for line in content.text.splitlines()]
    assert sorted(line["custom_id"] for line in lines) == ["c0", "c1", "c2"]
    assert all(line["response"]["body"]["object"] == "text_completion" for line in lines)


def test_limits_on_the_listing(secured: TestClient) -> None:
    for query in ("limit=0", "limit=101", "limit=x"):
        response = secured.get(f"/v1/batches?{query}", headers=st.bearer("admin"))
        assert response.status_code == 400 and response.json()["error"]["param"] == "limit"


def test_an_app_without_a_batch_configuration_answers_503(client: TestClient) -> None:
    response = client.get("/v1/batches")
    assert response.status_code == 503 and "Batch API is off" in response.json()["error"]["message"]


def test_uploads_may_be_larger_than_other_bodies(tmp_path: Path, secured: TestClient) -> None:
    # IN_PROCESS_SERVER caps bodies at 64 KiB; /v1/files takes up to batch_max_file_bytes
    lines = [completion_line(f"id-{index:05d}") for index in range(700)]
    response = upload(secured, "admin", lines)
    assert response.status_code == 200, response.text
    assert response.json()["bytes"] > IN_PROCESS_SERVER.max_body_bytes
