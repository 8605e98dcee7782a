"""`--http2`: the same ASGI app under hypercorn, HTTP/1.1 and HTTP/2 on one port.

In plain text hypercorn serves HTTP/1.1 and h2c: with prior knowledge (the client opens with HTTP/2's
preface) or by `Upgrade: h2c`. With `--ssl-certfile` the TLS handshake picks h2 or http/1.1 by ALPN.
WebSocket (/v1/ws) runs over HTTP/1.1 as under uvicorn.

SIGTERM / SIGINT drain as `DrainingServer` does under uvicorn (cli/serve.py): readiness fails at once,
in-flight requests get `drain_timeout_s`, then hypercorn stops accepting, waits `POST_DRAIN_GRACE_S` for
connections to finish and runs the lifespan's shutdown (the engines stop); a second signal skips the wait.

The limits, mapped to hypercorn's Config:
- `max_header_bytes`: h11's incomplete-head cap (a head still arriving past it gets an empty 431 and a
  close) and
  HTTP/2's SETTINGS_MAX_HEADER_LIST_SIZE; heads that arrive whole are measured by BodyLimitMiddleware (431),
  as are body size and the body deadline, whatever the server.
- `header_read_timeout_s` has no hypercorn counterpart: its idle timer runs from the connection's start (or
  the last response) until a request's head is complete, so a head that trickles in is cut off at
  `keep_alive_timeout_s` instead. hypercorn's `read_timeout` is per read and would also end a long SSE
  stream whose client sends nothing, so it stays off.
- `keep_alive_timeout_s` -> keep_alive_timeout; `ws_max_message_bytes` -> websocket_max_message_size.
- hypercorn's own HTTP/2 limits stay at their defaults: 100 concurrent streams a connection, and a
  connection closed after 1,000 requests (its guard against HTTP/2 rapid reset; clients reconnect).

hypercorn's HTTP/2 protocol is replaced by `GuardedH2Protocol` (below), which fixes one crash of 0.18.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import TYPE_CHECKING, Any

import h2.events
import hypercorn.protocol
from hypercorn.asyncio import serve as hypercorn_serve
from hypercorn.config import Config as HypercornConfig
from hypercorn.logging import Logger as HypercornLogger
from hypercorn.protocol.h2 import H2Protocol

from bitserve.config import ServerConfig
from bitserve.errors import InvalidRequest

if TYPE_CHECKING:
    from bitserve.server.state import AppState

logger = logging.getLogger(__name__)

ACCESS_LOGGER = "hypercorn.access"
ERROR_LOGGER = "hypercorn.error"


class GuardedH2Protocol(H2Protocol):
    """hypercorn's HTTP/2 protocol without its crash on DATA for a stream whose response has ended.

    NOTE: a response can end before its request body has all arrived: BodyLimitMiddleware's 413 from
    Content-Length, any early error. hypercorn 0.18 then looks the stream up, raises KeyError and tears
    down the connection, failing every other stream multiplexed on it (upstream pgjones/hypercorn PRs
    #312 / #334, open). Such DATA is dropped here, its bytes still acknowledged so the connection's
    flow-control window reopens; hypercorn's own branch for the stream's end already does the same."""

    async def _handle_events(self, events: list[h2.events.Event]) -> None:
        for event in events:  # one at a time: an earlier event may open or close a stream
            if isinstance(event, h2.events.DataReceived) and event.stream_id not in self.streams:
                self.connection.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                await self._flush()  # the WINDOW_UPDATE, or the client's upload stalls
                continue
            await super()._handle_events([event])


# ProtocolWrapper builds HTTP/2 connections (ALPN, h2c prior knowledge and upgrade) by this module name
hypercorn.protocol.H2Protocol = GuardedH2Protocol  # type: ignore[misc]


class AccessLogger(HypercornLogger):
    """hypercorn's logger with uvicorn's access line: `client - "METHOD /path?query HTTP/x" status`.

    NOTE: hypercorn's own atoms copy every environment variable into each access record (its `{NAME}e`
    atoms), secrets included; this line takes only what it prints."""

    async def access(self, request: Any, response: Any, request_time: float) -> None:
        if self.access_logger is None:
            return
        client = request.get("client")
        query = request.get("query_string", b"").decode("latin-1")
        self.access_logger.info(
            '%s - "%s %s%s HTTP/%s" %s',
            f"{client[0]}:{client[1]}" if client and len(client) == 2 else "-",
            request.get("method", "GET"),  # a WebSocket's scope has no method: its handshake is a GET
            request.get("path", ""),
            f"?{query}" if query else "",
            request.get("http_version", "1.1"),
            response["status"] if response is not None else "-",
        )


def hypercorn_config(config: ServerConfig, graceful_timeout_s: float) -> HypercornConfig:
    """hypercorn's Config for `config`: bind, TLS + ALPN, limits, logs (the module docstring maps them)."""
    if config.event_loop != "asyncio":
        raise InvalidRequest(
            f"--event-loop {config.event_loop} is not supported with --http2",
            param="event_loop",
            hint="leave --event-loop at asyncio (uvloop was slower beside the engine thread anyway)",
        )
    hconfig = HypercornConfig()
    host = f"[{config.host}]" if ":" in config.host else config.host
    hconfig.bind = [f"{host}:{config.port}"]
    if config.ssl_certfile is not None:
        hconfig.certfile = config.ssl_certfile
        hconfig.keyfile = config.ssl_keyfile or config.ssl_certfile
        hconfig.alpn_protocols = ["h2", "http/1.1"]
    hconfig.h11_max_incomplete_size = config.max_header_bytes
    hconfig.h2_max_header_list_size = config.max_header_bytes
    hconfig.keep_alive_timeout = config.keep_alive_timeout_s
    hconfig.websocket_max_message_size = config.ws_max_message_bytes
    hconfig.graceful_timeout = graceful_timeout_s
    hconfig.include_server_header = False  # no `Server: hypercorn`: the stack's name helps only an attacker
    hconfig.logger_class = AccessLogger
    hconfig.accesslog = logging.getLogger(ACCESS_LOGGER) if config.access_log else None
    hconfig.errorlog = logging.getLogger(ERROR_LOGGER)  # through the root handler: JSON like every line
    return hconfig


class DrainingHypercorn:
    """hypercorn serving `app` until a signal's drain ends (or `request_exit()`); `run()` blocks."""

    def __init__(self, app: Any, state: AppState, graceful_timeout_s: float) -> None:
        self.app = app
        self.state = state
        self.hconfig = hypercorn_config(state.server_config, graceful_timeout_s)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._drain_task: asyncio.Task[None] | None = None

    def run(self) -> None:
        asyncio.run(self._serve())

    def request_exit(self) -> None:
        """Stop without a drain (the model failed to load); safe from any thread."""
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._loop.add_signal_handler(sig, self._on_signal, sig)
        config = self.state.server_config
        scheme = "https (h2 or http/1.1 by ALPN)" if config.ssl_certfile else "http (HTTP/1.1 and h2c)"
        logger.info("HTTP/2 on: hypercorn serves %s on %s:%d", scheme, config.host, config.port)
        await hypercorn_serve(self.app, self.hconfig, shutdown_trigger=self._stop.wait, mode="asgi")

    def _on_signal(self, sig: int) -> None:
        assert self._stop is not None
        if self._drain_task is not None:
            logger.warning("second signal %d: exiting without waiting", sig)
            self._stop.set()
            return
        logger.info("signal %d: draining for up to %g s", sig, self.state.server_config.drain_timeout_s)
        self.state.begin_drain()  # readiness fails at once
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        assert self._stop is not None
        try:
            await self.state.drain(self.state.server_config.drain_timeout_s)
        finally:
            self._stop.set()
