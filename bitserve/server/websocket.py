"""/v1/ws: the chat and completions streams of the HTTP API over one WebSocket, several at once, each
cancellable. Admission, validation and the chunk objects are the HTTP endpoints' own (pipeline.admit,
the pydantic bodies, ChatFormat / CompletionFormat); status codes come from errors.py.

The envelope (JSON text messages; README "WebSocket streaming"):

    client -> server
      {"type": "auth", "token": KEY}         first, when the upgrade carried no Authorization / x-api-key
      {"type": "chat.completions" | "completions", "id": ID, "body": {... the HTTP body ...}}
      {"type": "cancel", "id": ID}
    server -> client
      {"type": "chunk", "id": ID, "data": {... the SSE chunk object ...}}
      {"type": "error", "id": ID | null, "status": 429, "retry_after_s": 3, "error": {... as HTTP ...}}
      {"type": "done", "id": ID, "status": "completed" | "cancelled" | "failed"}

A request message with a new id and a known type starts a request: it ends with exactly one `done`
(after an `error` with its id when it failed). An `error` with id null answers a message that started
nothing (unreadable JSON, unknown type, a bad or duplicate id, nothing to cancel); the socket stays open.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from bitserve.errors import (
    BitserveError,
    Forbidden,
    InvalidRequest,
    PayloadTooLarge,
    RateLimited,
    Unauthenticated,
)
from bitserve.log import REQUEST_ID
from bitserve.server.body import parse_json_object, validate_request
from bitserve.server.errors import lookup, socket_error_message
from bitserve.server.pipeline import Caller, Generation, admit
from bitserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerationRequest,
    valid_request_id,
)
from bitserve.server.response_format import ResponseFormat
from bitserve.server.security.guard import RequestSecurity
from bitserve.server.security.middleware import POLICY_VIOLATION, SECURITY_STATE
from bitserve.server.security.principal import CURRENT_PRINCIPAL, NOBODY, Principal
from bitserve.server.serving_chat import ChatFormat
from bitserve.server.serving_completions import CompletionFormat
from bitserve.server.state import AppState
from bitserve.server.streaming import stream_payloads
from bitserve.server.tracing import server_span

logger = logging.getLogger(__name__)

SCOPE = "inference"  # what each request on the socket needs (routes.py gives the route the same)
NO_SOCKET_CREDENTIALS = (
    'no credentials: send `Authorization: Bearer KEY` with the upgrade, or {"type": "auth", "token": KEY} '
    "as the first message"
)
BUSY_RETRY_AFTER_S = 1.0  # a socket at its request limit: one of its own requests ends soon


@dataclass(frozen=True, slots=True)
class Endpoint:
    """What a request type runs: the HTTP endpoint's body model, id prefix and chunk format."""

    body_cls: type[GenerationRequest]
    id_prefix: str
    response_format: Callable[[Generation], ResponseFormat]


ENDPOINTS = {
    "chat.completions": Endpoint(ChatCompletionRequest, "chatcmpl", ChatFormat),
    "completions": Endpoint(CompletionRequest, "cmpl", CompletionFormat),
}


async def serve_socket(websocket: WebSocket) -> None:
    """/v1/ws (SecurityMiddleware checked the upgrade)."""
    state: AppState = websocket.app.state.bitserve
    security: RequestSecurity | None = websocket.scope.get("state", {}).get(SECURITY_STATE)
    await SocketSession(websocket, state, security).run()


def _message_bytes(message: dict[str, Any]) -> bytes:
    text = message.get("text")
    return text.encode("utf-8", "surrogatepass") if text is not None else message.get("bytes") or b""


class SocketSession:
    """One connection: its principal, its requests in flight (one task each), one writer at a time."""

    def __init__(self, websocket: WebSocket, state: AppState, security: RequestSecurity | None) -> None:
        self.websocket = websocket
        self.state = state
        self.security = security
        self.socket_id: str = websocket.scope.get("state", {}).get("request_id") or uuid.uuid4().hex
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.cancelled: set[str] = set()  # ids the client cancelled (their tasks end with "cancelled")
        self._send_lock = asyncio.Lock()

    async def run(self) -> None:
        await self.websocket.accept()
        try:
            if self._needs_token() and not await self._authenticate():
                if self.websocket.client_state == WebSocketState.CONNECTED:
                    await self.websocket.close(POLICY_VIOLATION)
                return
            while True:
                message = await self.websocket.receive()
                if message["type"] == "websocket.disconnect":
                    return
                await self._dispatch(_message_bytes(message))
        finally:
            await self._cancel_all()

    # ----------------------------------------------------------------- who

    def _needs_token(self) -> bool:
        return (
            self.security is not None and self.security.guard.has_auth and self.security.principal is NOBODY
        )

    async def _authenticate(self) -> bool:
        """The first message must be {"type": "auth", "token": KEY}, within body_read_timeout_s."""
        assert self.security is not None
        guard = self.security.guard
        try:
            message = await asyncio.wait_for(
                self.websocket.receive(), self.state.server_config.body_read_timeout_s
            )
        except TimeoutError:
            message = {"type": "websocket.receive", "text": "{}"}
        if message["type"] == "websocket.disconnect":
            return False
        try:
            data = parse_json_object(_message_bytes(message))
            if data.get("type") != "auth" or not isinstance(data.get("token"), str):
                raise Unauthenticated(NO_SOCKET_CREDENTIALS)
            principal = guard.verify_credential(data["token"])
            if not principal.has_scope(SCOPE):
                raise Forbidden(f"this credential lacks the {SCOPE!r} scope", hint=f"use a key with {SCOPE}")
        except (InvalidRequest, Unauthenticated, Forbidden) as exc:
            logger.warning("refused a WebSocket from %s: %s", self.security.client, exc.message)
            self._audit_refusal(exc)
            await self._send_error(exc, None)
            return False
        self.security = RequestSecurity(guard, principal, self.security.client)
        return True

    def _audit_refusal(self, exc: BitserveError) -> None:
        """The audit log's line for a token refused in the first message (the middleware audits the
        refusals it makes at the upgrade)."""
        assert self.security is not None
        audit = self.security.guard.audit
        if audit is None:
            return
        event = "permission_denied" if isinstance(exc, Forbidden) else "auth_failure"
        try:
            audit.record(
                event,
                request_id=self.socket_id,
                principal=None,
                source=self.security.client,
                route="/v1/ws",
                outcome=lookup(exc).status,
                reason=exc.message,
            )
        except OSError:
            logger.exception("could not write the audit log")

    # ----------------------------------------------------------------- messages

    async def _dispatch(self, raw: bytes) -> None:
        """One client message: start a request, cancel one, or answer an error (the socket stays)."""
        try:
            if len(raw) > self.state.server_config.ws_max_message_bytes:
                raise PayloadTooLarge(
                    f"the message is larger than {self.state.server_config.ws_max_message_bytes} bytes"
                )
            data = parse_json_object(raw)
            kind = data.get("type")
            request_id = _request_id(data.get("id"))
            if kind == "cancel":
                self._cancel(request_id)
                return
            endpoint = ENDPOINTS.get(kind) if isinstance(kind, str) else None
            if endpoint is None:
                known = ", ".join(["cancel", *ENDPOINTS])
                raise InvalidRequest(f"unknown message type {str(kind)[:64]!r}; known: {known}", param="type")
            if request_id in self.tasks:
                raise InvalidRequest(
                    f"request {request_id!r} is already in flight on this socket", param="id"
                )
        except BitserveError as exc:
            await self._send_error(exc, None)
            return
        if len(self.tasks) >= self.state.server_config.ws_max_requests:
            busy = RateLimited(
                f"{len(self.tasks)} requests are in flight on this socket, its limit",
                retry_after_s=BUSY_RETRY_AFTER_S,
                hint="wait for a done message, or open another socket",
            )
            await self._send_error(busy, request_id)
            await self._send({"type": "done", "id": request_id, "status": "failed"})
            return
        task = asyncio.create_task(self._serve_request(request_id, kind, endpoint, data.get("body")))
        self.tasks[request_id] = task

    def _cancel(self, request_id: str) -> None:
        """Cancel a request in flight: its task ends, closing its stream (the abort an HTTP disconnect
        makes: the engine frees it before its next step), and sends done "cancelled"."""
        task = self.tasks.get(request_id)
        if task is None:
            raise InvalidRequest(f"no request {request_id!r} in flight on this socket", param="id")
        self.cancelled.add(request_id)
        task.cancel()

    async def _cancel_all(self) -> None:
        """The socket closed: abort every request still in flight."""
        tasks = list(self.tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ----------------------------------------------------------------- one request

    async def _serve_request(self, request_id: str, kind: str, endpoint: Endpoint, body: Any) -> None:
        """One request's task: its own log id and principal, its chunks, then its done message."""
        started = time.monotonic()
        REQUEST_ID.set(f"{self.socket_id}/{request_id}")  # this task's context only
        status = "failed"
        try:
            with self._span(kind, request_id):
                await self._stream(request_id, endpoint, body, started)
            status = "completed"
        except asyncio.CancelledError:
            if request_id not in self.cancelled:
                raise  # the socket closed: nobody to tell
            current = asyncio.current_task()
            if current is not None:
                current.uncancel()  # the client's cancel is handled here, not propagated
            status = "cancelled"
        except Exception as exc:  # noqa: BLE001 - one request's failure is its error message; the socket lives
            if not isinstance(exc, BitserveError):
                logger.exception("WebSocket request failed")
            await self._send_error(exc, request_id)
        finally:
            self.tasks.pop(request_id, None)
            self.cancelled.discard(request_id)
        await self._send({"type": "done", "id": request_id, "status": status})

    async def _stream(self, request_id: str, endpoint: Endpoint, body: Any, started: float) -> None:
        security = self._request_security()
        if not isinstance(body, dict):
            raise InvalidRequest(
                "`body` must be a JSON object: the HTTP endpoint's request body", param="body"
            )
        if security is not None:
            security.rate = await security.guard.limiter.admit(security.principal)
            CURRENT_PRINCIPAL.set(security.principal)  # the model checks in AppState.acquire read it
        request = validate_request({**body, "stream": True}, endpoint.body_cls)  # the socket always streams
        generation = await admit(self.state, request, endpoint.id_prefix, Caller(security), started)
        keepalive_s = self.state.server_config.sse_keepalive_s
        payloads = stream_payloads(generation.stream, keepalive_s, endpoint.response_format(generation))
        try:
            async for payload in payloads:
                if request_id in self.cancelled:
                    break  # a cancel that landed without interrupting an await (see SSEResponse)
                if payload is not None:
                    await self._send({"type": "chunk", "id": request_id, "data": payload})
        finally:
            await payloads.aclose()  # closes the stream: an abort unless it finished
        if request_id in self.cancelled:
            raise asyncio.CancelledError

    def _request_security(self) -> RequestSecurity | None:
        """A fresh per-request view of the socket's principal (its own rate state), scope checked."""
        if self.security is None:
            return None
        principal: Principal = self.security.principal
        if not principal.has_scope(SCOPE):
            raise Forbidden(f"this credential lacks the {SCOPE!r} scope", hint=f"use a key with {SCOPE}")
        return RequestSecurity(self.security.guard, principal, self.security.client)

    @contextlib.contextmanager
    def _span(self, kind: str, request_id: str) -> Iterator[None]:
        """The request's SERVER span when tracing is on (its generation spans are children)."""
        if self.state.tracer is None:
            yield
            return
        attributes = {"url.path": "/v1/ws", "bitserve.request_id": f"{self.socket_id}/{request_id}"}
        with server_span(self.state.tracer, f"WS /v1/ws {kind}", attributes):
            yield

    # ----------------------------------------------------------------- writing

    async def _send_error(self, exc: BaseException, request_id: str | None) -> None:
        message = socket_error_message(exc, request_id)
        self.state.stats.record_http_error(message["status"], message["error"]["code"])
        await self._send(message)

    async def _send(self, message: dict[str, Any]) -> None:
        """One JSON text message; nothing when the client has gone (its requests are being cancelled)."""
        # allow_nan=False: a NaN would make invalid JSON; the ValueError fails that request instead.
        text = json.dumps(message, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        async with self._send_lock:
            with contextlib.suppress(WebSocketDisconnect, RuntimeError):
                await self.websocket.send_text(text)


def _request_id(value: Any) -> str:
    request_id = valid_request_id(value.encode("utf-8")) if isinstance(value, str) else None
    if request_id is None:
        raise InvalidRequest("`id` must be a string of 1..128 printable ASCII characters", param="id")
    return request_id
