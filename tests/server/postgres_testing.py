"""PostgreSQL for the Batch API tests: a fresh database per test on the server POSTGRES_TEST_URL names
(.ci/run starts a throwaway cluster on loopback and always sets it); skipped, saying why, without it."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit

import pytest

from bitserve.server.batches.config import database_location

POSTGRES_URL_ENV = "POSTGRES_TEST_URL"


def postgres_server_url() -> str:
    """The test server's URL (a superuser, or a role that may create databases), or skip."""
    url = os.environ.get(POSTGRES_URL_ENV)
    if url:
        return url
    if os.environ.get("CI"):
        pytest.fail(f"{POSTGRES_URL_ENV} is unset under CI: .ci/run should have started PostgreSQL")
    pytest.skip(
        f"no PostgreSQL: set {POSTGRES_URL_ENV}=postgresql://USER@HOST:PORT/postgres "
        "(a role that may create databases; .ci/run starts one)"
    )


@contextmanager
def fresh_database() -> Iterator[str]:
    """The URL of a new, empty database, dropped afterwards (its connections closed first)."""
    psycopg = pytest.importorskip("psycopg", reason="psycopg 3 is the `postgres` extra's driver")
    server = postgres_server_url()
    name = f"bitserve_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield urlsplit(server)._replace(path=f"/{name}").geturl()
    finally:
        with psycopg.connect(server, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def query(target: str, sql: str) -> list[tuple]:
    """Run `sql` on a --batch-db target (a SQLite file or a postgresql:// URL), committed; its rows."""
    location = database_location(target)  # the server's own parse of --batch-db
    if location.url is not None:
        import psycopg

        with psycopg.connect(location.url) as connection:
            cursor = connection.execute(sql)
            return cursor.fetchall() if cursor.description is not None else []
    import sqlite3

    with sqlite3.connect(location.path) as connection:
        return connection.execute(sql).fetchall()
