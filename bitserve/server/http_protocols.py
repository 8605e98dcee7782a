"""uvicorn's HTTP/1.1 protocols with the header limits uvicorn does not enforce, and the parser choice.

A connection that opens, or starts a request, and has not delivered complete headers within
`header_read_timeout_s` gets a 408 and is closed (slowloris). A head still arriving past
`max_header_bytes` is refused: h11 does it itself (uvicorn's `h11_max_incomplete_event_size`, a
400); httptools has no such limit, so its protocol counts the bytes of an unfinished head and
answers 431. Heads that arrive whole are measured exactly by `BodyLimitMiddleware` (431). Idle
keep-alive connections are closed by uvicorn's `timeout_keep_alive`.

`auto` picks httptools when it is installed (a dependency): the event loop parses every request and
writes every streamed token, and the served 2B row on an H100 had a lower p99 with it. The event loop
stays asyncio's by default: uvloop's socket writes hold the GIL that the engine thread needs (asyncio's
release it), and the same row got slower with it (benchmarks/RESULTS.md, "HTTP parser and event loop").
"""

from __future__ import annotations

import asyncio
import http
import importlib.util
import json
import logging
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from bitserve.errors import BitserveError
from bitserve.server.errors import HeadersTooLarge, RequestTimeout, error_payload, lookup

logger = logging.getLogger(__name__)


def raw_error_response(exc: BitserveError) -> bytes:
    """A complete raw HTTP/1.1 error response that closes the connection (written to the socket:
    the parser cannot answer a request it never finished parsing)."""
    status = lookup(exc).status
    body = json.dumps(error_payload(exc)).encode()
    head = (
        f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
        f"connection: close\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


class _HeaderDeadline:
    """The header timer both protocols share; `_awaiting_head()` says whether a head is still due."""

    header_read_timeout_s = 10.0  # both replaced per server by `http_protocol()`
    max_header_bytes = 16 * 1024
    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop
    _header_timer: asyncio.TimerHandle | None

    def _awaiting_head(self) -> bool:
        raise NotImplementedError

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.header_read_timeout_s, self._on_header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self._awaiting_head() and not self.transport.is_closing():
            logger.warning(
                "closing a connection that sent no complete request headers in %g s",
                self.header_read_timeout_s,
            )
            self._refuse(RequestTimeout("the request headers were not received in time"))

    def _refuse(self, exc: BitserveError) -> None:
        self.transport.write(raw_error_response(exc))
        self.transport.close()


class HeaderLimitsH11Protocol(_HeaderDeadline, H11Protocol):
    """uvicorn's h11 protocol with a deadline on receiving request headers (h11 caps their size)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._header_timer = None
        super().connection_made(transport)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        if self._header_timer is None and self.conn.their_state is h11.IDLE:
            self._arm_header_timer()  # a new request on a kept-alive connection
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._cancel_header_timer()  # headers are complete

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _awaiting_head(self) -> bool:
        return self.conn.their_state is h11.IDLE


def _httptools_protocol_class() -> type[Any]:
    """HeaderLimitsHttpToolsProtocol, built on first use: uvicorn's httptools module imports httptools."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class HeaderLimitsHttpToolsProtocol(_HeaderDeadline, HttpToolsProtocol):
        """uvicorn's httptools protocol with a deadline on request headers and a cap on their size."""

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            self._header_timer = None
            self._head_bytes: int | None = 0  # bytes of the head being received; None between heads
            super().connection_made(transport)
            self._arm_header_timer()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)  # the parser's callbacks below run in here
            if self._head_bytes is None or self.transport.is_closing():
                return
            # counts the whole chunk a head began in: an over-count of at most one read
            self._head_bytes += len(data)
            if self._head_bytes > self.max_header_bytes:
                logger.warning("refusing request headers still arriving past %d bytes", self.max_header_bytes)
                self._refuse(
                    HeadersTooLarge(
                        f"the request headers exceed the limit of {self.max_header_bytes} bytes",
                        hint="send fewer or shorter headers",
                    )
                )

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._head_bytes = 0
            if self._header_timer is None:
                self._arm_header_timer()  # a new request on a kept-alive connection

        def on_headers_complete(self) -> None:
            self._head_bytes = None
            self._cancel_header_timer()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)

        def _awaiting_head(self) -> bool:
            return self._head_bytes is not None

    return HeaderLimitsHttpToolsProtocol


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def resolve_http_parser(choice: str) -> str:
    """`auto` -> httptools when it is installed, else "h11"; an explicit choice as given."""
    if choice == "auto":
        return "httptools" if _installed("httptools") else "h11"
    return choice


def http_protocol(parser: str, header_read_timeout_s: float, max_header_bytes: int) -> type[Any]:
    """The protocol class for uvicorn's `http=` ("h11" or "httptools"), bound to these limits."""
    base = _httptools_protocol_class() if parser == "httptools" else HeaderLimitsH11Protocol
    return type(
        f"Bound{base.__name__}",
        (base,),
        {"header_read_timeout_s": header_read_timeout_s, "max_header_bytes": max_header_bytes},
    )
