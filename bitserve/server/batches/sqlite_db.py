"""SQLiteDatabase: the batch store in one SQLite file (WAL), its files' bytes beside it on disk. One
server process per database (a lock file says so), so at open every `running` request is the work of
a process that died, and goes back to pending. Thread-safe: one connection behind a lock."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bitserve.server.batches.db_errors import DatabaseInUse
from bitserve.server.batches.migrations import SQLITE_TYPES, pending_migrations

logger = logging.getLogger(__name__)

BUSY_TIMEOUT_MS = 10_000
TMP_SUFFIX = ".tmp"


def _take_process_lock(path: Path) -> Any:
    handle = open(path.with_name(path.name + ".lock"), "a")  # noqa: SIM115 - held until close()
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise DatabaseInUse(
            f"the batch database {path} is in use by another bitserve process; "
            "give each server its own --batch-db (or share a postgresql:// one)"
        ) from None
    return handle


class SQLiteDatabase:
    name = "sqlite"
    skip_locked = ""  # BEGIN IMMEDIATE already serializes every writer of the file
    lock_row = ""
    # the file cannot be used (locked past the busy timeout, disk I/O, gone): what trips the breaker
    failure_errors: tuple[type[BaseException], ...] = (sqlite3.OperationalError,)

    def __init__(self, path: Path) -> None:
        self.path = path
        self.files_dir = path.parent / f"{path.stem}-files"
        self.claim_key = secrets.randbelow(2**31 - 1) + 1
        self._lock = threading.Lock()
        path.parent.mkdir(parents=True, exist_ok=True)
        self.files_dir.mkdir(exist_ok=True)
        self._lock_file = _take_process_lock(path)
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode = WAL")
        # NORMAL in WAL: a commit survives the process being killed (the OS has the write); only a
        # power cut may lose the last commits, never corrupt the database.
        self._db.execute("PRAGMA synchronous = NORMAL")
        self._db.execute("PRAGMA foreign_keys = ON")
        self._db.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        self.schema_version = self._migrate()
        self._recover()

    def _migrate(self) -> int:
        """Each pending migration in its own transaction, its version in `user_version`."""
        version = int(self._db.execute("PRAGMA user_version").fetchone()[0])
        for target, statements in pending_migrations(version, SQLITE_TYPES):
            with self.transaction() as db:
                for statement in statements:
                    db.execute(statement)
                db.execute(f"PRAGMA user_version = {int(target)}")
            version = target
        return version

    def _recover(self) -> None:
        """Requests a killed process was running run again; files no row names (an upload or an
        output file whose transaction never committed) are removed."""
        with self.transaction() as db:
            num_reset = db.execute(
                "UPDATE batch_requests SET status = 'pending', claimed_by = NULL WHERE status = 'running'"
            ).rowcount
            known = {row["id"] for row in db.execute("SELECT id FROM files")}
        if num_reset:
            logger.info("batch store: %d interrupted request(s) will run again", num_reset)
        for path in self.files_dir.iterdir():
            if path.name not in known:
                path.unlink(missing_ok=True)

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    @contextlib.contextmanager
    def reading(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            yield self._db

    def put_back_orphans(self, db: sqlite3.Connection) -> int:
        return 0  # one process per file: the only dead worker is a previous process (_recover)

    def file_path(self, file_id: str) -> Path:
        return self.files_dir / file_id

    def write_content(self, db: sqlite3.Connection, file_id: str, content: bytes) -> None:
        """Write the bytes durably under a temporary name, then rename (never a half-written file);
        a file whose row never commits is removed at the next open."""
        tmp = self.files_dir / f"{file_id}{TMP_SUFFIX}"
        with open(tmp, "wb") as handle:
            handle.write(content)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, self.file_path(file_id))

    def read_content(self, file_id: str) -> bytes:
        return self.file_path(file_id).read_bytes()

    def drop_content(self, file_id: str) -> None:
        self.file_path(file_id).unlink(missing_ok=True)

    def close(self) -> None:
        with self._lock:
            self._db.close()
            self._lock_file.close()
