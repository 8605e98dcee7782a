"""The batch store's two databases behind one interface: SQLite (one server process per file, file
bytes beside it) and PostgreSQL (any number of server processes, file bytes in the database). The
store's SQL is written once, with `?` parameters; a backend supplies connections, transactions, the
row-lock clauses, where file bytes live and how the requests of a dead worker are put back."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

from bitserve.server.batches.config import DatabaseLocation
from bitserve.server.batches.db_errors import DatabaseInUse, DatabaseUnavailable

__all__ = ["DatabaseInUse", "DatabaseUnavailable", "Database", "Session", "open_database"]

POSTGRES_EXTRA_HINT = "PostgreSQL batch storage needs psycopg 3: pip install 'bitserve[postgres]'"


class Cursor(Protocol):
    rowcount: int

    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...

    def __iter__(self) -> Iterator[Any]: ...


class Session(Protocol):
    """One connection inside a transaction; rows read by column name (row["id"])."""

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Cursor: ...

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> Any: ...


class Database(Protocol):
    name: str  # sqlite | postgresql
    schema_version: int
    # this worker's mark on the requests it runs (claimed_by): only it can finish them
    claim_key: int
    # appended to the claim's SELECT: rows another worker is claiming are skipped, not waited for
    skip_locked: str
    # appended to a SELECT of one batch row: hold it until commit (finalize, a request's result)
    lock_row: str
    # errors meaning the database cannot be used (unreachable, broken): counted by the store's breaker
    failure_errors: tuple[type[BaseException], ...]

    def transaction(self) -> AbstractContextManager[Session]:
        """A read-write transaction: committed on exit, rolled back on an exception."""
        ...

    def reading(self) -> AbstractContextManager[Session]:
        """A connection for reads that need no transaction of their own."""
        ...

    def put_back_orphans(self, db: Session) -> int:
        """Requests marked running by a worker that is gone go back to pending; how many."""
        ...

    def write_content(self, db: Session, file_id: str, content: bytes) -> None:
        """Keep a file's bytes, in `db`'s transaction where the backend can (its row exists)."""
        ...

    def read_content(self, file_id: str) -> bytes:
        """A file's bytes; FileNotFoundError when it has none."""
        ...

    def drop_content(self, file_id: str) -> None:
        """After its row was deleted and committed: free a file's bytes (where the row does not)."""
        ...

    def close(self) -> None: ...


def open_database(location: DatabaseLocation) -> Database:
    """The backend for `location`, opened and migrated, with the work of dead workers put back."""
    if location.url is not None:
        try:
            from bitserve.server.batches.postgres_db import PostgresDatabase  # the `postgres` extra
        except ImportError as exc:
            raise DatabaseUnavailable(f"{POSTGRES_EXTRA_HINT} ({exc})") from exc
        return PostgresDatabase(location.url)
    from bitserve.server.batches.sqlite_db import SQLiteDatabase

    assert location.path is not None
    return SQLiteDatabase(location.path)
