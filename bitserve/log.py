"""Logging setup for the server: a JSON (or text) formatter on stderr and the request-id context
variable that stamps every record logged while a request is being handled."""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from contextvars import ContextVar

# The id of the HTTP request being handled by the current asyncio task (None outside requests).
# NOTE: a ContextVar is a per-task key, not shared mutable state: each request runs in its own task.
REQUEST_ID: ContextVar[str | None] = ContextVar("bitserve_request_id", default=None)
# The OpenTelemetry trace id (32 hex digits) of the request being handled, when tracing is on.
TRACE_ID: ContextVar[str | None] = ContextVar("bitserve_trace_id", default=None)

# LogRecord attributes that are not user "extra" fields.
_RECORD_FIELDS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {
    "message",
    "asctime",
    "request_id",
    "trace_id",
}


class RequestIdFilter(logging.Filter):
    """Adds `record.request_id` from the context (a record that already has one keeps it)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = REQUEST_ID.get()
        if getattr(record, "trace_id", None) is None:
            record.trace_id = TRACE_ID.get()
        return True


# Credentials that could reach a log line (a header dump, a client's error text): the Authorization and
# x-api-key values and any "Bearer <token>" are replaced before a record is formatted.
_SECRET_PATTERNS = (
    re.compile(r"(?i)(bearer\s+)[^\s\"',;)]+"),
    # the whole value after the header name, scheme included (Basic credentials too), up to a delimiter
    re.compile(r"(?i)((?:authorization|x-api-key)[\"']?\s*[:=,]\s*\(?\s*(?:(?-i:b)?[\"'])?)[^\"',;)\n]+"),
)
REDACTED = "[REDACTED]"


def redact(text: str) -> str:
    for pattern in _SECRET_PATTERNS:
        text = pattern.sub(lambda match: match.group(1) + REDACTED, text)
    return text


class RedactionFilter(logging.Filter):
    """Replaces credentials in a record's message (its arguments merged in first)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        redacted = redact(message)
        if redacted != message:
            record.msg, record.args = redacted, ()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, message, request_id, extras, exception."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None)
        if request_id is not None:
            entry["request_id"] = request_id
        trace_id = getattr(record, "trace_id", None)
        if trace_id is not None:
            entry["trace_id"] = trace_id
        for key, value in vars(record).items():
            if key not in _RECORD_FIELDS and not key.startswith("_") and key != "color_message":
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s")


def configure_logging(level: str = "INFO", log_format: str = "json") -> None:
    """Route every logger (uvicorn's included) through one stderr handler with the chosen format."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    handler.addFilter(RequestIdFilter())
    handler.addFilter(RedactionFilter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        uvicorn_logger = logging.getLogger(name)
        uvicorn_logger.handlers.clear()
        uvicorn_logger.propagate = True
