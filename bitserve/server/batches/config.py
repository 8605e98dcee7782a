"""BatchConfig: the single home of every Batch API default (database, file and line caps, worker
concurrency, retries). `server/settings.py` fills it like the other config dataclasses. Imports no
other bitserve module."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_DATA_DIR = "~/.local/share/bitserve"
DB_FILE_NAME = "batches.sqlite3"
SQLITE_URL_PREFIX = "sqlite:///"
POSTGRES_SCHEMES = ("postgresql", "postgres")
# URL schemes of servers a later version may store batches in; named so the error can say so
UNSUPPORTED_SCHEMES = ("mysql", "mariadb")


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True, slots=True)
class DatabaseLocation:
    """Where the batch store lives: a SQLite file (`path`) or a PostgreSQL server (`url`)."""

    path: Path | None = None
    url: str | None = None

    def describe(self) -> str:
        """For logs: the file, or the URL without its password."""
        if self.path is not None:
            return str(self.path)
        assert self.url is not None
        scheme, _, rest = self.url.partition("://")
        credentials, at, host = rest.rpartition("@")
        return f"{scheme}://{credentials.split(':', 1)[0]}{at}{host}"


def database_location(batch_db: str) -> DatabaseLocation:
    """What a --batch-db value names: a path or sqlite:///PATH, or a postgresql:// URL (a
    `+driver` suffix such as postgresql+psycopg:// is dropped: psycopg 3 is the driver)."""
    scheme = batch_db.split("://", 1)[0].lower() if "://" in batch_db else ""
    base_scheme = scheme.split("+", 1)[0]
    if base_scheme in POSTGRES_SCHEMES:
        return DatabaseLocation(url="postgresql://" + batch_db.split("://", 1)[1])
    if base_scheme in UNSUPPORTED_SCHEMES:
        raise ValueError(
            f"batch_db: {base_scheme} is not supported: give a SQLite file path or a postgresql:// URL"
        )
    if scheme and not batch_db.startswith(SQLITE_URL_PREFIX):
        raise ValueError(
            f"batch_db: unknown database URL scheme {scheme!r}; "
            "give a SQLite file path or a postgresql:// URL"
        )
    return DatabaseLocation(path=Path(os.path.expanduser(batch_db.removeprefix(SQLITE_URL_PREFIX))))


@dataclass(frozen=True, slots=True)
class BatchConfig:
    """Where batches live and how they run. Invalid values raise ValueError."""

    data_dir: str = field(
        default=DEFAULT_DATA_DIR,
        metadata=_help("folder for the server's own data (the batch database and its files by default)"),
    )
    batch_db: str | None = field(
        default=None,
        metadata=_help(
            f"SQLite file (or sqlite:///PATH; default DATA_DIR/{DB_FILE_NAME}, its files beside it, one "
            "server process per file) or postgresql://USER@HOST/DB URL (shared by any number of server "
            "processes; needs the `postgres` extra) of the Batch API's files, jobs and results"
        ),
    )
    batch_max_file_bytes: int = field(
        default=100 * 1024 * 1024,
        metadata=_help("largest batch input file (POST /v1/files); larger gets 413"),
    )
    batch_max_lines: int = field(default=50_000, metadata=_help("most requests in one batch input file"))
    # NOTE: running batch requests share every engine step with interactive ones (low priority only
    # decides admission), so this caps what a batch costs them: measured on 2 vCPUs, SmolLM2, interactive
    # latency x2.4 at 2 and x7 at 8 (benchmarks/RESULTS.md). Raise it for throughput on a bigger machine.
    batch_concurrency: int = field(
        default=2, metadata=_help("batch requests the worker runs at once (all batches together)")
    )
    batch_max_attempts: int = field(
        default=5,
        metadata=_help("tries of a batch request that fails retryably (429, 5xx) before it is dead-lettered"),
    )
    batch_retry_base_s: float = field(
        default=1.0, metadata=_help("first retry delay of a batch request; doubles with each attempt")
    )
    batch_retry_max_s: float = field(default=60.0, metadata=_help("longest retry delay of a batch request"))

    def __post_init__(self) -> None:
        if self.batch_db is not None:
            database_location(self.batch_db)  # a bad URL fails at startup, not at the first batch
        for name in ("batch_max_file_bytes", "batch_max_lines", "batch_concurrency", "batch_max_attempts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.batch_retry_base_s <= self.batch_retry_max_s:
            raise ValueError("batch_retry_base_s must be > 0 and <= batch_retry_max_s")

    @property
    def database(self) -> DatabaseLocation:
        if self.batch_db is not None:
            return database_location(self.batch_db)
        return DatabaseLocation(path=Path(os.path.expanduser(self.data_dir)) / DB_FILE_NAME)
