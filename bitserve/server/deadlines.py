"""Per-request deadlines: the body's `timeout` (seconds, an extension field) and the
`X-Request-Timeout` header, validated here at the edge, become one `time.monotonic()` deadline that
the frontend and the engine enforce (queue or decode: the request is aborted wherever it is)."""

from __future__ import annotations

import math

from bitserve.errors import InvalidRequest

TIMEOUT_HEADER = "x-request-timeout"
MAX_REQUEST_TIMEOUT_S = 3600.0  # an hour: longer than any generation the context allows on a CPU
MAX_TIMEOUT_HEADER_CHARS = 32


def header_timeout_s(value: str | None) -> float | None:
    """The header's seconds (a positive finite number up to MAX_REQUEST_TIMEOUT_S), or None if absent."""
    if value is None:
        return None
    try:
        seconds = float(value[:MAX_TIMEOUT_HEADER_CHARS]) if len(value) <= MAX_TIMEOUT_HEADER_CHARS else None
    except ValueError:
        seconds = None
    if seconds is None or not math.isfinite(seconds) or not 0 < seconds <= MAX_REQUEST_TIMEOUT_S:
        raise InvalidRequest(
            f"X-Request-Timeout must be a number of seconds in (0, {MAX_REQUEST_TIMEOUT_S:g}]",
            param="X-Request-Timeout",
            hint="send e.g. X-Request-Timeout: 30",
        )
    return seconds


def request_deadline(started: float, body_timeout_s: float | None, header_value: str | None) -> float | None:
    """The monotonic deadline of a request that arrived at `started`: the stricter of the body's
    `timeout` and the header's; None when neither is given."""
    limits = [s for s in (body_timeout_s, header_timeout_s(header_value)) if s is not None]
    return started + min(limits) if limits else None
