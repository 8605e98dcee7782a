"""The lines of a batch's output and error files (OpenAI's shape):
`{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`. A request that
succeeded goes to the output file; one that failed for good (a 4xx, or retries used up) to the error
file with the response it got; one its batch stopped before it ran (expired, cancelled) to the error
file with `response: null` and `error.code` batch_expired / batch_cancelled."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bitserve.server.batches.records import RequestRecord

UNFINISHED_CODES = {"expired": "batch_expired", "cancelled": "batch_cancelled"}


@dataclass(frozen=True, slots=True)
class LineUsage:
    """What one finished request adds to its batch's `model` and `usage`."""

    model: str | None = None
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    reasoning_tokens: int = 0


def _count(container: Any, *keys: str) -> int:
    """container[keys[0]][keys[1]]...: a non-negative int, or 0 where the path is missing."""
    for key in keys:
        container = container.get(key) if isinstance(container, dict) else None
    return container if isinstance(container, int) and container >= 0 else 0


def usage_of(line: dict[str, Any]) -> LineUsage:
    """The model and tokens an output or error file line's response reports (chat and completions:
    prompt/completion tokens and their details; embeddings: prompt tokens); nothing for a line
    without a response body."""
    body = (line.get("response") or {}).get("body")
    if not isinstance(body, dict):
        return LineUsage()
    model = body.get("model")
    return LineUsage(
        model=model if isinstance(model, str) else None,
        input_tokens=_count(body, "usage", "prompt_tokens"),
        cached_tokens=_count(body, "usage", "prompt_tokens_details", "cached_tokens"),
        output_tokens=_count(body, "usage", "completion_tokens"),
        reasoning_tokens=_count(body, "usage", "completion_tokens_details", "reasoning_tokens"),
    )


def response_line(
    request: RequestRecord, status_code: int, request_id: str, body: dict[str, Any]
) -> dict[str, Any]:
    return {
        "id": request.id,
        "custom_id": request.custom_id,
        "response": {"status_code": status_code, "request_id": request_id, "body": body},
        "error": None,
    }


def unfinished_line(request: RequestRecord, batch_status: str) -> dict[str, Any]:
    code = UNFINISHED_CODES.get(batch_status, "batch_" + batch_status)
    return {
        "id": request.id,
        "custom_id": request.custom_id,
        "response": None,
        "error": {"code": code, "message": f"the batch was {batch_status} before this request ran"},
    }


def _jsonl(lines: list[str]) -> bytes | None:
    return ("\n".join(lines) + "\n").encode() if lines else None


def render_files(requests: Sequence[RequestRecord], batch_status: str) -> tuple[bytes | None, bytes | None]:
    """(output file, error file) contents in input-line order; None for a file with no lines."""
    output: list[str] = []
    errors: list[str] = []
    for request in requests:
        if request.status == "completed" and request.result is not None:
            output.append(request.result)
        elif request.status == "failed" and request.result is not None:
            errors.append(request.result)
        else:
            errors.append(json.dumps(unfinished_line(request, batch_status)))
    return _jsonl(output), _jsonl(errors)
