"""The batch database's schema as numbered migrations, applied in order at startup, the same for
SQLite and PostgreSQL: each script is a template whose {int}, {real}, {seq_key} and {blob} become the
dialect's types (SQLITE_TYPES gives exactly the SQLite text that shipped). The version reached is
SQLite's `user_version` or PostgreSQL's `schema_version` table (database backends keep it). Append a
migration, never edit one that has shipped."""

from __future__ import annotations

from collections.abc import Mapping

# (version, SQL template). Times are Unix seconds ({real} where sub-second matters to the worker).
MIGRATIONS: tuple[tuple[int, str], ...] = (
    (
        1,
        """
        CREATE TABLE files (
            id TEXT PRIMARY KEY,
            owner TEXT NOT NULL,
            purpose TEXT NOT NULL,            -- batch | batch_output
            filename TEXT NOT NULL,
            num_bytes {int} NOT NULL,
            created_at {int} NOT NULL
        );
        CREATE TABLE batches (
            seq {seq_key},   -- list order and the `after` cursor
            id TEXT NOT NULL UNIQUE,
            owner TEXT NOT NULL,
            endpoint TEXT NOT NULL,
            input_file_id TEXT NOT NULL,
            completion_window TEXT NOT NULL,
            status TEXT NOT NULL,
            errors TEXT,                      -- JSON list of {{code, message, line, param}}
            metadata TEXT,                    -- JSON object
            output_file_id TEXT,
            error_file_id TEXT,
            num_total {int} NOT NULL DEFAULT 0,
            num_completed {int} NOT NULL DEFAULT 0,
            num_failed {int} NOT NULL DEFAULT 0,
            created_at {int} NOT NULL,
            expires_at {real} NOT NULL,
            in_progress_at {int},
            finalizing_at {int},
            completed_at {int},
            failed_at {int},
            expired_at {int},
            cancelling_at {int},
            cancelled_at {int}
        );
        CREATE INDEX batches_by_owner ON batches (owner, seq);
        CREATE TABLE batch_requests (
            batch_id TEXT NOT NULL REFERENCES batches (id),
            line {int} NOT NULL,            -- 1-based line of the input file
            id TEXT NOT NULL,                 -- batch_req_...: the output line's id, fixed at creation
            custom_id TEXT NOT NULL,
            url TEXT NOT NULL,
            body TEXT NOT NULL,
            status TEXT NOT NULL,             -- pending | running | completed | failed | expired | cancelled
            attempts {int} NOT NULL DEFAULT 0,
            next_attempt_at {real} NOT NULL DEFAULT 0,
            result TEXT,                      -- the output (or error) file line, committed with the status
            PRIMARY KEY (batch_id, line)
        );
        CREATE INDEX batch_requests_open ON batch_requests (batch_id, line)
            WHERE status IN ('pending', 'running');
        """,
    ),
    (
        2,
        # claimed_by: the claim key of the worker running a request (PostgreSQL: its session's
        # advisory lock; a dead worker's requests are put back). model and the token counts: the Batch
        # object's `model` and `usage`, added up as requests finish. file_contents: the bytes of the
        # files where the server processes may share no disk (PostgreSQL); SQLite keeps them beside it.
        """
        ALTER TABLE batch_requests ADD COLUMN claimed_by {int};
        ALTER TABLE batches ADD COLUMN model TEXT;
        ALTER TABLE batches ADD COLUMN input_tokens {int} NOT NULL DEFAULT 0;
        ALTER TABLE batches ADD COLUMN cached_tokens {int} NOT NULL DEFAULT 0;
        ALTER TABLE batches ADD COLUMN output_tokens {int} NOT NULL DEFAULT 0;
        ALTER TABLE batches ADD COLUMN reasoning_tokens {int} NOT NULL DEFAULT 0;
        CREATE INDEX batches_by_input_file ON batches (input_file_id);
        CREATE INDEX files_by_owner ON files (owner, created_at, id);
        CREATE TABLE file_contents (
            file_id TEXT PRIMARY KEY REFERENCES files (id) ON DELETE CASCADE,
            content {blob} NOT NULL
        );
        """,
    ),
)
LATEST_VERSION = MIGRATIONS[-1][0]
SQLITE_TYPES = {
    "int": "INTEGER",
    "real": "REAL",
    "seq_key": "INTEGER PRIMARY KEY AUTOINCREMENT",
    "blob": "BLOB",
}
POSTGRES_TYPES = {
    "int": "BIGINT",
    "real": "DOUBLE PRECISION",  # PostgreSQL's REAL is 4 bytes: a Unix time would lose minutes
    "seq_key": "BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY",
    "blob": "BYTEA",
}


def check_version(version: int) -> None:
    """A database newer than this code is refused (ValueError), not downgraded."""
    if version > LATEST_VERSION:
        raise ValueError(
            f"the batch database is at schema version {version}, newer than this bitserve "
            f"({LATEST_VERSION}): use a newer bitserve or another --batch-db"
        )


def pending_migrations(version: int, types: Mapping[str, str]) -> list[tuple[int, list[str]]]:
    """(version, statements) of every migration newer than `version`, in `types`' dialect."""
    check_version(version)
    return [
        (target, [statement for statement in script.format(**types).split(";") if statement.strip()])
        for target, script in MIGRATIONS
        if target > version
    ]
