"""The Batch API, black box: `bitserve serve` (embedded SmolLM2) driven by the official openai client's
files and batches calls: upload (validated line by line), run to completion on each endpoint, the
Batch object's model and usage, list with pagination (batches and files), cancel, failures in the
error file, delete (refused while a batch reads the file), the batch metrics and /v1/stats. Each test
runs on SQLite (the package's server) and on PostgreSQL (a server of its own; skipped without
POSTGRES_TEST_URL)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from batch_testing import MODEL, chat_line, file_lines, jsonl, wait_final
from http_testing import ServerProcess
from openai.types import Batch, BatchUsage
from postgres_testing import fresh_database


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    if request.param == "sqlite":
        yield request.getfixturevalue("blackbox")
        return
    with fresh_database() as url:
        log = tmp_path_factory.mktemp("batches-postgres") / "server.log"
        postgres_server = ServerProcess(log, "--batch-db", url, "--no-warmup")
        try:
            postgres_server.wait_ready()
            yield postgres_server
        finally:
            postgres_server.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60.0) as api:
        yield api


def upload(client: openai.OpenAI, content: bytes) -> str:
    return client.files.create(file=("input.jsonl", content), purpose="batch").id


def test_chat_batch_round_trip(client: openai.OpenAI) -> None:
    content = jsonl([chat_line(f"q{index}", f"Count to {index}.") for index in range(3)])
    uploaded = client.files.create(file=("questions.jsonl", content), purpose="batch")
    assert (uploaded.object, uploaded.purpose, uploaded.bytes) == ("file", "batch", len(content))
    assert client.files.retrieve(uploaded.id).filename == "questions.jsonl"
    assert client.files.content(uploaded.id).content == content
    created = client.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"job": "nightly"},
    )
    assert created.status == "validating" and created.metadata == {"job": "nightly"}
    assert created.expires_at - created.created_at == 24 * 3600
    batch = wait_final(client, created.id)
    assert batch.status == "completed" and batch.error_file_id is None
    assert batch.request_counts.model_dump() == {"total": 3, "completed": 3, "failed": 0}
    assert batch.in_progress_at and batch.finalizing_at and batch.completed_at
    output = file_lines(client, batch.output_file_id)
    assert set(output) == {"q0", "q1", "q2"}
    # the Batch object as the openai SDK types it, model and usage added up from the finished requests
    raw = client.batches.with_raw_response.retrieve(batch.id).http_response.json()
    assert set(raw) == set(Batch.model_fields) and set(raw["usage"]) == set(BatchUsage.model_fields)
    assert batch.model == MODEL
    bodies = [line["response"]["body"] for line in output.values()]
    assert batch.usage.input_tokens == sum(body["usage"]["prompt_tokens"] for body in bodies) > 0
    assert batch.usage.output_tokens == sum(body["usage"]["completion_tokens"] for body in bodies) > 0
    assert batch.usage.total_tokens == batch.usage.input_tokens + batch.usage.output_tokens
    cached = sum(
        (body["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) for body in bodies
    )
    assert batch.usage.input_tokens_details.cached_tokens == cached  # prefix-cache hits
    assert batch.usage.output_tokens_details.reasoning_tokens == 0
    for line in output.values():
        assert line["error"] is None and line["id"].startswith("batch_req_")
        response = line["response"]
        assert response["status_code"] == 200 and response["request_id"]
        body = response["body"]
        assert body["object"] == "chat.completion" and body["model"] == MODEL
        assert 1 <= body["usage"]["completion_tokens"] <= 6 and body["choices"][0]["message"]["content"]
    assert client.files.retrieve(batch.output_file_id).purpose == "batch_output"


def test_completions_and_embeddings_batches(client: openai.OpenAI) -> None:
    completion_lines = [
        {
            "custom_id": "c",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": "Hi", "max_tokens": 4},
        },
        # a model nobody serves fails for good (404, not retried): the error file has its response
        {
            "custom_id": "missing",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "no-such-model", "prompt": "Hi", "max_tokens": 4},
        },
    ]
    embedding_lines = [
        {"custom_id": f"e{index}", "method": "POST", "url": "/v1/embeddings", "body": {"input": text}}
        for index, text in enumerate(("the sea", "a river"))
    ]
    completions = client.batches.create(
        input_file_id=upload(client, jsonl(completion_lines)),
        endpoint="/v1/completions",
        completion_window="24h",
    )
    embeddings = client.batches.create(
        input_file_id=upload(client, jsonl(embedding_lines)),
        endpoint="/v1/embeddings",
        completion_window="24h",
    )
    done = wait_final(client, completions.id)
    assert done.status == "completed"
    assert done.request_counts.model_dump() == {"total": 2, "completed": 1, "failed": 1}
    assert file_lines(client, done.output_file_id)["c"]["response"]["body"]["object"] == "text_completion"
    failed = file_lines(client, done.error_file_id)["missing"]["response"]
    assert failed["status_code"] == 404 and failed["body"]["error"]["code"] == "model_not_found"
    done = wait_final(client, embeddings.id)
    vectors = {
        custom_id: line["response"]["body"]["data"][0]["embedding"]
        for custom_id, line in file_lines(client, done.output_file_id).items()
    }
    assert set(vectors) == {"e0", "e1"} and len(vectors["e0"]) == len(vectors["e1"]) > 0


def test_list_pages_newest_first(client: openai.OpenAI) -> None:
    file_id = upload(client, jsonl([chat_line("one", "Hi", max_tokens=1)]))
    ids = [
        client.batches.create(
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
        ).id
        for _ in range(3)
    ]
    first = client.batches.list(limit=2)
    assert [batch.id for batch in first.data] == ids[::-1][:2] and first.has_more
    second = client.batches.list(limit=2, after=first.data[-1].id)
    assert second.data[0].id == ids[0]
    listed = [batch.id for batch in client.batches.list(limit=2)]  # the client follows the pages
    assert listed[:3] == ids[::-1] and len(listed) == len(set(listed))
    for batch_id in ids:
        wait_final(client, batch_id)


def test_cancel_aborts_running_requests_and_keeps_every_request_once(
    client: openai.OpenAI, server: ServerProcess
) -> None:
    lines = [chat_line(f"r{index}", "Tell me about rivers.", max_tokens=400) for index in range(12)]
    for line in lines:
        line["body"]["ignore_eos"] = True  # long enough to be running when the cancel lands
    input_file_id = upload(client, jsonl(lines))
    created = client.batches.create(
        input_file_id=input_file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    while client.batches.retrieve(created.id).status == "validating":
        time.sleep(0.05)
    with pytest.raises(openai.ConflictError, match=f"input of batch {created.id}"):
        client.files.delete(input_file_id)  # a running batch reads it
    cancelling = client.batches.cancel(created.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
    batch = wait_final(client, created.id, timeout_s=30)
    assert batch.status == "cancelled" and batch.cancelled_at
    # the running requests were aborted, not left to finish
    assert httpx.get(f"{server.url}/v1/stats").json()["requests"]["num_active"] == 0
    output, errors = file_lines(client, batch.output_file_id), file_lines(client, batch.error_file_id)
    assert set(output) | set(errors) == {f"r{index}" for index in range(12)} and not set(output) & set(errors)
    assert batch.request_counts.completed == len(output) < 12
    assert {line["error"]["code"] for line in errors.values()} == {"batch_cancelled"}
    assert client.files.delete(input_file_id).deleted  # the batch has ended
    finished = client.batches.create(
        input_file_id=upload(client, jsonl([chat_line("short", "Hi", max_tokens=2)])),
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    assert wait_final(client, finished.id).status == "completed"
    with pytest.raises(openai.ConflictError, match="completed"):
        client.batches.cancel(finished.id)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (
            jsonl([chat_line("a", "x"), chat_line("b", "y"), chat_line("a", "z")]),
            "line 3: custom_id 'a' repeats",
        ),
        (jsonl([{**chat_line("a", "x"), "url": "/v1/moderations"}]), "line 1: url '/v1/moderations'"),
        (b'{"custom_id": "a"', "line 1: the request body is not valid JSON"),
    ],
    ids=["duplicate-custom-id", "unknown-url", "bad-json"],
)
def test_upload_refuses_bad_lines(client: openai.OpenAI, content: bytes, message: str) -> None:
    with pytest.raises(openai.BadRequestError, match=message):
        upload(client, content)


def test_files_errors_and_delete(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("x.jsonl", jsonl([chat_line("a", "x")])), purpose="fine-tune")
    with pytest.raises(openai.NotFoundError):
        client.batches.create(
            input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h"
        )
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")
    file_id = upload(client, jsonl([chat_line("a", "x")]))
    deleted = client.files.delete(file_id)
    assert deleted.deleted and deleted.id == file_id
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(file_id)
    with pytest.raises(openai.NotFoundError):
        client.files.content(file_id)


def test_files_list_filters_by_purpose_and_pages(client: openai.OpenAI) -> None:
    uploaded = [upload(client, jsonl([chat_line("a", "x")])) for _ in range(3)]
    newest_first = [file.id for file in client.files.list(purpose="batch", limit=2)]  # follows the pages
    assert len(newest_first) == len(set(newest_first)) and set(uploaded) <= set(newest_first)
    page = client.files.list(purpose="batch", limit=2)
    assert len(page.data) == 2 and page.has_more
    assert page.data[0].created_at >= page.data[1].created_at
    following = client.files.list(purpose="batch", limit=2, after=page.data[-1].id)
    assert following.data[0].id == newest_first[2]
    oldest_first = [file.id for file in client.files.list(purpose="batch", order="asc")]
    assert oldest_first == newest_first[::-1]
    assert client.files.retrieve(uploaded[0]).model_dump()["purpose"] == "batch"
    outputs = client.files.list(purpose="batch_output").data
    assert all(file.purpose == "batch_output" for file in outputs)
    assert not set(uploaded) & {file.id for file in outputs}
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.list(purpose="fine-tune")


def test_batch_metrics_and_stats(client: openai.OpenAI, server: ServerProcess) -> None:
    created = client.batches.create(
        input_file_id=upload(client, jsonl([chat_line("m", "Hi", max_tokens=2)])),
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    assert wait_final(client, created.id).status == "completed"
    deadline = time.monotonic() + 10
    while True:  # the worker reads the counts at most once a second
        batches = httpx.get(f"{server.url}/v1/stats").json()["batches"]
        if batches["progress"]["open_batches"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert batches["enabled"] and batches["by_status"]["completed"] >= 1
    assert batches["progress"]["open_batches"] == 0 and batches["worker"]["completed"] >= 1
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'bitserve_batches{status="completed"}' in metrics
    completed = [line for line in metrics.splitlines() if line.startswith("bitserve_batch_requests_total{")]
    assert any('outcome="completed"' in line and float(line.split()[-1]) >= 1 for line in completed)
    assert 'bitserve_batch_requests_open{state="running"} 0.0' in metrics
