"""Each API call once, for the sync and the async client alike: the HTTP request it makes (`Call`)
and how its answer is read (a typed model, or the typed error). The clients only send them."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import httpx

from bitserve.client import schema
from bitserve.client.errors import (
    BatchAPIUnavailable,
    OperationFailed,
    WaitTimeout,
    error_from_response,
    is_missing_route,
)

T = TypeVar("T")
OPERATIONS_PATH = "/v1/models/operations"
BATCH_ROUTES_HINT = (
    "this server has no Batch API (/v1/files, /v1/batches); use a bitserve that serves it, or send "
    "the requests one by one"
)


@dataclass(frozen=True, slots=True)
class Call(Generic[T]):
    """One request and the reading of its answer."""

    method: str
    path: str
    read: Callable[[httpx.Response], T]
    json: Any = None
    files: Any = None
    data: Any = None
    ok_statuses: frozenset[int] = field(default_factory=frozenset)  # error statuses read as answers
    is_batch_api: bool = False  # a 404 for the route itself means no Batch API

    def result(self, response: httpx.Response) -> T:
        if response.status_code >= 400 and response.status_code not in self.ok_statuses:
            error = error_from_response(response)
            if self.is_batch_api and is_missing_route(error):
                raise BatchAPIUnavailable(response, {"error": {**error.error, "hint": BATCH_ROUTES_HINT}})
            raise error
        return self.read(response)


def _model(cls: type[T]) -> Callable[[httpx.Response], T]:
    return lambda response: cls.model_validate(response.json())  # type: ignore[attr-defined,no-any-return]


def _without_none(values: dict[str, Any]) -> dict[str, Any]:
    return {name: value for name, value in values.items() if value is not None}


# ----------------------------------------------------------------- models and operations


def list_models() -> Call[schema.ModelList]:
    return Call("GET", "/v1/models", _model(schema.ModelList))


def get_model(alias: str) -> Call[schema.Model]:
    return Call("GET", f"/v1/models/{alias}", _model(schema.Model))


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a load or swap runs: one device ("auto", "cpu", "cuda", "cuda:N") or several (replicas)."""

    device: str | None = None
    devices: Sequence[str] | None = None

    def fields(self) -> dict[str, Any]:
        return _without_none({"device": self.device, "devices": list(self.devices) if self.devices else None})


def load_model(model: str, alias: str | None, placement: Placement, validate: bool) -> Call[schema.Operation]:
    body = {"model": model, "alias": alias, "validate": validate, **placement.fields()}
    return Call("POST", "/v1/models/load", _model(schema.Operation), json=_without_none(body))


def swap_model(alias: str, model: str, placement: Placement, validate: bool) -> Call[schema.Operation]:
    body = {"model": model, "validate": validate, **placement.fields()}
    return Call("POST", f"/v1/models/{alias}/swap", _model(schema.Operation), json=body)


def alias_action(alias: str, action: str) -> Call[schema.Operation]:
    """rollback or unload."""
    return Call("POST", f"/v1/models/{alias}/{action}", _model(schema.Operation), json={})


def get_operation(operation_id: str) -> Call[schema.Operation]:
    return Call("GET", f"{OPERATIONS_PATH}/{operation_id}", _model(schema.Operation))


# ----------------------------------------------------------------- health, stats, tokenizer


def health() -> Call[schema.Health]:
    return Call("GET", "/health", _model(schema.Health))


def probe(name: str) -> Call[schema.Probe]:
    """live or ready: a failing probe answers 503 with the same body, read as an answer."""
    return Call("GET", f"/health/{name}", _model(schema.Probe), ok_statuses=frozenset({503}))


def stats() -> Call[schema.Stats]:
    return Call("GET", "/v1/stats", _model(schema.Stats))


def metrics() -> Call[str]:
    return Call("GET", "/metrics", lambda response: response.text)


def tokenize(
    prompt: str | None, messages: list[dict[str, Any]] | None, model: str | None, add_special_tokens: bool
) -> Call[schema.Tokenized]:
    body = _without_none(
        {"prompt": prompt, "messages": messages, "model": model, "add_special_tokens": add_special_tokens}
    )
    return Call("POST", "/tokenize", _model(schema.Tokenized), json=body)


def detokenize(tokens: Sequence[int], model: str | None) -> Call[schema.Detokenized]:
    return Call(
        "POST",
        "/detokenize",
        _model(schema.Detokenized),
        json=_without_none({"tokens": list(tokens), "model": model}),
    )


# ----------------------------------------------------------------- batches (OpenAI's Batch API)


def batch_jsonl(bodies: Sequence[dict[str, Any]], endpoint: str, custom_ids: Sequence[str] | None) -> bytes:
    """The batch input file: one `{custom_id, method, url, body}` line per request body."""
    ids = list(custom_ids) if custom_ids is not None else [f"request-{index}" for index in range(len(bodies))]
    if len(ids) != len(bodies) or len(set(ids)) != len(ids):
        raise ValueError("custom_ids must be unique, one per request body")
    lines = [
        json.dumps(
            {"custom_id": custom_id, "method": "POST", "url": endpoint, "body": body}, ensure_ascii=False
        )
        for custom_id, body in zip(ids, bodies, strict=True)
    ]
    return ("\n".join(lines) + "\n").encode("utf-8")


def upload_batch_file(content: bytes, filename: str = "batch.jsonl") -> Call[schema.FileObject]:
    return Call(
        "POST",
        "/v1/files",
        _model(schema.FileObject),
        files={"file": (filename, content, "application/jsonl")},
        data={"purpose": "batch"},
        is_batch_api=True,
    )


def create_batch(
    input_file_id: str, endpoint: str, completion_window: str, metadata: dict[str, str] | None
) -> Call[schema.Batch]:
    body = _without_none(
        {
            "input_file_id": input_file_id,
            "endpoint": endpoint,
            "completion_window": completion_window,
            "metadata": metadata,
        }
    )
    return Call("POST", "/v1/batches", _model(schema.Batch), json=body, is_batch_api=True)


def get_batch(batch_id: str) -> Call[schema.Batch]:
    return Call("GET", f"/v1/batches/{batch_id}", _model(schema.Batch), is_batch_api=True)


def cancel_batch(batch_id: str) -> Call[schema.Batch]:
    return Call("POST", f"/v1/batches/{batch_id}/cancel", _model(schema.Batch), is_batch_api=True)


def file_results(file_id: str) -> Call[list[schema.BatchResult]]:
    """A batch output or error file, one BatchResult per JSONL line."""

    def read(response: httpx.Response) -> list[schema.BatchResult]:
        return [
            schema.BatchResult.model_validate_json(line)
            for line in response.text.splitlines()
            if line.strip()
        ]

    return Call("GET", f"/v1/files/{file_id}/content", read, is_batch_api=True)


def result_files(batch: schema.Batch) -> list[str]:
    """The files holding a batch's answers: its output file, then its error file."""
    return [file_id for file_id in (batch.output_file_id, batch.error_file_id) if file_id]


# ----------------------------------------------------------------- waiting


class Deadline:
    """The end of a wait (None: no end); `check` raises WaitTimeout once it has passed."""

    def __init__(self, timeout_s: float | None) -> None:
        self.at = time.monotonic() + timeout_s if timeout_s is not None else None

    def check(self, what: str) -> None:
        if self.at is not None and time.monotonic() > self.at:
            raise WaitTimeout(f"{what} did not finish in time", hint="it goes on on the server; wait again")


def settled(operation: schema.Operation) -> schema.Operation:
    """A finished operation, or OperationFailed when it failed."""
    if operation.state == "failed":
        raise OperationFailed(operation)
    return operation
