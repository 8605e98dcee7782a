"""A batch survives its server being killed: `bitserve serve` is SIGKILLed mid-batch (some requests
committed, some running, some not started), started again on the same --batch-db, and the batch
resumes: every request ends exactly once in the output, and those committed before the kill are not
run again (their output lines are the ones the first process wrote). On SQLite and on PostgreSQL
(where the killed process's session, and with it its claim lock, ends with it)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import openai
import pytest
from batch_testing import chat_line, file_lines, jsonl, wait_final
from http_testing import ServerProcess
from postgres_testing import query

NUM_REQUESTS = 20
KILL_AFTER_COMPLETED = 3


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60.0)


def _committed_lines(batch_db: str) -> dict[str, str]:
    """custom_id -> output line of the requests the killed process had committed."""
    rows = query(batch_db, "SELECT custom_id, result FROM batch_requests WHERE status = 'completed'")
    return {custom_id: result for custom_id, result in rows}


# PostgreSQL's run costs two more server starts (~40 s on 2 loaded cores): `slow`; in CI, a SIGKILLed
# process's claims on PostgreSQL are tested without a model (test_batch_worker.py)
@pytest.mark.parametrize(
    "batch_db", ["sqlite", pytest.param("postgresql", marks=pytest.mark.slow)], indirect=True
)
def test_sigkill_mid_batch_then_restart_runs_every_request_once(
    tmp_path: Path, smollm2_path: Path, batch_db: str
) -> None:
    args = ("--batch-db", batch_db, "--no-warmup")
    lines = [
        chat_line(f"req-{index}", f"Name a colour, number {index}.", max_tokens=8)
        for index in range(NUM_REQUESTS)
    ]
    # two at a time, so the kill lands while some are done, some running and most not started
    first = ServerProcess(tmp_path / "first.log", *args, "--batch-concurrency", "2")
    try:
        first.wait_ready()
        with _client(first) as client:
            file_id = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch").id
            batch_id = client.batches.create(
                input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
            ).id
            deadline = time.monotonic() + 120
            while client.batches.retrieve(batch_id).request_counts.completed < KILL_AFTER_COMPLETED:
                assert time.monotonic() < deadline, first.log_tail()
                time.sleep(0.05)
        first.process.kill()  # SIGKILL: no drain, no shutdown path
        first.process.wait(timeout=30)
    finally:
        first.stop()
    before = _committed_lines(batch_db)
    assert KILL_AFTER_COMPLETED <= len(before) < NUM_REQUESTS, "the kill must land mid-batch"

    second = ServerProcess(tmp_path / "second.log", *args, "--batch-concurrency", "8")
    try:
        second.wait_ready()
        with _client(second) as client:
            batch = wait_final(client, batch_id)
            assert batch.status == "completed", batch
            assert batch.request_counts.model_dump() == {
                "total": NUM_REQUESTS,
                "completed": NUM_REQUESTS,
                "failed": 0,
            }
            assert batch.error_file_id is None
            output = file_lines(client, batch.output_file_id)  # also checks no custom_id appears twice
    finally:
        second.stop()
    assert set(output) == {line["custom_id"] for line in lines}
    for line in output.values():
        assert line["response"]["status_code"] == 200, line
        assert line["response"]["body"]["choices"][0]["message"]["content"], line
    for custom_id, committed in before.items():  # done before the kill: kept, not run again
        assert output[custom_id] == json.loads(committed)
