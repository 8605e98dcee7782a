"""The Batch API's routes (OpenAI's): `POST /v1/files` (multipart, purpose `batch`, every line
validated at upload), `GET /v1/files/{id}`, `GET /v1/files/{id}/content`, `DELETE /v1/files/{id}`,
`GET /v1/files` (newest first by default; `purpose`, `order`, `after`, `limit`), `POST /v1/batches`,
`GET /v1/batches` (newest first; `after`, `limit`), `GET /v1/batches/{id}`,
`POST /v1/batches/{id}/cancel`. A file an open batch reads cannot be deleted (409). Files and batches
belong to the principal that created them: another caller gets 404, as for an id that does not exist."""

from __future__ import annotations

import asyncio
import time
from typing import Annotated, Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field
from starlette.datastructures import UploadFile

from bitserve.errors import InvalidRequest, NotFound
from bitserve.server.batches.input_file import parse_input_file
from bitserve.server.batches.records import FileRecord
from bitserve.server.batches.service import BatchService
from bitserve.server.batches.store import BatchStore
from bitserve.server.body import parse_request
from bitserve.server.protocol import StrictModel
from bitserve.server.security.principal import Principal, check_model_access
from bitserve.server.security.request_context import request_principal
from bitserve.server.state import get_state

BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
COMPLETION_WINDOWS_S = {"24h": 24 * 3600}  # OpenAI accepts only 24h
MAX_ID_CHARS = 128
MAX_FILENAME_CHARS = 256
MAX_METADATA_PAIRS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512
DEFAULT_LIST_LIMIT, MAX_LIST_LIMIT = 20, 100
MAX_FILE_LIST_LIMIT = 10_000  # OpenAI's files list: 1 to 10,000, default 10,000
FILE_PURPOSES = ("batch", "batch_output")
MAX_FORM_FIELDS = 8
JSONL_MEDIA_TYPE = "application/jsonl"


class CreateBatchRequest(StrictModel):
    input_file_id: str = Field(..., min_length=1, max_length=MAX_ID_CHARS)
    endpoint: Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]
    completion_window: Literal["24h"]
    metadata: (
        Annotated[
            dict[
                Annotated[str, Field(max_length=MAX_METADATA_KEY_CHARS)],
                Annotated[str, Field(max_length=MAX_METADATA_VALUE_CHARS)],
            ],
            Field(max_length=MAX_METADATA_PAIRS),
        ]
        | None
    ) = None


class FileUploadForm(StrictModel):
    """The multipart form of POST /v1/files (described in /openapi.json; parsed by the handler)."""

    file: str = Field(
        ..., description="the JSONL input: one request per line", json_schema_extra={"format": "binary"}
    )
    purpose: Literal["batch"]


def _service(request: Request) -> BatchService:
    """The app's Batch API; ServiceUnavailable (503 saying why) when it is off."""
    service: BatchService = get_state(request).batches
    service.require_store()
    return service


def _store(request: Request) -> BatchStore:
    return _service(request).require_store()


def _owner(request: Request) -> Principal:
    return request_principal(request)


def _checked_id(value: str, what: str) -> str:
    if not 1 <= len(value) <= MAX_ID_CHARS:
        raise NotFound(f"no {what} {value[:MAX_ID_CHARS]!r}")
    return value


async def _owned_file(request: Request, file_id: str) -> FileRecord:
    store = _store(request)
    record = await asyncio.to_thread(store.get_file, _checked_id(file_id, "file"), _owner(request).name)
    if record is None:
        raise NotFound(f"no file {file_id!r}", param="file_id")
    return record


async def create_file(request: Request) -> Response:
    service = _service(request)
    form = await request.form(max_files=1, max_fields=MAX_FORM_FIELDS)
    upload, purpose = form.get("file"), form.get("purpose")
    if purpose != "batch":
        raise InvalidRequest(
            "purpose must be `batch`", param="purpose", hint="the Batch API's input files only"
        )
    if not isinstance(upload, UploadFile):
        raise InvalidRequest("send the JSONL as the multipart field `file`", param="file")
    content = await upload.read()
    principal = _owner(request)
    default_alias = get_state(request).models.default_alias

    def check_body(body: dict[str, Any]) -> None:
        model = body.get("model")
        check_model_access(model if isinstance(model, str) else default_alias, principal)

    await asyncio.to_thread(parse_input_file, content, service.body_models, service.limits, check_body)
    filename = (upload.filename or "batch.jsonl")[:MAX_FILENAME_CHARS]
    store = service.require_store()
    record = await asyncio.to_thread(
        store.add_file, principal.name, "batch", filename, content, int(time.time())
    )
    return JSONResponse(record.to_object())


async def get_file(request: Request, file_id: str) -> Response:
    return JSONResponse((await _owned_file(request, file_id)).to_object())


async def get_file_content(request: Request, file_id: str) -> Response:
    record = await _owned_file(request, file_id)
    content = await asyncio.to_thread(_store(request).read_file, record.id)
    return Response(content, media_type=JSONL_MEDIA_TYPE)


async def delete_file(request: Request, file_id: str) -> Response:
    record = await _owned_file(request, file_id)
    await asyncio.to_thread(_store(request).delete_file, record.id, record.owner)
    return JSONResponse({"id": record.id, "object": "file", "deleted": True})


async def create_batch(request: Request) -> Response:
    service = _service(request)
    body = parse_request(await request.body(), CreateBatchRequest)
    record = await _owned_file(request, body.input_file_id)
    if record.purpose != "batch":
        raise InvalidRequest(
            f"the file {record.id} has purpose {record.purpose}, not batch", param="input_file_id"
        )
    now = time.time()
    store = service.require_store()
    batch = await asyncio.to_thread(
        store.create_batch,
        record.owner,
        body.endpoint,
        record.id,
        body.completion_window,
        body.metadata,
        int(now),
        now + COMPLETION_WINDOWS_S[body.completion_window],
    )
    service.wake()
    return JSONResponse(batch.to_object())


async def get_batch(request: Request, batch_id: str) -> Response:
    store = _store(request)
    batch = await asyncio.to_thread(store.get_batch, _checked_id(batch_id, "batch"), _owner(request).name)
    if batch is None:
        raise NotFound(f"no batch {batch_id!r}", param="batch_id")
    return JSONResponse(batch.to_object())


def _list_limit(value: str | None, default: int = DEFAULT_LIST_LIMIT, most: int = MAX_LIST_LIMIT) -> int:
    if value is None:
        return default
    if not value.isdigit() or not 1 <= int(value) <= most:
        raise InvalidRequest(f"limit must be an integer in [1, {most}]", param="limit")
    return int(value)


def _after(request: Request, what: str) -> str | None:
    after = request.query_params.get("after")
    if after is not None and len(after) > MAX_ID_CHARS:
        raise InvalidRequest(f"after must be a {what} id of at most {MAX_ID_CHARS} characters", param="after")
    return after


def _page(data: list[dict[str, Any]], has_more: bool) -> JSONResponse:
    """OpenAI's cursor page (the openai client follows `has_more` with `after` = the last id)."""
    return JSONResponse(
        {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": has_more,
        }
    )


async def list_files(request: Request) -> Response:
    store = _store(request)
    query = request.query_params
    limit = _list_limit(query.get("limit"), default=MAX_FILE_LIST_LIMIT, most=MAX_FILE_LIST_LIMIT)
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest("order must be asc or desc", param="order")
    purpose = query.get("purpose")
    if purpose is not None and purpose not in FILE_PURPOSES:
        raise InvalidRequest(f"purpose must be one of {', '.join(FILE_PURPOSES)}", param="purpose")
    page, has_more = await asyncio.to_thread(
        store.list_files, _owner(request).name, purpose, _after(request, "file"), limit, order == "desc"
    )
    return _page([record.to_object() for record in page], has_more)


async def list_batches(request: Request) -> Response:
    store = _store(request)
    limit = _list_limit(request.query_params.get("limit"))
    page, has_more = await asyncio.to_thread(
        store.list_batches, _owner(request).name, _after(request, "batch"), limit
    )
    return _page([batch.to_object() for batch in page], has_more)


async def cancel_batch(request: Request, batch_id: str) -> Response:
    service = _service(request)
    store = service.require_store()
    owner = _owner(request).name
    batch = await asyncio.to_thread(
        store.cancel_batch, _checked_id(batch_id, "batch"), owner, int(time.time())
    )
    if batch is None:
        raise NotFound(f"no batch {batch_id!r}", param="batch_id")
    service.wake()
    return JSONResponse(batch.to_object())
