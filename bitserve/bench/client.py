"""The bench's own async HTTP client for any OpenAI-compatible server: streams one request and times it.

Talks to loopback addresses only unless told otherwise; never follows redirects or environment proxies.

aiohttp, not httpx: at 100 streams of a GPU server (~14,000 chunks/s) a client that spends longer on a
chunk than the server does reports its own lag as the server's latency. Measured on a 2-vCPU machine
(benchmarks/RESULTS.md, 2026-11-29): httpx's streaming read cost ~130 µs of client CPU a chunk (anyio
cancel scopes and a pause/resume of the socket's reader per read), aiohttp ~50 µs. vLLM's serving
benchmark streams with aiohttp for the same reason.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from bitserve.bench.sse import SSEEvent, SSEParser
from bitserve.errors import BitserveError, InvalidRequest

logger = logging.getLogger(__name__)

ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
MAX_ERROR_DETAIL_BYTES = 2048  # of an error response's body, kept to explain the first error of a kind


def check_url(url: str, *, allow_remote: bool) -> str:
    """The URL without a trailing slash; refuses non-HTTP schemes and, unless allowed, non-loopback hosts.

    Host names are not resolved: only `localhost` (and `*.localhost`) and literal loopback addresses
    pass, so a name that happens to resolve elsewhere cannot receive load by accident.
    """
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidRequest(f"--url must be an http(s) URL with a host, got {url!r}", param="url")
    if not allow_remote and not is_loopback_host(parts.hostname):
        raise InvalidRequest(
            f"{parts.hostname!r} is not a loopback address; the bench sends load only to this machine",
            param="url",
            hint="pass --allow-remote to load a server you are responsible for",
        )
    return url.rstrip("/")


def is_loopback_host(host: str) -> bool:
    name = host.lower().rstrip(".")
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def build_body(
    endpoint: str,
    model: str,
    prompt: str,
    *,
    max_tokens: int,
    temperature: float,
    ignore_eos: bool,
    include_usage: bool,
) -> dict[str, Any]:
    """The JSON body of one streaming request; `ignore_eos` is a vLLM / llama.cpp extension field."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "stream": True,
    }
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    if ignore_eos:
        body["ignore_eos"] = True
    return body


@dataclass(slots=True)
class RequestResult:
    """One streamed request as the client saw it. Times are seconds from the request's start."""

    start: float  # time.perf_counter() when the request was sent
    e2e_s: float = 0.0
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # gaps between successive content chunks
    num_chunks: int = 0  # chunks carrying non-empty content
    num_usage_tokens: int | None = None  # completion_tokens from the usage chunk, when sent
    num_prompt_tokens: int | None = None
    # http_<status> | timeout | connect_error | truncated | stream_error | bad_payload
    error_kind: str | None = None
    error_detail: str | None = None
    is_done: bool = False  # saw `data: [DONE]`
    last_chunk_at: float | None = None

    @property
    def is_ok(self) -> bool:
        return self.error_kind is None

    @property
    def num_output_tokens(self) -> int:
        """completion_tokens from usage when the server sent it; else the content-chunk count."""
        return self.num_usage_tokens if self.num_usage_tokens is not None else self.num_chunks

    @property
    def is_usage_counted(self) -> bool:
        return self.num_usage_tokens is not None

    def fail(self, kind: str, detail: str | None = None) -> None:
        if self.error_kind is None:  # the first failure explains the request
            self.error_kind, self.error_detail = kind, detail


class OpenAIClient:
    """Streams requests to one OpenAI-compatible server over a pooled aiohttp session."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float,
        max_connections: int,
        api_key: str | None = None,
        allow_remote: bool = False,
    ) -> None:
        self.url = check_url(url, allow_remote=allow_remote)
        self.timeout_s = timeout_s
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._max_connections = max_connections
        self._http: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> OpenAIClient:
        # made inside the running loop (aiohttp binds a session to it)
        self._http = aiohttp.ClientSession(
            headers=self._headers,
            connector=aiohttp.TCPConnector(limit=self._max_connections, limit_per_host=0),
            timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            trust_env=False,  # no proxies from the environment: load stays local
        )
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._http is not None:
            await self._http.close()

    @property
    def http(self) -> aiohttp.ClientSession:
        if self._http is None:
            raise RuntimeError("OpenAIClient is used outside `async with`")
        return self._http

    async def list_models(self) -> list[str]:
        """Model ids from GET /v1/models, in the server's order."""
        try:
            async with self.http.get(f"{self.url}/v1/models", allow_redirects=False) as response:
                response.raise_for_status()
                payload = await response.json(content_type=None)
            return [str(entry["id"]) for entry in payload.get("data", [])]
        except (
            aiohttp.ClientError,
            asyncio.TimeoutError,
            ValueError,
            KeyError,
            TypeError,
            AttributeError,
        ) as exc:
            raise BitserveError(
                f"could not list models at {self.url}/v1/models: {type(exc).__name__}: {exc}",
                hint="check that the server is up, or pass --model",
            ) from exc

    async def stream(self, endpoint: str, body: dict[str, Any]) -> RequestResult:
        """Send one streaming request and time it; failures are recorded in the result, never raised.

        Bounded by `timeout_s` overall (not only per read), so a trickling stream cannot hold a worker.
        """
        result = RequestResult(start=time.perf_counter())
        has_response = False

        async def run() -> None:
            nonlocal has_response
            url = self.url + ENDPOINT_PATHS[endpoint]
            async with self.http.post(url, json=body, allow_redirects=False) as response:
                has_response = True
                await self._read(response, result)

        try:
            await asyncio.wait_for(run(), self.timeout_s)
        except asyncio.TimeoutError:
            result.fail("timeout", f"no complete response within {self.timeout_s} s")
        except aiohttp.ClientError as exc:
            # after the headers, a dropped connection is a truncated stream; before, the server was
            # unreachable
            result.fail("truncated" if has_response else "connect_error", f"{type(exc).__name__}: {exc}")
        result.e2e_s = time.perf_counter() - result.start
        return result

    async def _read(self, response: aiohttp.ClientResponse, result: RequestResult) -> None:
        if response.status != 200:
            detail = b""
            async for chunk in response.content.iter_any():
                detail += chunk
                if len(detail) >= MAX_ERROR_DETAIL_BYTES:
                    break
            result.fail(f"http_{response.status}", detail[:MAX_ERROR_DETAIL_BYTES].decode("utf-8", "replace"))
            return
        parser = SSEParser()
        async for chunk in response.content.iter_any():
            now = time.perf_counter()  # every event of one network chunk arrived together
            for event in parser.feed(chunk):
                if not _handle_event(event, result, now):
                    return
        for event in parser.close():
            if not _handle_event(event, result, time.perf_counter()):
                return
        if not result.is_done:
            result.fail("truncated", "the stream ended without data: [DONE]")


def _handle_event(event: SSEEvent, result: RequestResult, now: float) -> bool:
    """Apply one SSE event to `result`; False when the stream is over ([DONE] or an error)."""
    if event.data.strip() == "[DONE]":
        result.is_done = True
        return False
    if event.event == "error":
        result.fail("stream_error", event.data[:MAX_ERROR_DETAIL_BYTES])
        return False
    try:
        payload = json.loads(event.data)
    except ValueError:
        result.fail("bad_payload", event.data[:200])
        return False
    if not isinstance(payload, dict):
        result.fail("bad_payload", event.data[:200])
        return False
    if payload.get("error") is not None:
        result.fail("stream_error", json.dumps(payload["error"])[:MAX_ERROR_DETAIL_BYTES])
        return False
    usage = payload.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        result.num_usage_tokens = usage["completion_tokens"]
        if isinstance(usage.get("prompt_tokens"), int):
            result.num_prompt_tokens = usage["prompt_tokens"]
    if any(_choice_text(choice) for choice in payload.get("choices") or []):
        if result.last_chunk_at is None:
            result.ttft_s = now - result.start
        else:
            result.itl_s.append(now - result.last_chunk_at)
        result.last_chunk_at = now
        result.num_chunks += 1
    return True


def _choice_text(choice: Any) -> str:
    """The new text of one streamed choice: `text` (completions) or `delta.content` (chat)."""
    if not isinstance(choice, dict):
        return ""
    text = choice.get("text")
    if text is None and isinstance(choice.get("delta"), dict):
        text = choice["delta"].get("content")
    return text if isinstance(text, str) else ""
