"""BatchStore: the Batch API's files, jobs and per-request results in one SQLite database (WAL), with
file contents beside it on disk. One server process per database (a lock file says so).

Exactly-once: a request's result is written in the same transaction that marks it done, and only a
request marked `running` can be finished, so a request ends once however often the process dies; at
open, `running` rows (the work of a killed process) go back to `pending`.
Methods are synchronous and thread-safe (one connection behind a lock): call them through
asyncio.to_thread from the event loop.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import sqlite3
import threading
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from bitserve.errors import Conflict
from bitserve.server.batches.input_file import BatchLine
from bitserve.server.batches.migrations import migrate
from bitserve.server.batches.records import (
    CANCELLABLE_STATUSES,
    OPEN_STATUSES,
    STATUS_TIMES,
    BatchRecord,
    FileRecord,
    RequestRecord,
    from_row,
)
from bitserve.server.batches.results import render_files

logger = logging.getLogger(__name__)

BUSY_TIMEOUT_MS = 10_000
TMP_SUFFIX = ".tmp"


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


class DatabaseInUse(RuntimeError):
    """Another process holds the batch database's lock."""


class BatchStore:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.files_dir = path.parent / f"{path.stem}-files"
        self._lock = threading.Lock()
        path.parent.mkdir(parents=True, exist_ok=True)
        self.files_dir.mkdir(exist_ok=True)
        self._lock_file = self._take_process_lock(path)
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode = WAL")
        # NORMAL in WAL: a commit survives the process being killed (the OS has the write); only a
        # power cut may lose the last commits, never corrupt the database.
        self._db.execute("PRAGMA synchronous = NORMAL")
        self._db.execute("PRAGMA foreign_keys = ON")
        self._db.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        self.schema_version = migrate(self._db)
        self._recover()

    @staticmethod
    def _take_process_lock(path: Path) -> Any:
        handle = open(path.with_name(path.name + ".lock"), "a")  # noqa: SIM115 - held until close()
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            raise DatabaseInUse(
                f"the batch database {path} is in use by another bitserve process; "
                "give each server its own --batch-db"
            ) from None
        return handle

    def close(self) -> None:
        with self._lock:
            self._db.close()
            self._lock_file.close()

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _recover(self) -> None:
        """Requests a killed process was running run again; files no row names (an upload or an
        output file whose transaction never committed) are removed."""
        with self._transaction() as db:
            num_reset = db.execute(
                "UPDATE batch_requests SET status = 'pending' WHERE status = 'running'"
            ).rowcount
            known = {row["id"] for row in db.execute("SELECT id FROM files")}
        if num_reset:
            logger.info("batch store: %d interrupted request(s) will run again", num_reset)
        for path in self.files_dir.iterdir():
            if path.name not in known:
                path.unlink(missing_ok=True)

    # ------------------------------------------------------------------ files

    def file_path(self, file_id: str) -> Path:
        return self.files_dir / file_id

    def _write_content(self, file_id: str, content: bytes) -> None:
        """Write the bytes durably under a temporary name, then rename (never a half-written file)."""
        tmp = self.files_dir / f"{file_id}{TMP_SUFFIX}"
        with open(tmp, "wb") as handle:
            handle.write(content)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, self.file_path(file_id))

    def _insert_file(
        self, db: sqlite3.Connection, owner: str, purpose: str, filename: str, content: bytes, now: int
    ) -> FileRecord:
        record = FileRecord(new_id("file-"), owner, purpose, filename, len(content), now)
        self._write_content(record.id, content)
        db.execute(
            "INSERT INTO files (id, owner, purpose, filename, num_bytes, created_at) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            (record.id, owner, purpose, filename, record.num_bytes, now),
        )
        return record

    def add_file(self, owner: str, purpose: str, filename: str, content: bytes, now: int) -> FileRecord:
        with self._transaction() as db:
            return self._insert_file(db, owner, purpose, filename, content, now)

    def get_file(self, file_id: str, owner: str) -> FileRecord | None:
        with self._lock:
            row = self._db.execute(
                "SELECT * FROM files WHERE id = ? AND owner = ?", (file_id, owner)
            ).fetchone()
        return from_row(FileRecord, row) if row is not None else None

    def read_file(self, file_id: str) -> bytes:
        return self.file_path(file_id).read_bytes()

    def delete_file(self, file_id: str, owner: str) -> bool:
        with self._transaction() as db:
            deleted = db.execute("DELETE FROM files WHERE id = ? AND owner = ?", (file_id, owner)).rowcount
        if deleted:
            self.file_path(file_id).unlink(missing_ok=True)
        return bool(deleted)

    # ------------------------------------------------------------------ batches

    def create_batch(
        self,
        owner: str,
        endpoint: str,
        input_file_id: str,
        completion_window: str,
        metadata: dict[str, str] | None,
        now: int,
        expires_at: float,
    ) -> BatchRecord:
        batch_id = new_id("batch_")
        with self._transaction() as db:
            db.execute(
                "INSERT INTO batches (id, owner, endpoint, input_file_id, completion_window, status, "
                "metadata, created_at, expires_at) VALUES (?, ?, ?, ?, ?, 'validating', ?, ?, ?)",
                (
                    batch_id,
                    owner,
                    endpoint,
                    input_file_id,
                    completion_window,
                    json.dumps(metadata) if metadata else None,
                    now,
                    expires_at,
                ),
            )
        batch = self.get_batch(batch_id)
        assert batch is not None
        return batch

    def get_batch(self, batch_id: str, owner: str | None = None) -> BatchRecord | None:
        query, args = "SELECT * FROM batches WHERE id = ?", [batch_id]
        if owner is not None:
            query, args = query + " AND owner = ?", [batch_id, owner]
        with self._lock:
            row = self._db.execute(query, args).fetchone()
        return from_row(BatchRecord, row) if row is not None else None

    def list_batches(self, owner: str, after: str | None, limit: int) -> tuple[list[BatchRecord], bool]:
        """The owner's batches, newest first, after the batch `after`; (page, has_more)."""
        query = "SELECT * FROM batches WHERE owner = ?"
        args: list[Any] = [owner]
        if after is not None:
            query += " AND seq < coalesce((SELECT seq FROM batches WHERE id = ? AND owner = ?), -1)"
            args += [after, owner]
        with self._lock:
            rows = self._db.execute(query + " ORDER BY seq DESC LIMIT ?", [*args, limit + 1]).fetchall()
        return [from_row(BatchRecord, row) for row in rows[:limit]], len(rows) > limit

    def open_batches(self) -> list[BatchRecord]:
        marks = ", ".join("?" * len(OPEN_STATUSES))
        with self._lock:
            rows = self._db.execute(
                f"SELECT * FROM batches WHERE status IN ({marks}) ORDER BY seq", OPEN_STATUSES
            ).fetchall()
        return [from_row(BatchRecord, row) for row in rows]

    def _set_status(
        self, db: sqlite3.Connection, batch_id: str, status: str, now: int, **columns: Any
    ) -> None:
        columns[STATUS_TIMES[status]] = now
        assignments = ", ".join(f"{name} = ?" for name in columns)
        db.execute(
            f"UPDATE batches SET status = ?, {assignments} WHERE id = ?",
            (status, *columns.values(), batch_id),
        )

    def cancel_batch(self, batch_id: str, owner: str, now: int) -> BatchRecord | None:
        """Move an open batch to `cancelling` (the worker stops it and writes what finished); None when
        the owner has no such batch, Conflict when it has already ended."""
        batch = self.get_batch(batch_id, owner)
        if batch is None:
            return None
        if batch.status in CANCELLABLE_STATUSES:
            with self._transaction() as db:
                marks = ", ".join("?" * len(CANCELLABLE_STATUSES))
                moved = db.execute(
                    f"UPDATE batches SET status = 'cancelling', cancelling_at = ? "
                    f"WHERE id = ? AND status IN ({marks})",
                    (now, batch_id, *CANCELLABLE_STATUSES),
                ).rowcount
            if moved:
                return self.get_batch(batch_id)
            batch = self.get_batch(batch_id)
            assert batch is not None
        if batch.status in ("cancelling", "cancelled"):
            return batch
        raise Conflict(
            f"the batch is {batch.status}; only a validating or in_progress batch can be cancelled"
        )

    def start_batch(self, batch_id: str, lines: Sequence[BatchLine], now: int) -> bool:
        """validating -> in_progress with one pending row per request (False if it left validating)."""
        with self._transaction() as db:
            moved = db.execute(
                "UPDATE batches SET status = 'in_progress', in_progress_at = ?, num_total = ? "
                "WHERE id = ? AND status = 'validating'",
                (now, len(lines), batch_id),
            ).rowcount
            if moved:
                db.executemany(
                    "INSERT INTO batch_requests (batch_id, line, id, custom_id, url, body, status) "
                    "VALUES (?, ?, ?, ?, ?, ?, 'pending')",
                    [
                        (
                            batch_id,
                            line.line,
                            new_id("batch_req_"),
                            line.custom_id,
                            line.url,
                            json.dumps(line.body),
                        )
                        for line in lines
                    ],
                )
        return bool(moved)

    def fail_batch(self, batch_id: str, errors: list[dict[str, Any]], now: int) -> None:
        with self._transaction() as db:
            self._set_status(db, batch_id, "failed", now, errors=json.dumps(errors))

    def mark_finalizing(self, batch_id: str, now: int) -> None:
        with self._transaction() as db:
            self._set_status(db, batch_id, "finalizing", now)

    # ------------------------------------------------------------------ requests

    def claim(self, limit: int, now: float) -> list[RequestRecord]:
        """Up to `limit` pending requests due by `now`, oldest batch first, marked running."""
        with self._transaction() as db:
            rows = db.execute(
                "SELECT r.* FROM batch_requests r JOIN batches b ON b.id = r.batch_id "
                "WHERE b.status = 'in_progress' AND r.status = 'pending' AND r.next_attempt_at <= ? "
                "ORDER BY b.seq, r.line LIMIT ?",
                (now, limit),
            ).fetchall()
            db.executemany(
                "UPDATE batch_requests SET status = 'running' WHERE batch_id = ? AND line = ?",
                [(row["batch_id"], row["line"]) for row in rows],
            )
        return [from_row(RequestRecord, row) for row in rows]

    def finish_request(
        self, request: RequestRecord, status: str, result: dict[str, Any], attempts: int
    ) -> bool:
        """Commit a request's result with its final status (completed or failed), and count it, in one
        transaction; False when it was no longer running (its batch was stopped meanwhile)."""
        column = {"completed": "num_completed", "failed": "num_failed"}[status]
        with self._transaction() as db:
            updated = db.execute(
                "UPDATE batch_requests SET status = ?, result = ?, attempts = ? "
                "WHERE batch_id = ? AND line = ? AND status = 'running'",
                (status, json.dumps(result), attempts, request.batch_id, request.line),
            ).rowcount
            if updated:
                db.execute(f"UPDATE batches SET {column} = {column} + 1 WHERE id = ?", (request.batch_id,))
        return bool(updated)

    def retry_request(self, request: RequestRecord, attempts: int, next_attempt_at: float) -> None:
        with self._transaction() as db:
            db.execute(
                "UPDATE batch_requests SET status = 'pending', attempts = ?, next_attempt_at = ? "
                "WHERE batch_id = ? AND line = ? AND status = 'running'",
                (attempts, next_attempt_at, request.batch_id, request.line),
            )

    def finalize(self, batch: BatchRecord, status: str, now: int) -> None:
        """One transaction: the output and error files from the requests' committed results (read in
        it, so a result committed a moment before is in them and none can land after), the unfinished
        requests marked with the final status (expired / cancelled), and the batch's final status."""
        with self._transaction() as db:
            rows = db.execute("SELECT * FROM batch_requests WHERE batch_id = ? ORDER BY line", (batch.id,))
            requests = [from_row(RequestRecord, row) for row in rows.fetchall()]
            contents = render_files(requests, status)
            file_ids = [
                self._insert_file(
                    db, batch.owner, "batch_output", f"{batch.id}_{kind}.jsonl", content, now
                ).id
                if content is not None
                else None
                for kind, content in zip(("output", "error"), contents, strict=True)
            ]
            db.execute(
                "UPDATE batch_requests SET status = ? "
                "WHERE batch_id = ? AND status IN ('pending', 'running')",
                (status, batch.id),
            )
            self._set_status(db, batch.id, status, now, output_file_id=file_ids[0], error_file_id=file_ids[1])
