"""The batch worker and store as a unit, over real databases (SQLite, and PostgreSQL where
POSTGRES_TEST_URL names a server): retries with backoff and the dead letter, expiry, cancel, resuming
after a process dies mid-batch (exactly once), two workers sharing one PostgreSQL database, the
model and token usage, migrations, the one-process lock, and upload validation. Only the executor is
faked (scripted HTTP outcomes), to isolate the worker from the model."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from postgres_testing import fresh_database, query

from bitserve.errors import Conflict, InvalidRequest, PayloadTooLarge, QueueFull
from bitserve.server.batches import worker as worker_module
from bitserve.server.batches.config import BatchConfig
from bitserve.server.batches.database import DatabaseInUse, DatabaseUnavailable
from bitserve.server.batches.executor import Endpoint, InProcessExecutor, Outcome
from bitserve.server.batches.input_file import InputLimits, parse_input_file
from bitserve.server.batches.migrations import LATEST_VERSION, SQLITE_TYPES, pending_migrations
from bitserve.server.batches.records import RequestRecord
from bitserve.server.batches.store import BatchStore
from bitserve.server.batches.worker import BatchWorker
from bitserve.server.protocol import ChatCompletionRequest, CompletionRequest

URL = "/v1/completions"
BODY_MODELS = {URL: CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}
LIMITS = InputLimits(max_file_bytes=1 << 20, max_lines=100, max_body_bytes=4096)
FINAL = ("completed", "failed", "expired", "cancelled")
BLOCK = -1  # a scripted status: wait until cancelled


def jsonl(prompts: list[str], url: str = URL) -> bytes:
    lines = [
        {"custom_id": prompt, "method": "POST", "url": url, "body": {"prompt": prompt, "max_tokens": 4}}
        for prompt in prompts
    ]
    return "\n".join(json.dumps(line) for line in lines).encode() + b"\n"


def ok_body(prompt: str) -> dict[str, Any]:
    return {"text": prompt.upper(), "model": "m", "usage": {"prompt_tokens": 3, "completion_tokens": 2}}


class ScriptedExecutor:
    """Answers each prompt with its scripted statuses in turn (then 200); BLOCK waits to be cancelled."""

    def __init__(self, script: dict[str, list[int]] | None = None) -> None:
        self.script = {prompt: list(statuses) for prompt, statuses in (script or {}).items()}
        self.calls: Counter[str] = Counter()
        self.cancelled: Counter[str] = Counter()

    async def __call__(self, url: str, body: dict[str, Any]) -> Outcome:
        prompt = body["prompt"]
        self.calls[prompt] += 1
        statuses = self.script.get(prompt) or [200]
        status = statuses.pop(0) if len(statuses) > 1 else statuses[0]
        if status == BLOCK:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled[prompt] += 1
                raise
        body_out = ok_body(prompt)
        if status != 200:
            body_out = {"error": {"code": str(status)}}
        return Outcome(status, body_out, f"req-{prompt}-{self.calls[prompt]}")


class SlowExecutor(ScriptedExecutor):
    """Every request takes a moment, so two workers' claims overlap."""

    async def __call__(self, url: str, body: dict[str, Any]) -> Outcome:
        await asyncio.sleep(0.02)
        return await super().__call__(url, body)


def make_worker(
    store: BatchStore,
    executor: ScriptedExecutor,
    clock: Callable[[], float] | None = None,
    is_ready: bool = True,
    **config: Any,
) -> BatchWorker:
    settings = {"batch_max_attempts": 3, "batch_retry_base_s": 0.01, "batch_retry_max_s": 0.02, **config}
    extra = {"clock": clock} if clock is not None else {}
    return BatchWorker(
        store, executor, BatchConfig(**settings), BODY_MODELS, LIMITS, is_ready=lambda: is_ready, **extra
    )


def submit(store: BatchStore, content: bytes, *, expires_at: float = 1e12, endpoint: str = URL) -> str:
    record = store.add_file("alice", "batch", "in.jsonl", content, 1)
    return store.create_batch("alice", endpoint, record.id, "24h", None, 1, expires_at).id


async def run_until(
    worker: BatchWorker, store: BatchStore, batch_id: str, done: Callable[[Any], bool]
) -> Any:
    for _ in range(2000):
        await worker.step()
        batch = store.get_batch(batch_id)
        if done(batch):
            return batch
        await asyncio.sleep(0.005)
    raise AssertionError(f"batch stuck: {store.get_batch(batch_id)}")


def lines_of(store: BatchStore, file_id: str | None) -> dict[str, dict[str, Any]]:
    if file_id is None:
        return {}
    records = [json.loads(line) for line in store.read_file(file_id).decode().splitlines()]
    by_id = {record["custom_id"]: record for record in records}
    assert len(by_id) == len(records), "a custom_id appears twice"
    return by_id


@pytest.fixture
def store(batch_db: str) -> Iterator[BatchStore]:
    opened = BatchStore(batch_db)
    yield opened
    opened.close()


def test_retries_with_backoff_then_dead_letter(store: BatchStore) -> None:
    executor = ScriptedExecutor(
        {"a": [503, 503, 200], "b": [503], "c": [400], "d": [429, 200], "e": [500, 200]}
    )
    worker = make_worker(store, executor)
    batch_id = submit(store, jsonl(["a", "b", "c", "d", "e"]))
    batch = asyncio.run(run_until(worker, store, batch_id, lambda b: b.status in FINAL))
    assert batch.status == "completed"
    assert batch.to_object()["request_counts"] == {"total": 5, "completed": 3, "failed": 2}
    # b kept failing: dead-lettered after batch_max_attempts; c's 400 is not retryable
    assert executor.calls == {"a": 3, "b": 3, "c": 1, "d": 2, "e": 2}
    output, errors = lines_of(store, batch.output_file_id), lines_of(store, batch.error_file_id)
    assert set(output) == {"a", "d", "e"} and set(errors) == {"b", "c"}
    assert output["a"]["response"] == {"status_code": 200, "request_id": "req-a-3", "body": ok_body("a")}
    assert output["a"]["error"] is None and output["a"]["id"].startswith("batch_req_")
    assert errors["b"]["response"]["status_code"] == 503 and errors["c"]["response"]["status_code"] == 400
    assert batch.finalizing_at is not None and batch.completed_at is not None
    # model and usage: from the three that completed (the failed ones' bodies report none)
    assert batch.to_object()["model"] == "m"
    assert batch.to_object()["usage"] == {
        "input_tokens": 9,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": 6,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 15,
    }
    assert worker.outcomes == {"completed": 3, "failed": 2, "retried": 6}


def test_expiry_stops_what_is_unfinished(store: BatchStore) -> None:
    now = [1000.0]
    executor = ScriptedExecutor({"slow1": [BLOCK], "slow2": [BLOCK]})
    worker = make_worker(store, executor, clock=lambda: now[0])
    batch_id = submit(store, jsonl(["fast", "slow1", "slow2"]), expires_at=1100.0)

    async def scenario() -> Any:
        await run_until(
            worker, store, batch_id, lambda b: b.num_completed == 1 and executor.calls["slow2"] == 1
        )
        now[0] = 1100.0  # the completion window ends
        return await run_until(worker, store, batch_id, lambda b: b.status in FINAL)

    batch = asyncio.run(scenario())
    assert batch.status == "expired" and batch.expired_at == 1100 and batch.completed_at is None
    assert executor.cancelled == {"slow1": 1, "slow2": 1}  # the running requests were aborted
    assert set(lines_of(store, batch.output_file_id)) == {"fast"}
    errors = lines_of(store, batch.error_file_id)
    assert {line["error"]["code"] for line in errors.values()} == {"batch_expired"}
    assert set(errors) == {"slow1", "slow2"} and errors["slow1"]["response"] is None


def test_cancel_stops_the_batch_and_keeps_what_finished(store: BatchStore) -> None:
    executor = ScriptedExecutor({"slow": [BLOCK]})
    worker = make_worker(store, executor, batch_concurrency=2)
    batch_id = submit(store, jsonl(["fast", "slow", "never1", "never2"]))

    async def scenario() -> Any:
        await run_until(
            worker, store, batch_id, lambda b: b.num_completed >= 1 and executor.calls["slow"] == 1
        )
        cancelling = store.cancel_batch(batch_id, "alice", 5)
        assert cancelling is not None and cancelling.status == "cancelling" and cancelling.cancelling_at == 5
        return await run_until(worker, store, batch_id, lambda b: b.status in FINAL)

    batch = asyncio.run(scenario())
    assert batch.status == "cancelled" and batch.cancelled_at is not None
    assert executor.cancelled["slow"] == 1
    output, errors = lines_of(store, batch.output_file_id), lines_of(store, batch.error_file_id)
    assert set(output) | set(errors) == {"fast", "slow", "never1", "never2"} and not set(output) & set(errors)
    assert {line["error"]["code"] for line in errors.values()} == {"batch_cancelled"}
    assert store.cancel_batch(batch_id, "alice", 6).status == "cancelled"  # idempotent
    assert store.cancel_batch(batch_id, "mallory", 6) is None  # another owner's: not found
    done_id = submit(store, jsonl(["x"]))
    asyncio.run(run_until(worker, store, done_id, lambda b: b.status in FINAL))
    with pytest.raises(Conflict, match="completed"):
        store.cancel_batch(done_id, "alice", 7)


def test_claim_marks_exactly_its_rows_running_under_its_key(batch_db: str, store: BatchStore) -> None:
    submit(store, jsonl(["a", "b", "c"]))
    asyncio.run(make_worker(store, ScriptedExecutor(), is_ready=False).step())  # -> in_progress
    claimed = store.claim(2, now=2e12)
    key = store.claim_key
    assert [(r.custom_id, r.status, r.claimed_by) for r in claimed] == [
        ("a", "running", key),
        ("b", "running", key),
    ]
    rows = query(batch_db, "SELECT custom_id, status, claimed_by FROM batch_requests ORDER BY line")
    assert [tuple(row) for row in rows] == [
        ("a", "running", key),
        ("b", "running", key),
        ("c", "pending", None),
    ]
    assert [r.custom_id for r in store.claim(5, now=2e12)] == ["c"]
    assert store.claim(5, now=2e12) == []  # nothing pending: nothing marked


def test_the_overview_counts_are_read_at_most_once_an_interval(
    store: BatchStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every ended request wakes a pass; the stats' three count queries do not run at each."""
    reads: list[float] = []
    overview = store.overview

    def counted() -> Any:
        reads.append(time.monotonic())
        return overview()

    monkeypatch.setattr(store, "overview", counted)
    worker = make_worker(store, ScriptedExecutor(), is_ready=False)
    batch_id = submit(store, jsonl(["a", "b"]))
    asyncio.run(worker.step())  # the first pass reads them
    assert worker.by_status == {"in_progress": 1} and worker.progress.num_pending == 2
    store.cancel_batch(batch_id, "alice", 2)
    for _ in range(2):
        asyncio.run(worker.step())  # the batch ends; the counts are not read again yet
    assert len(reads) == 1 and worker.by_status == {"in_progress": 1}
    monkeypatch.setattr(worker_module, "OVERVIEW_INTERVAL_S", 0.0)
    asyncio.run(worker.step())
    assert len(reads) == 2 and worker.by_status == {"cancelled": 1} and worker.progress.num_open == 0


def test_a_process_killed_mid_batch_resumes_exactly_once(batch_db: str) -> None:
    first = BatchStore(batch_db)
    batch_id = submit(first, jsonl(["a", "b", "c", "d"]))
    executor = ScriptedExecutor()
    worker = make_worker(first, executor, is_ready=False)  # claims nothing: the test claims by hand
    asyncio.run(worker.step())  # validating -> in_progress
    claimed = first.claim(3, now=2e12)  # three start running...
    assert [request.custom_id for request in claimed] == ["a", "b", "c"]
    line = {"custom_id": "a", "response": {"status_code": 200}}
    assert first.finish_request(claimed[0], "completed", line, 1)  # ...one commits, then the process dies
    # no worker shutdown: what a SIGKILL leaves (the connection and the lock file close with the process)
    first.close()

    second = BatchStore(batch_db)  # the restart: b and c were running, so they run again
    try:
        batch = asyncio.run(
            run_until(make_worker(second, executor), second, batch_id, lambda b: b.status in FINAL)
        )
        assert batch.to_object()["request_counts"] == {"total": 4, "completed": 4, "failed": 0}
        assert executor.calls == {"b": 1, "c": 1, "d": 1}  # a, committed before the kill, never ran again
        output = second.read_file(batch.output_file_id).decode().splitlines()
        assert sorted(json.loads(text)["custom_id"] for text in output) == ["a", "b", "c", "d"]
        assert not second.finish_request(claimed[0], "completed", line, 1)  # a result lands only once
    finally:
        second.close()


def test_a_worker_woken_as_it_is_cancelled_stops(store: BatchStore) -> None:
    """A request ending (wake) in the same tick as the server's stop (cancel) must not keep the worker
    running: asyncio.wait_for on Python < 3.12 swallowed such a cancel, and shutdown hung."""

    async def scenario() -> bool:
        worker = make_worker(store, ScriptedExecutor(), is_ready=False)
        run = asyncio.create_task(worker.run())
        await asyncio.sleep(0.05)  # the pass is done: waiting for a wake-up
        worker.wake()
        run.cancel()
        done, _ = await asyncio.wait({run}, timeout=5)
        return bool(done)

    assert asyncio.run(scenario())


def test_validation_fails_a_batch_whose_lines_name_another_endpoint(store: BatchStore) -> None:
    worker = make_worker(store, ScriptedExecutor())
    batch_id = submit(store, jsonl(["a"], url=URL), endpoint="/v1/chat/completions")
    batch = asyncio.run(run_until(worker, store, batch_id, lambda b: b.status in FINAL))
    assert batch.status == "failed" and batch.failed_at is not None
    error = batch.to_object()["errors"]["data"][0]
    assert "line 1" in error["message"] and "/v1/chat/completions" in error["message"]


def test_migrations_versions_and_the_process_lock(tmp_path: Path) -> None:
    path = tmp_path / "b.sqlite3"
    store = BatchStore(path)
    assert store.schema_version == LATEST_VERSION
    with pytest.raises(DatabaseInUse, match="another bitserve process"):
        BatchStore(path)
    store.close()
    assert BatchStore(path).schema_version == LATEST_VERSION  # reopening applies nothing twice
    newer = tmp_path / "newer.sqlite3"
    with sqlite3.connect(newer) as db:
        db.execute(f"PRAGMA user_version = {LATEST_VERSION + 1}")
    with pytest.raises(ValueError, match="newer than this bitserve"):
        BatchStore(newer)


def test_a_version_1_sqlite_database_is_migrated(tmp_path: Path) -> None:
    path = tmp_path / "v1.sqlite3"
    with sqlite3.connect(path) as db:  # what the first release left: migration 1 and one batch
        for statement in pending_migrations(0, SQLITE_TYPES)[0][1]:
            db.execute(statement)
        db.execute("PRAGMA user_version = 1")
        db.execute(
            "INSERT INTO batches (id, owner, endpoint, input_file_id, completion_window, status, "
            "created_at, expires_at) VALUES ('batch_old', 'alice', ?, 'file-x', '24h', 'completed', 1, 2)",
            (URL,),
        )
    store = BatchStore(path)
    try:
        assert store.schema_version == LATEST_VERSION
        old = store.get_batch("batch_old").to_object()
        assert old["model"] is None and old["usage"]["total_tokens"] == 0
    finally:
        store.close()


def test_batch_db_names_a_sqlite_file_or_a_postgresql_url() -> None:
    for value in ("postgresql://u:secret@db/bitserve", "postgres://u:secret@db/bitserve"):
        location = BatchConfig(batch_db=value).database
        assert location.url == "postgresql://u:secret@db/bitserve" and location.path is None
        assert location.describe() == "postgresql://u@db/bitserve"  # no password in the log
    assert BatchConfig(batch_db="postgresql+psycopg://db/b").database.url == "postgresql://db/b"
    with pytest.raises(ValueError, match="mysql is not supported"):
        BatchConfig(batch_db="mysql://user@db/bitserve")
    with pytest.raises(ValueError, match="unknown database URL scheme 'redis'"):
        BatchConfig(batch_db="redis://db/0")
    assert BatchConfig(batch_db="sqlite:////srv/b.db").database.path == Path("/srv/b.db")
    assert BatchConfig(data_dir="/data").database.path == Path("/data/batches.sqlite3")


def test_postgres_migrations_run_once_and_refuse_a_newer_schema() -> None:
    with fresh_database() as url:
        first, second = BatchStore(url), BatchStore(url)  # servers share a PostgreSQL database
        try:
            assert first.schema_version == second.schema_version == LATEST_VERSION
            assert query(url, "SELECT version FROM schema_version") == [(LATEST_VERSION,)]
            assert first.claim_key != second.claim_key
        finally:
            first.close()
            second.close()
        query(url, f"UPDATE schema_version SET version = {LATEST_VERSION + 1}")
        with pytest.raises(ValueError, match="newer than this bitserve"):
            BatchStore(url)
    with pytest.raises(DatabaseUnavailable, match="PostgreSQL"):
        BatchStore("postgresql://nobody@127.0.0.1:1/none")


def test_two_workers_on_one_postgres_database_never_run_a_request_twice() -> None:
    """Two workers (two connections, as two server processes have) claim from one batch at once: every
    request runs exactly once, both take a share, and the output has each request once."""
    prompts = [f"p{index:02d}" for index in range(40)]
    executor = SlowExecutor()
    with fresh_database() as url:
        stores = [BatchStore(url), BatchStore(url)]
        try:
            batch_id = submit(stores[0], jsonl(prompts))
            workers = [make_worker(each, executor, batch_concurrency=4) for each in stores]

            async def scenario() -> Any:
                runs = [asyncio.create_task(worker.run()) for worker in workers]
                try:
                    for _ in range(3000):
                        batch = stores[1].get_batch(batch_id)
                        if batch.status in FINAL:
                            return batch
                        await asyncio.sleep(0.01)
                    raise AssertionError(f"batch stuck: {batch}")
                finally:
                    for run in runs:
                        run.cancel()
                    await asyncio.wait_for(asyncio.gather(*runs, return_exceptions=True), timeout=30)
                    for worker in workers:
                        await worker.stop()

            batch = asyncio.run(scenario())
            assert batch.status == "completed" and batch.num_completed == len(prompts)
            assert executor.calls == dict.fromkeys(prompts, 1)  # none ran twice, none was left out
            assert all(worker.outcomes["completed"] > 0 for worker in workers)  # both took a share
            assert set(lines_of(stores[0], batch.output_file_id)) == set(prompts)
        finally:
            for each in stores:
                each.close()


def claim_once_freed(store: BatchStore, timeout_s: float = 10.0) -> list[RequestRecord]:
    """Claim until something comes back: a dead worker's session (and its lock) ends a moment after
    its socket closes, when the server notices."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        claimed = store.claim(5, now=2e12)
        if claimed:
            return claimed
        time.sleep(0.05)
    return []


CLAIM_THEN_HANG = """
import sys, time
from bitserve.server.batches.store import BatchStore
store = BatchStore(sys.argv[1])
print(",".join(request.custom_id for request in store.claim(2, now=2e12)), flush=True)
time.sleep(600)
"""


def test_claims_of_a_sigkilled_process_go_back_on_postgres(tmp_path: Path) -> None:
    """A real process claims two requests and is SIGKILLed: PostgreSQL ends its session, so its claim
    lock goes and a worker of another process takes the two at its next claim."""
    with fresh_database() as url:
        store = BatchStore(url)
        try:
            submit(store, jsonl(["a", "b", "c"]))
            asyncio.run(make_worker(store, ScriptedExecutor(), is_ready=False).step())
            claimer = subprocess.Popen(
                [sys.executable, "-c", CLAIM_THEN_HANG, url], stdout=subprocess.PIPE, text=True
            )
            try:
                assert claimer.stdout is not None and claimer.stdout.readline().strip() == "a,b"
                assert [request.custom_id for request in store.claim(5, now=2e12)] == ["c"]
            finally:
                claimer.kill()  # SIGKILL
                claimer.wait(timeout=30)
            assert [request.custom_id for request in claim_once_freed(store)] == ["a", "b"]
        finally:
            store.close()


def test_a_dead_workers_requests_go_to_a_live_worker_sharing_postgres() -> None:
    """A worker whose connection ends (its process was SIGKILLed) leaves requests `running`; the
    other server, still up, takes them at its next claim (its lock is gone), and the dead one's
    late result is refused."""
    with fresh_database() as url:
        dying, living = BatchStore(url), BatchStore(url)
        try:
            submit(living, jsonl(["a", "b", "c"]))
            asyncio.run(make_worker(living, ScriptedExecutor(), is_ready=False).step())
            taken = dying.claim(2, now=2e12)
            assert [request.custom_id for request in taken] == ["a", "b"]
            assert [r.custom_id for r in living.claim(5, now=2e12)] == ["c"]  # a and b are the other's
            dying.close()
            retaken = claim_once_freed(living)
            assert sorted(request.custom_id for request in retaken) == ["a", "b"]
            assert not living.finish_request(taken[0], "completed", {"custom_id": "a"}, 1)
            assert living.finish_request(retaken[0], "completed", {"custom_id": "a"}, 1)
        finally:
            living.close()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (jsonl(["a", "b", "a"]), "line 3: custom_id 'a' repeats line 1"),
        (jsonl(["a"], url="/v1/images"), "line 1: url '/v1/images' is not a batch endpoint"),
        (
            b'{"custom_id": "a", "method": "GET", "url": "/v1/completions", "body": {}}',
            "line 1: method must be POST",
        ),
        (jsonl(["a"]) + b"{not json\n", "line 2: the request body is not valid JSON"),
        (jsonl(["a"]).replace(b'"max_tokens": 4', b'"max_tokens": -4'), "line 1: max_tokens"),
        (jsonl(["a"]).replace(b'"max_tokens": 4', b'"stream": true'), "line 1: stream is not supported"),
        (jsonl([str(index) for index in range(101)]), "more than 100 requests"),
        (b"\n\n", "the file has no requests"),
    ],
)
def test_upload_validation_names_the_line(content: bytes, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message.replace("(", r"\(")):
        parse_input_file(content, BODY_MODELS, LIMITS)


def test_upload_size_caps() -> None:
    with pytest.raises(PayloadTooLarge, match="more than the limit"):
        parse_input_file(jsonl(["a"]), BODY_MODELS, InputLimits(10, 100, 4096))
    with pytest.raises(PayloadTooLarge, match="line 1"):
        parse_input_file(jsonl(["a"]), BODY_MODELS, InputLimits(1 << 20, 100, 20))


def test_the_executor_runs_the_route_handler_in_process_at_low_priority() -> None:
    seen: dict[str, Any] = {}

    async def handler(request: Request) -> JSONResponse:
        seen.update(json.loads(await request.body()))
        return JSONResponse({"object": "text_completion"})

    async def shed(request: Request) -> JSONResponse:
        raise QueueFull("the queue is full", retry_after_s=3.0)

    endpoints = {URL: Endpoint(handler, CompletionRequest), "/shed": Endpoint(shed, CompletionRequest)}
    executor = InProcessExecutor(FastAPI(), endpoints)
    outcome = asyncio.run(executor(URL, {"prompt": "x", "priority": "high"}))
    assert seen == {"prompt": "x", "priority": "low"}  # batch work is always shed first
    assert (outcome.status_code, outcome.body) == (200, {"object": "text_completion"})
    shed_outcome = asyncio.run(executor("/shed", {"prompt": "x"}))
    assert shed_outcome.status_code == 429 and shed_outcome.retry_after_s == 3.0
    assert shed_outcome.body["error"]["code"] == "queue_full"
