"""Client (blocking) and AsyncClient (asyncio): a bitserve server at `url` (its root, e.g.
http://127.0.0.1:8000) with the methods of api.py. `api_key` is sent as a bearer token (admin calls
need the models:admin scope; stats and metrics the metrics scope). Inference is the `openai` SDK's
job: point it at `url + "/v1"`."""

from __future__ import annotations

import asyncio
import time
from typing import Any, TypeVar

import httpx

from bitserve.client.api import ClientMethods, Pause, Steps
from bitserve.client.calls import Call
from bitserve.client.errors import APIConnectionError

T = TypeVar("T")
DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_TIMEOUT_S = 30.0
DEFAULT_POLL_S = 0.5


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def connection_error(url: str, exc: httpx.TransportError) -> APIConnectionError:
    return APIConnectionError(
        f"cannot reach {url}: {exc or type(exc).__name__}", hint="is the server running?"
    )


def request_arguments(call: Call[Any]) -> dict[str, Any]:
    return {"json": call.json, "files": call.files, "data": call.data}


class Connection(ClientMethods):
    """What both clients hold: the server's URL, the poll interval, and the httpx client."""

    http_class: type[httpx.Client] | type[httpx.AsyncClient]

    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        api_key: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        poll_s: float = DEFAULT_POLL_S,
        http_client: httpx.Client | httpx.AsyncClient | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.poll_s = poll_s
        self._http: Any = http_client or self.http_class(
            base_url=self.url, timeout=timeout_s, headers=auth_headers(api_key)
        )


class Client(Connection):
    """Blocking calls (`http_client`, if given, is an httpx.Client)."""

    http_class = httpx.Client

    def _drive(self, steps: Steps[T]) -> T:
        answer: Any = None
        try:
            while True:
                step = steps.send(answer)
                if isinstance(step, Pause):
                    time.sleep(step.seconds)
                    answer = None
                else:
                    answer = self._send(step)
        except StopIteration as finished:
            return finished.value  # type: ignore[no-any-return]

    def _send(self, call: Call[T]) -> T:
        try:
            response = self._http.request(call.method, call.path, **request_arguments(call))
        except httpx.TransportError as exc:
            raise connection_error(self.url, exc) from exc
        return call.result(response)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class AsyncClient(Connection):
    """The same calls as coroutines (`http_client`, if given, is an httpx.AsyncClient)."""

    http_class = httpx.AsyncClient

    async def _drive(self, steps: Steps[T]) -> T:  # type: ignore[override]
        answer: Any = None
        try:
            while True:
                step = steps.send(answer)
                if isinstance(step, Pause):
                    await asyncio.sleep(step.seconds)
                    answer = None
                else:
                    answer = await self._send(step)
        except StopIteration as finished:
            return finished.value  # type: ignore[no-any-return]

    async def _send(self, call: Call[T]) -> T:
        try:
            response = await self._http.request(call.method, call.path, **request_arguments(call))
        except httpx.TransportError as exc:
            raise connection_error(self.url, exc) from exc
        return call.result(response)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
