"""PostgresDatabase: the batch store on a PostgreSQL server (psycopg 3, the `postgres` extra), shared by
any number of server processes. File bytes live in the `file_contents` table (the processes may share
no disk). Claims are row locks (`FOR UPDATE SKIP LOCKED`), so two workers never take one request.

Each worker holds a session-level advisory lock on a key of its own (`claim_key`, written into the
requests it runs). PostgreSQL drops the lock when the session ends, SIGKILL included, so a running
request whose key nobody holds is the work of a dead worker: any worker's next claim puts it back.
Thread-safe: one connection behind a lock, reopened (with a new key) if it breaks."""

from __future__ import annotations

import contextlib
import functools
import logging
import secrets
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import psycopg
from psycopg.rows import dict_row

from bitserve.server.batches.db_errors import DatabaseUnavailable
from bitserve.server.batches.migrations import POSTGRES_TYPES, pending_migrations

logger = logging.getLogger(__name__)

# the first half of every advisory lock key bitserve takes ("batc"); the second is the worker's key
# (0: the migration lock)
LOCK_NAMESPACE = 0x62617463
CONNECT_TIMEOUT_S = 10
APPLICATION_NAME = "bitserve-batches"
LIVE_CLAIM_KEYS = (
    "SELECT objid::bigint FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 2 "
    "AND classid::bigint = ? AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
)


@functools.lru_cache(maxsize=256)
def to_pyformat(sql: str) -> str:
    """The store's `?` parameters as psycopg's `%s` (a literal % doubled)."""
    return sql.replace("%", "%%").replace("?", "%s")


class _Session:
    """A psycopg connection speaking the store's `?` parameters."""

    def __init__(self, connection: psycopg.Connection[Any]) -> None:
        self._connection = connection

    def execute(self, sql: str, params: Sequence[Any] = ()) -> psycopg.Cursor[Any]:
        return self._connection.execute(to_pyformat(sql), params)

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        with self._connection.cursor() as cursor:
            cursor.executemany(to_pyformat(sql), rows)


class PostgresDatabase:
    name = "postgresql"
    skip_locked = " FOR UPDATE OF r SKIP LOCKED"
    lock_row = " FOR UPDATE"
    # the server cannot be reached or the connection broke: what trips the breaker (not SQL errors)
    failure_errors: tuple[type[BaseException], ...] = (psycopg.OperationalError,)

    def __init__(self, url: str) -> None:
        self.url = url
        self._lock = threading.Lock()
        try:
            self._connection = self._connect()
            self.schema_version = self._migrate()
            self.claim_key = self._take_claim_key()
        except psycopg.Error as exc:
            raise DatabaseUnavailable(f"PostgreSQL: {exc}".strip()) from exc

    def _connect(self) -> psycopg.Connection[Any]:
        return psycopg.connect(
            self.url,
            autocommit=True,  # transactions are explicit (transaction()); the advisory lock is the session's
            row_factory=dict_row,
            connect_timeout=CONNECT_TIMEOUT_S,
            application_name=APPLICATION_NAME,
        )

    def _migrate(self) -> int:
        """Every pending migration in one transaction, under a lock so servers starting together
        migrate once; the version in the `schema_version` table."""
        with self.transaction() as db:
            db.execute("SELECT pg_advisory_xact_lock(?, 0)", (LOCK_NAMESPACE,))
            db.execute("CREATE TABLE IF NOT EXISTS schema_version (version BIGINT NOT NULL)")
            row = db.execute("SELECT version FROM schema_version").fetchone()
            if row is None:
                db.execute("INSERT INTO schema_version (version) VALUES (0)")
            version = int(row["version"]) if row is not None else 0
            for target, statements in pending_migrations(version, POSTGRES_TYPES):
                for statement in statements:
                    db.execute(statement)
                db.execute("UPDATE schema_version SET version = ?", (target,))
                version = target
        return version

    def _take_claim_key(self) -> int:
        """A key no live worker holds, locked for this session; requests a dead worker left under the
        same key (a key is reused only once its holder is gone) are put back first."""
        session = _Session(self._connection)
        while True:
            key = secrets.randbelow(2**31 - 1) + 1
            taken = session.execute("SELECT pg_try_advisory_lock(?, ?) AS taken", (LOCK_NAMESPACE, key))
            if taken.fetchone()["taken"]:
                break
        with self._connection.transaction():
            _put_back(session, "claimed_by = ?", (key,))
        return key

    def _session(self) -> _Session:
        """The connection, reopened if it broke; a new connection is a new worker (a new key): what
        the old one was running is put back by whoever claims next, and its results are refused."""
        if self._connection.closed or self._connection.broken:
            logger.warning("batch store: the PostgreSQL connection broke; reconnecting")
            self._connection = self._connect()
            self.claim_key = self._take_claim_key()
        return _Session(self._connection)

    @contextlib.contextmanager
    def transaction(self) -> Iterator[_Session]:
        with self._lock:
            session = self._session()
            with self._connection.transaction():
                yield session

    @contextlib.contextmanager
    def reading(self) -> Iterator[_Session]:
        with self._lock:
            yield self._session()

    def put_back_orphans(self, db: _Session) -> int:
        orphaned = f"(claimed_by IS NULL OR claimed_by NOT IN ({LIVE_CLAIM_KEYS}))"
        return _put_back(db, orphaned, (LOCK_NAMESPACE,))

    def write_content(self, db: _Session, file_id: str, content: bytes) -> None:
        db.execute("INSERT INTO file_contents (file_id, content) VALUES (?, ?)", (file_id, content))

    def read_content(self, file_id: str) -> bytes:
        with self.reading() as db:
            row = db.execute("SELECT content FROM file_contents WHERE file_id = ?", (file_id,)).fetchone()
        if row is None:
            raise FileNotFoundError(file_id)
        return bytes(row["content"])

    def drop_content(self, file_id: str) -> None:
        return None  # ON DELETE CASCADE removed the bytes with the row

    def close(self) -> None:
        with self._lock:
            self._connection.close()


def _put_back(db: _Session, claimed: str, params: tuple[object, ...]) -> int:
    """Running requests whose claim matches the SQL condition `claimed` go back to pending (a dead
    worker's); how many."""
    num_reset = db.execute(
        "UPDATE batch_requests SET status = 'pending', claimed_by = NULL "
        f"WHERE status = 'running' AND {claimed}",
        params,
    ).rowcount
    if num_reset:
        logger.info("batch store: %d request(s) of a dead worker will run again", num_reset)
    return num_reset
