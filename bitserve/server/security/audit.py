"""The audit log: one JSON line per admin action, auth failure, permission denial and rate-limit
rejection, chained by SHA-256 so an edited, dropped, inserted or reordered line is detected.

Each line is a JSON object with `prev` (the previous line's `hash`; 64 zeros for the first line ever)
and `hash` = SHA-256 over `prev` and the line's other fields (sorted-key compact JSON). Rotation renames
PATH to PATH.1 (PATH.1 to PATH.2, ...) and opens the new PATH with a `rotate` line whose `prev` is the
last hash of the file before, so the chain runs on across files. `verify_chain` checks files in order
(oldest first); a lone file must start at the genesis or with a `rotate` line.

One writer per file: a process appends with O_APPEND, one write per line.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

GENESIS = "0" * 64
ROTATE_EVENT = "rotate"
MAX_ROTATED_FILES = 10_000
TAIL_BYTES = 64 * 1024  # the last line of an existing log is found in its last bytes


def line_hash(prev: str, fields: dict[str, Any]) -> str:
    body = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256((prev + "\n" + body).encode("utf-8")).hexdigest()


def _last_hash(path: Path) -> str:
    """The `hash` of the last line of an existing log (GENESIS when empty); a torn or edited last line
    raises ValueError, since continuing after it would hide the damage."""
    size = path.stat().st_size
    if size == 0:
        return GENESIS
    with path.open("rb") as file:
        file.seek(max(0, size - TAIL_BYTES))
        lines = file.read().splitlines()
    try:
        record = json.loads(lines[-1])
        fields = {key: value for key, value in record.items() if key != "hash"}
        if line_hash(record["prev"], {k: v for k, v in fields.items() if k != "prev"}) != record["hash"]:
            raise ValueError("hash mismatch")
        return str(record["hash"])
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise ValueError(
            f"the audit log {path} ends with a damaged line ({exc}); run `bitserve audit verify {path}`, "
            "keep the file as evidence and start a new log"
        ) from None


class AuditLog:
    """Appends chained lines to `path`, rotating past `max_bytes` (0: never)."""

    def __init__(self, path: str, max_bytes: int = 0) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.prev = _last_hash(self.path) if self.path.exists() else GENESIS
        self._fd = self._open()

    def _open(self) -> int:
        return os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def record(self, event: str, **fields: Any) -> None:
        """Append one line: `event` plus `fields` (time added here)."""
        entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "event": event, **fields}
        digest = line_hash(self.prev, entry)
        line = json.dumps({**entry, "prev": self.prev, "hash": digest}, ensure_ascii=False) + "\n"
        os.write(self._fd, line.encode("utf-8"))
        self.prev = digest
        if self.max_bytes and os.fstat(self._fd).st_size >= self.max_bytes and event != ROTATE_EVENT:
            self.rotate()

    def rotate(self) -> None:
        """PATH -> PATH.1 (older ones shift up), a new PATH whose first line links to the old chain."""
        os.close(self._fd)
        rotated = [self.path.with_name(f"{self.path.name}.{n}") for n in range(1, MAX_ROTATED_FILES)]
        last = next((n for n, path in enumerate(rotated) if not path.exists()), len(rotated) - 1)
        for index in range(last, 0, -1):
            os.replace(rotated[index - 1], rotated[index])
        os.replace(self.path, rotated[0])
        self._fd = self._open()
        self.record(ROTATE_EVENT, previous_file=rotated[0].name)
        logger.info("audit log rotated to %s", rotated[0])

    def close(self) -> None:
        os.close(self._fd)


@dataclass(frozen=True, slots=True)
class VerifyResult:
    num_lines: int
    error: str | None  # "FILE:LINE: what is wrong" for the first bad line


def verify_chain(paths: Iterable[str]) -> VerifyResult:
    """Check the chain through `paths` in order (oldest first)."""
    prev: str | None = None
    num_lines = 0
    for path in paths:
        try:
            lines = Path(path).read_bytes().splitlines()
        except OSError as exc:
            return VerifyResult(num_lines, f"{path}: cannot read: {exc.strerror}")
        for number, raw in enumerate(lines, start=1):
            problem, prev = _check_line(raw, prev)
            if problem is not None:
                return VerifyResult(num_lines, f"{path}:{number}: {problem}")
            num_lines += 1
    return VerifyResult(num_lines, None)


def _check_line(raw: bytes, prev: str | None) -> tuple[str | None, str | None]:
    """(problem or None, this line's hash). `prev` None: the first line of a lone file."""
    try:
        record = json.loads(raw)
        digest, line_prev = record.pop("hash"), record.pop("prev")
    except (ValueError, KeyError, TypeError, AttributeError):
        return "not a valid audit line (JSON with prev and hash)", prev
    if prev is None and line_prev != GENESIS and record.get("event") != ROTATE_EVENT:
        return "the first line neither starts the chain nor continues a rotated file (lines dropped?)", prev
    if prev is not None and line_prev != prev:
        return "prev does not match the previous line's hash (a line dropped, inserted or reordered)", prev
    if line_hash(line_prev, record) != digest:
        return "hash does not match the line's content (the line was edited)", prev
    return None, digest
