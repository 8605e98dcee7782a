"""The batch database's schema as numbered migrations, applied in order at startup; the version
reached is SQLite's `user_version`. Append a migration, never edit one that has shipped."""

from __future__ import annotations

import sqlite3

# (version, SQL). Times are Unix seconds (REAL where sub-second matters to the worker).
MIGRATIONS: tuple[tuple[int, str], ...] = (
    (
        1,
        """
        CREATE TABLE files (
            id TEXT PRIMARY KEY,
            owner TEXT NOT NULL,
            purpose TEXT NOT NULL,            -- batch | batch_output
            filename TEXT NOT NULL,
            num_bytes INTEGER NOT NULL,
            created_at INTEGER NOT NULL
        );
        CREATE TABLE batches (
            seq INTEGER PRIMARY KEY AUTOINCREMENT,   -- list order and the `after` cursor
            id TEXT NOT NULL UNIQUE,
            owner TEXT NOT NULL,
            endpoint TEXT NOT NULL,
            input_file_id TEXT NOT NULL,
            completion_window TEXT NOT NULL,
            status TEXT NOT NULL,
            errors TEXT,                      -- JSON list of {code, message, line, param}
            metadata TEXT,                    -- JSON object
            output_file_id TEXT,
            error_file_id TEXT,
            num_total INTEGER NOT NULL DEFAULT 0,
            num_completed INTEGER NOT NULL DEFAULT 0,
            num_failed INTEGER NOT NULL DEFAULT 0,
            created_at INTEGER NOT NULL,
            expires_at REAL NOT NULL,
            in_progress_at INTEGER,
            finalizing_at INTEGER,
            completed_at INTEGER,
            failed_at INTEGER,
            expired_at INTEGER,
            cancelling_at INTEGER,
            cancelled_at INTEGER
        );
        CREATE INDEX batches_by_owner ON batches (owner, seq);
        CREATE TABLE batch_requests (
            batch_id TEXT NOT NULL REFERENCES batches (id),
            line INTEGER NOT NULL,            -- 1-based line of the input file
            id TEXT NOT NULL,                 -- batch_req_...: the output line's id, fixed at creation
            custom_id TEXT NOT NULL,
            url TEXT NOT NULL,
            body TEXT NOT NULL,
            status TEXT NOT NULL,             -- pending | running | completed | failed | expired | cancelled
            attempts INTEGER NOT NULL DEFAULT 0,
            next_attempt_at REAL NOT NULL DEFAULT 0,
            result TEXT,                      -- the output (or error) file line, committed with the status
            PRIMARY KEY (batch_id, line)
        );
        CREATE INDEX batch_requests_open ON batch_requests (batch_id, line)
            WHERE status IN ('pending', 'running');
        """,
    ),
)
LATEST_VERSION = MIGRATIONS[-1][0]


def migrate(connection: sqlite3.Connection) -> int:
    """Apply every migration newer than the database's version, each in its own transaction; returns
    the version reached. A database newer than this code is refused (ValueError), not downgraded."""
    version = int(connection.execute("PRAGMA user_version").fetchone()[0])
    if version > LATEST_VERSION:
        raise ValueError(
            f"the batch database is at schema version {version}, newer than this bitserve "
            f"({LATEST_VERSION}): use a newer bitserve or another --batch-db"
        )
    for target, script in MIGRATIONS:
        if target <= version:
            continue
        connection.execute("BEGIN IMMEDIATE")
        try:
            for statement in script.split(";"):
                if statement.strip():
                    connection.execute(statement)
            connection.execute(f"PRAGMA user_version = {int(target)}")
            connection.execute("COMMIT")
        except BaseException:
            connection.execute("ROLLBACK")
            raise
        version = target
    return version
