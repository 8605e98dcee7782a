"""A batch input file (JSONL, one request a line) -> validated BatchLines, or InvalidRequest naming the
first bad line: size and line caps, strict JSON, `custom_id` unique, `method` POST, a known `url`, and
a `body` the endpoint's own request model accepts (so a batch never fails for a typo hours later)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from bitserve.errors import BitserveError, InvalidRequest, PayloadTooLarge
from bitserve.server.body import parse_json_object, validate_request
from bitserve.server.protocol import StrictModel

MAX_CUSTOM_ID_CHARS = 512
LINE_KEYS = frozenset({"custom_id", "method", "url", "body"})


@dataclass(frozen=True, slots=True)
class BatchLine:
    line: int  # 1-based line number in the file
    custom_id: str
    url: str
    body: dict[str, Any]


@dataclass(frozen=True, slots=True)
class InputLimits:
    max_file_bytes: int
    max_lines: int
    max_body_bytes: int  # one request's body, as the HTTP route would take it


def _line_error(number: int, exc: BitserveError) -> InvalidRequest:
    return InvalidRequest(f"line {number}: {exc.message}", param="file", hint=exc.hint)


def _check_envelope(data: dict[str, Any], urls: Mapping[str, Any]) -> tuple[str, str, dict[str, Any]]:
    """(custom_id, url, body) of one parsed line, or InvalidRequest saying what is wrong."""
    unknown = sorted(set(data) - LINE_KEYS)
    if unknown:
        raise InvalidRequest(f"unknown key(s) {', '.join(unknown)[:200]}; a line has {sorted(LINE_KEYS)}")
    custom_id = data.get("custom_id")
    if not isinstance(custom_id, str) or not 1 <= len(custom_id) <= MAX_CUSTOM_ID_CHARS:
        raise InvalidRequest(f"custom_id must be a string of 1 to {MAX_CUSTOM_ID_CHARS} characters")
    if data.get("method") != "POST":
        raise InvalidRequest("method must be POST")
    url = data.get("url")
    if url not in urls:
        shown = url[:100] if isinstance(url, str) else type(url).__name__
        raise InvalidRequest(f"url {shown!r} is not a batch endpoint; one of {', '.join(sorted(urls))}")
    body = data.get("body")
    if not isinstance(body, dict):
        raise InvalidRequest("body must be a JSON object")
    if body.get("stream"):
        raise InvalidRequest("stream is not supported in a batch", hint="drop `stream` from the body")
    return custom_id, url, body


def parse_input_file(
    content: bytes,
    body_models: Mapping[str, type[StrictModel]],
    limits: InputLimits,
    check_body: Callable[[dict[str, Any]], None] | None = None,
) -> list[BatchLine]:
    """Every request of `content`, validated. `body_models`: batch url -> the request model its route
    parses; `check_body` may refuse a body for the caller (a model its key may not use: Forbidden)."""
    if len(content) > limits.max_file_bytes:
        raise PayloadTooLarge(
            f"the file has {len(content)} bytes, more than the limit of {limits.max_file_bytes}",
            hint="split it into several batches",
        )
    lines: list[BatchLine] = []
    first_line_of: dict[str, int] = {}
    for number, raw in enumerate(content.split(b"\n"), start=1):
        if not raw.strip():
            continue  # blank lines (a trailing newline) carry no request
        if len(lines) == limits.max_lines:
            raise InvalidRequest(
                f"the file has more than {limits.max_lines} requests", param="file", hint="split it"
            )
        try:
            if len(raw) > limits.max_body_bytes:
                raise PayloadTooLarge(f"the line has {len(raw)} bytes, more than {limits.max_body_bytes}")
            custom_id, url, body = _check_envelope(parse_json_object(raw), body_models)
            if custom_id in first_line_of:
                raise InvalidRequest(
                    f"custom_id {custom_id[:100]!r} repeats line {first_line_of[custom_id]}",
                    hint="give every request its own custom_id",
                )
            validate_request(body, body_models[url])
            if check_body is not None:
                check_body(body)
        except InvalidRequest as exc:
            raise _line_error(number, exc) from None
        except BitserveError as exc:
            exc.message = f"line {number}: {exc.message}"
            raise
        first_line_of[custom_id] = number
        lines.append(BatchLine(number, custom_id, url, body))
    if not lines:
        raise InvalidRequest("the file has no requests", param="file", hint="one JSON request per line")
    return lines
