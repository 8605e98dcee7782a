"""Incremental Server-Sent Events parser (the WHATWG event-stream rules) for the bench client.

Bytes in, complete events out; knows nothing about HTTP or OpenAI payloads.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SSEEvent:
    data: str
    event: str = "message"
    id: str | None = None


class SSEParser:
    """Feed chunks of a text/event-stream body as they arrive; each call returns the events completed.

    Rules kept: lines end in CRLF, LF or CR (a CR at a chunk's end waits for a possible LF); `:` opens
    a comment; `field: value` loses one leading space; repeated `data` lines join with LF; a blank line
    dispatches the event if it has data; UTF-8 may be split anywhere; a leading BOM is dropped. An
    event left without its blank line when the stream ends is discarded, as the standard says.
    """

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._buffer = ""
        self._is_started = False
        self._data_lines: list[str] = []
        self._event_type = ""
        self._last_event_id: str | None = None

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        return self._feed_text(self._decoder.decode(chunk))

    def close(self) -> list[SSEEvent]:
        """End of stream: flush the decoder; a complete line is processed, a pending event dropped."""
        events = self._feed_text(self._decoder.decode(b"", final=True))
        if self._buffer.endswith("\r"):  # a trailing CR is a complete line after all
            events += self._process_line(self._buffer[:-1])
        self._buffer = ""
        self._data_lines, self._event_type = [], ""
        return events

    def _feed_text(self, text: str) -> list[SSEEvent]:
        if not self._is_started and text:
            self._is_started = True
            text = text.removeprefix("\ufeff")
        self._buffer += text
        events: list[SSEEvent] = []
        start = 0
        buffer = self._buffer
        while True:
            cut = _next_line_end(buffer, start)
            if cut is None:
                break
            end, next_start = cut
            events += self._process_line(buffer[start:end])
            start = next_start
        self._buffer = buffer[start:]
        return events

    def _process_line(self, line: str) -> list[SSEEvent]:
        if line == "":
            return self._dispatch()
        if line.startswith(":"):
            return []
        name, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data_lines.append(value)
        elif name == "event":
            self._event_type = value
        elif name == "id" and "\0" not in value:
            self._last_event_id = value
        # `retry` and unknown fields carry nothing the bench needs: ignored, as the standard allows
        return []

    def _dispatch(self) -> list[SSEEvent]:
        if not self._data_lines:
            self._event_type = ""
            return []
        event = SSEEvent("\n".join(self._data_lines), self._event_type or "message", self._last_event_id)
        self._data_lines, self._event_type = [], ""
        return [event]


def _next_line_end(buffer: str, start: int) -> tuple[int, int] | None:
    """(end of the line, start of the next) for the first line ending at or after `start`, or None.

    A CR as the buffer's last character is not yet a line end: the next chunk may begin with LF.
    """
    lf = buffer.find("\n", start)
    cr = buffer.find("\r", start)
    if cr != -1 and (lf == -1 or cr < lf):
        if cr + 1 == len(buffer):
            return None
        return cr, cr + 2 if buffer[cr + 1] == "\n" else cr + 1
    if lf != -1:
        return lf, lf + 1
    return None
