"""BatchStore: the Batch API's files, jobs and per-request results, in SQLite or PostgreSQL (one
interface, database.py's backends; the SQL here is written once for both).

Exactly-once: a request's result is written in the same transaction that marks it done, and only the
worker that claimed a request (`claimed_by`, while it is `running`) can finish it, so a request ends
once however often processes die. Claims skip rows another worker is claiming (PostgreSQL: `FOR UPDATE
SKIP LOCKED`), and the requests of a dead worker go back to pending (SQLite: at open; PostgreSQL: at
any worker's next claim). Lock order, batch row then its request rows, so finalizing and finishing
never deadlock. Methods are synchronous and thread-safe: call them through asyncio.to_thread from
the event loop. Every database access goes through a circuit breaker: after N failures in a row (the
backend's `failure_errors`) calls raise CircuitOpen (503 + Retry-After) at once for a cool-down instead
of each waiting on a dead database.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from bitserve.errors import Conflict
from bitserve.server.batches.config import DatabaseLocation, database_location
from bitserve.server.batches.database import Database, Session, open_database
from bitserve.server.batches.input_file import BatchLine
from bitserve.server.batches.records import (
    CANCELLABLE_STATUSES,
    OPEN_STATUSES,
    STATUS_TIMES,
    BatchProgress,
    BatchRecord,
    FileRecord,
    RequestRecord,
    from_row,
)
from bitserve.server.batches.results import render_files, usage_of
from bitserve.server.breakers import CircuitBreaker

__all__ = ["BatchStore", "new_id"]


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


def _marks(values: Sequence[Any]) -> str:
    return ", ".join("?" * len(values))


class BatchStore:
    def __init__(self, target: DatabaseLocation | Path | str, breaker: CircuitBreaker | None = None) -> None:
        """`target`: a DatabaseLocation, a SQLite path, or a --batch-db value (path or URL); `breaker`:
        the app's batch database breaker (default: one of this store's own)."""
        if isinstance(target, Path):
            target = DatabaseLocation(path=target)
        elif isinstance(target, str):
            target = database_location(target)
        self.database: Database = open_database(target)
        self.schema_version = self.database.schema_version
        self.breaker = breaker or CircuitBreaker("batch_db")

    def close(self) -> None:
        self.database.close()

    @contextlib.contextmanager
    def _guarded(self, open_session: Callable[[], Any]) -> Iterator[Session]:
        """A session of `open_session` through the breaker: CircuitOpen without touching the database
        while it is open; the database's own failures count against it, the store's errors do not."""
        self.breaker.check()
        try:
            with open_session() as db:
                yield db
        except self.database.failure_errors:
            self.breaker.record_failure()
            raise
        self.breaker.record_success()

    def _transaction(self) -> Any:
        return self._guarded(self.database.transaction)

    def _reading(self) -> Any:
        return self._guarded(self.database.reading)

    # ------------------------------------------------------------------ files

    def _insert_file(
        self, db: Session, owner: str, purpose: str, filename: str, content: bytes, now: int
    ) -> FileRecord:
        record = FileRecord(new_id("file-"), owner, purpose, filename, len(content), now)
        db.execute(
            "INSERT INTO files (id, owner, purpose, filename, num_bytes, created_at) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            (record.id, owner, purpose, filename, record.num_bytes, now),
        )
        self.database.write_content(db, record.id, content)
        return record

    def add_file(self, owner: str, purpose: str, filename: str, content: bytes, now: int) -> FileRecord:
        with self._transaction() as db:
            return self._insert_file(db, owner, purpose, filename, content, now)

    def get_file(self, file_id: str, owner: str) -> FileRecord | None:
        with self._reading() as db:
            row = db.execute("SELECT * FROM files WHERE id = ? AND owner = ?", (file_id, owner)).fetchone()
        return from_row(FileRecord, row) if row is not None else None

    def list_files(
        self, owner: str, purpose: str | None, after: str | None, limit: int, newest_first: bool
    ) -> tuple[list[FileRecord], bool]:
        """The owner's files by (created_at, id), after the file `after`; (page, has_more)."""
        query, args = "SELECT * FROM files WHERE owner = ?", [owner]
        if purpose is not None:
            query, args = query + " AND purpose = ?", [*args, purpose]
        order = "DESC" if newest_first else "ASC"
        if after is not None:
            query += (
                f" AND (created_at, id) {'<' if newest_first else '>'} "
                "(SELECT created_at, id FROM files WHERE id = ? AND owner = ?)"
            )
            args += [after, owner]
        query += f" ORDER BY created_at {order}, id {order} LIMIT ?"
        with self._reading() as db:
            rows = db.execute(query, [*args, limit + 1]).fetchall()
        return [from_row(FileRecord, row) for row in rows[:limit]], len(rows) > limit

    def read_file(self, file_id: str) -> bytes:
        with self._guarded(contextlib.nullcontext):
            return self.database.read_content(file_id)

    def delete_file(self, file_id: str, owner: str) -> bool:
        """Delete the owner's file; False when there is none, Conflict while an open batch reads it."""
        with self._transaction() as db:
            user = db.execute(
                "SELECT id, status FROM batches WHERE input_file_id = ? AND owner = ? "
                f"AND status IN ({_marks(OPEN_STATUSES)})",
                (file_id, owner, *OPEN_STATUSES),
            ).fetchone()
            if user is not None:
                raise Conflict(
                    f"the file {file_id} is the input of batch {user['id']}, which is {user['status']}",
                    hint="wait for the batch to end, or cancel it first",
                )
            deleted = db.execute("DELETE FROM files WHERE id = ? AND owner = ?", (file_id, owner)).rowcount
        if deleted:
            self.database.drop_content(file_id)
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
        with self._reading() as db:
            row = db.execute(query, args).fetchone()
        return from_row(BatchRecord, row) if row is not None else None

    def list_batches(self, owner: str, after: str | None, limit: int) -> tuple[list[BatchRecord], bool]:
        """The owner's batches, newest first, after the batch `after`; (page, has_more)."""
        query = "SELECT * FROM batches WHERE owner = ?"
        args: list[Any] = [owner]
        if after is not None:
            query += " AND seq < coalesce((SELECT seq FROM batches WHERE id = ? AND owner = ?), -1)"
            args += [after, owner]
        with self._reading() as db:
            rows = db.execute(query + " ORDER BY seq DESC LIMIT ?", [*args, limit + 1]).fetchall()
        return [from_row(BatchRecord, row) for row in rows[:limit]], len(rows) > limit

    def open_batches(self) -> list[BatchRecord]:
        with self._reading() as db:
            rows = db.execute(
                f"SELECT * FROM batches WHERE status IN ({_marks(OPEN_STATUSES)}) ORDER BY seq", OPEN_STATUSES
            ).fetchall()
        return [from_row(BatchRecord, row) for row in rows]

    @staticmethod
    def _set_status(
        db: Session, batch_id: str, status: str, now: int, from_statuses: Sequence[str], **columns: Any
    ) -> bool:
        """Move the batch to `status` (its time column set to `now`) if it is in `from_statuses`."""
        columns[STATUS_TIMES[status]] = now
        assignments = ", ".join(f"{name} = ?" for name in columns)
        return bool(
            db.execute(
                f"UPDATE batches SET status = ?, {assignments} "
                f"WHERE id = ? AND status IN ({_marks(from_statuses)})",
                (status, *columns.values(), batch_id, *from_statuses),
            ).rowcount
        )

    def cancel_batch(self, batch_id: str, owner: str, now: int) -> BatchRecord | None:
        """Move an open batch to `cancelling` (the worker stops it and writes what finished); None when
        the owner has no such batch, Conflict when it has already ended."""
        batch = self.get_batch(batch_id, owner)
        if batch is None:
            return None
        if batch.status in CANCELLABLE_STATUSES:
            with self._transaction() as db:
                moved = self._set_status(db, batch_id, "cancelling", now, CANCELLABLE_STATUSES)
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
            self._set_status(db, batch_id, "failed", now, ("validating",), errors=json.dumps(errors))

    def mark_finalizing(self, batch_id: str, now: int) -> None:
        with self._transaction() as db:
            self._set_status(db, batch_id, "finalizing", now, ("in_progress",))

    def overview(self) -> tuple[dict[str, int], BatchProgress]:
        """Batches of every owner by status, and the requests of the open ones: how many, and where."""
        with self._reading() as db:
            rows = db.execute("SELECT status, count(*) AS n FROM batches GROUP BY status").fetchall()
            batches = db.execute(
                "SELECT count(*) AS n, coalesce(sum(num_total), 0) AS total, "
                "coalesce(sum(num_completed), 0) AS completed, coalesce(sum(num_failed), 0) AS failed "
                f"FROM batches WHERE status IN ({_marks(OPEN_STATUSES)})",
                OPEN_STATUSES,
            ).fetchone()
            requests = dict.fromkeys(("pending", "running"), 0)
            for row in db.execute(
                "SELECT status, count(*) AS n FROM batch_requests "
                "WHERE status IN ('pending', 'running') GROUP BY status"
            ):
                requests[row["status"]] = int(row["n"])
        by_status = {row["status"]: int(row["n"]) for row in rows}
        return by_status, BatchProgress(
            num_open=int(batches["n"]),
            num_total=int(batches["total"]),
            num_completed=int(batches["completed"]),
            num_failed=int(batches["failed"]),
            num_pending=requests["pending"],
            num_running=requests["running"],
        )

    # ------------------------------------------------------------------ requests

    @property
    def claim_key(self) -> int:
        """This store's worker mark on the requests it runs (a reconnect takes a new one)."""
        return self.database.claim_key

    def claim(self, limit: int, now: float) -> list[RequestRecord]:
        """Up to `limit` pending requests due by `now`, oldest batch first, marked running under this
        worker's key; rows another worker is claiming at the same moment are skipped. Requests a dead
        worker left running are put back first."""
        with self._transaction() as db:
            self.database.put_back_orphans(db)
            rows = db.execute(
                "SELECT r.* FROM batch_requests r JOIN batches b ON b.id = r.batch_id "
                "WHERE b.status = 'in_progress' AND r.status = 'pending' AND r.next_attempt_at <= ? "
                "ORDER BY b.seq, r.line LIMIT ?" + self.database.skip_locked,
                (now, limit),
            ).fetchall()
            key = self.database.claim_key
            # The rows are this transaction's (SQLite's BEGIN IMMEDIATE, PostgreSQL's row locks):
            # still pending, so each is marked without a re-check.
            marks = [(key, row["batch_id"], row["line"]) for row in rows]
            if marks:
                db.executemany(
                    "UPDATE batch_requests SET status = 'running', claimed_by = ? "
                    "WHERE batch_id = ? AND line = ?",
                    marks,
                )
        return [replace(from_row(RequestRecord, row), status="running", claimed_by=key) for row in rows]

    def _lock_batch(self, db: Session, batch_id: str) -> str | None:
        """Hold the batch's row until commit (PostgreSQL); its status, None if there is no such batch."""
        row = db.execute("SELECT status FROM batches WHERE id = ?" + self.database.lock_row, (batch_id,))
        found = row.fetchone()
        return found["status"] if found is not None else None

    def finish_request(
        self, request: RequestRecord, status: str, result: dict[str, Any], attempts: int
    ) -> bool:
        """Commit a request's result with its final status (completed or failed), and count it and its
        tokens, in one transaction; False when it was no longer this worker's running request (its
        batch was stopped meanwhile, or a lost connection gave it to another worker)."""
        column = {"completed": "num_completed", "failed": "num_failed"}[status]
        usage = usage_of(result)
        with self._transaction() as db:
            self._lock_batch(db, request.batch_id)
            updated = db.execute(
                "UPDATE batch_requests SET status = ?, result = ?, attempts = ?, claimed_by = NULL "
                "WHERE batch_id = ? AND line = ? AND status = 'running' AND claimed_by = ?",
                (status, json.dumps(result), attempts, request.batch_id, request.line, request.claimed_by),
            ).rowcount
            if updated:
                db.execute(
                    f"UPDATE batches SET {column} = {column} + 1, model = coalesce(model, ?), "
                    "input_tokens = input_tokens + ?, cached_tokens = cached_tokens + ?, "
                    "output_tokens = output_tokens + ?, reasoning_tokens = reasoning_tokens + ? "
                    "WHERE id = ?",
                    (
                        usage.model,
                        usage.input_tokens,
                        usage.cached_tokens,
                        usage.output_tokens,
                        usage.reasoning_tokens,
                        request.batch_id,
                    ),
                )
        return bool(updated)

    def retry_request(self, request: RequestRecord, attempts: int, next_attempt_at: float) -> bool:
        """Back to pending until `next_attempt_at`; False when it was no longer this worker's."""
        with self._transaction() as db:
            return bool(
                db.execute(
                    "UPDATE batch_requests SET status = 'pending', attempts = ?, next_attempt_at = ?, "
                    "claimed_by = NULL "
                    "WHERE batch_id = ? AND line = ? AND status = 'running' AND claimed_by = ?",
                    (attempts, next_attempt_at, request.batch_id, request.line, request.claimed_by),
                ).rowcount
            )

    def finalize(self, batch: BatchRecord, status: str, now: int) -> bool:
        """One transaction: the output and error files from the requests' committed results (read in
        it, under the batch's row lock, so a result committed a moment before is in them and none can
        land after), the unfinished requests marked with the final status (expired / cancelled), and
        the batch's final status. False when another worker finalized it first."""
        with self._transaction() as db:
            if self._lock_batch(db, batch.id) not in OPEN_STATUSES:
                return False
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
                "UPDATE batch_requests SET status = ?, claimed_by = NULL "
                "WHERE batch_id = ? AND status IN ('pending', 'running')",
                (status, batch.id),
            )
            self._set_status(
                db,
                batch.id,
                status,
                now,
                OPEN_STATUSES,
                output_file_id=file_ids[0],
                error_file_id=file_ids[1],
            )
        return True
