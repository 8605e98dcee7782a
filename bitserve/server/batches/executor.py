"""Run one batch request through the same handler its HTTP route uses, in process: a Starlette Request
built around the stored body (no socket, no loopback), `priority` forced to `low` so admission sheds
batch work before interactive traffic. Raised errors become the status and body the HTTP error
handlers would have sent."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.types import Message

from bitserve.errors import BitserveError
from bitserve.log import REQUEST_ID
from bitserve.server.errors import error_payload, lookup

logger = logging.getLogger(__name__)

BATCH_PRIORITY = "low"
Handler = Callable[[Request], Awaitable[Response]]


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A route a batch line may name: its handler and the request model the handler parses."""

    handler: Handler
    body_model: type[Any]

    @property
    def has_priority(self) -> bool:
        return "priority" in self.body_model.model_fields


@dataclass(frozen=True, slots=True)
class Outcome:
    status_code: int
    body: dict[str, Any]
    request_id: str
    retry_after_s: float | None = None  # what a 429 said (QueueFull)


def _request(app: FastAPI, url: str, payload: bytes, request_id: str) -> Request:
    is_sent = False

    async def receive() -> Message:
        """The body once; then wait forever: a batch request has no client that could leave (the
        handler's disconnect watcher waits here until the work ends and cancels it)."""
        nonlocal is_sent
        if not is_sent:
            is_sent = True
            return {"type": "http.request", "body": payload, "more_body": False}
        await asyncio.Event().wait()
        raise AssertionError("unreachable: only cancellation ends the wait")

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": url,
        "raw_path": url.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())],
        "client": None,
        "server": None,
        "app": app,
        "state": {"request_id": request_id},
    }
    return Request(scope, receive)


class InProcessExecutor:
    """Runs batch requests through `endpoints` (url -> Endpoint, from the route table) of `app`."""

    def __init__(self, app: FastAPI, endpoints: dict[str, Endpoint]) -> None:
        self.app = app
        self.endpoints = endpoints

    async def __call__(self, url: str, body: dict[str, Any]) -> Outcome:
        endpoint = self.endpoints[url]
        request_id = uuid.uuid4().hex
        token = REQUEST_ID.set(request_id)
        if endpoint.has_priority:
            body = {**body, "priority": BATCH_PRIORITY}
        payload = json.dumps(body).encode()
        try:
            response = await endpoint.handler(_request(self.app, url, payload, request_id))
        except BitserveError as exc:
            spec = lookup(exc)
            retry_after = getattr(exc, "retry_after_s", None)
            return Outcome(spec.status, error_payload(exc, spec), request_id, retry_after)
        except Exception as exc:  # noqa: BLE001 - one request's bug must not stop its batch: a 500 like the app's
            logger.exception("batch request failed in %s", url)
            return Outcome(500, error_payload(exc), request_id)
        finally:
            REQUEST_ID.reset(token)
        return Outcome(response.status_code, json.loads(bytes(response.body)), request_id)
