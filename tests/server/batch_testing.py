"""Helpers for the Batch API tests: JSONL input files and waiting on a batch with the openai client."""

from __future__ import annotations

import json
import time
from typing import Any

import openai

MODEL = "smollm2-135m-instruct"
FINAL_STATUSES = ("completed", "failed", "expired", "cancelled")


def chat_line(custom_id: str, content: str, max_tokens: int = 6) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": MODEL,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "temperature": 0,
        },
    }


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def wait_final(client: openai.OpenAI, batch_id: str, timeout_s: float = 180.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in FINAL_STATUSES:
            return batch
        time.sleep(0.2)
    raise AssertionError(f"batch {batch_id} not finished in {timeout_s} s: {batch}")


def file_lines(client: openai.OpenAI, file_id: str | None) -> dict[str, dict[str, Any]]:
    """custom_id -> line of an output or error file, checking no custom_id appears twice."""
    if file_id is None:
        return {}
    records = [json.loads(line) for line in client.files.content(file_id).text.splitlines()]
    by_id = {record["custom_id"]: record for record in records}
    assert len(by_id) == len(records), "a custom_id appears twice"
    return by_id
