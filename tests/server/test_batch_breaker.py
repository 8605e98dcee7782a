"""The Batch API database's circuit breaker: a real SQLite store whose file another connection holds
locked fails N writes, then every call (reads too) answers CircuitOpen at once without waiting on the
database; after the cool-down one probe goes and closes the breaker once the lock is gone. Through the
app: an open breaker makes the Batch API answer 503 with Retry-After, /health shows it, and the worker
backs off for the cool-down instead of retrying every poll. And a PostgreSQL cut off the network (a
proxy severed; skipped without POSTGRES_TEST_URL) opens it the same way, and a probe reconnects."""

from __future__ import annotations

import contextlib
import socket
import sqlite3
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from conftest import IN_PROCESS_SERVER
from fastapi.testclient import TestClient
from http_testing import free_port
from postgres_testing import fresh_database

from bitserve.errors import CircuitOpen
from bitserve.server.batches.config import BatchConfig
from bitserve.server.batches.store import BatchStore
from bitserve.server.breakers import CLOSED, OPEN, CircuitBreaker

LOCKED_WAIT_MS = 50  # the store's busy timeout here: a locked file fails in 50 ms, not 10 s


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_locked_database_opens_the_breaker_and_a_probe_closes_it(tmp_path: Path) -> None:
    clock = FakeClock()
    breaker = CircuitBreaker("batch_db", failure_threshold=2, cooldown_s=30.0, clock=clock)
    path = tmp_path / "batches.sqlite3"
    store = BatchStore(path, breaker)
    store.database._db.execute(f"PRAGMA busy_timeout = {LOCKED_WAIT_MS}")  # type: ignore[attr-defined]
    record = store.add_file("alice", "batch", "in.jsonl", b"{}\n", 1)
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")  # another writer holds the file
    try:
        for _ in range(2):
            with pytest.raises(sqlite3.OperationalError, match="locked"):
                store.add_file("alice", "batch", "in.jsonl", b"{}\n", 2)
        assert breaker.state == OPEN
        started = time.perf_counter()
        with pytest.raises(CircuitOpen) as refused:
            store.add_file("alice", "batch", "in.jsonl", b"{}\n", 3)
        with pytest.raises(CircuitOpen):
            store.get_file(record.id, "alice")  # a read is refused too: the database is not touched
        assert time.perf_counter() - started < LOCKED_WAIT_MS / 1000
        assert refused.value.retry_after_s == pytest.approx(30.0)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    clock.now += 30.0
    assert store.get_file(record.id, "alice") == record  # the probe
    assert breaker.state == CLOSED
    assert store.add_file("alice", "batch", "in.jsonl", b"{}\n", 4).num_bytes == 3
    store.close()


def test_a_missing_file_or_a_conflict_is_not_a_database_failure(tmp_path: Path) -> None:
    breaker = CircuitBreaker("batch_db", failure_threshold=1, cooldown_s=30.0)
    store = BatchStore(tmp_path / "batches.sqlite3", breaker)
    with pytest.raises(FileNotFoundError):
        store.read_file("file-missing")
    assert store.get_batch("batch-missing") is None
    assert breaker.state == CLOSED and breaker.num_failures == 0
    store.close()


def test_an_open_breaker_answers_503_and_the_worker_backs_off(
    tmp_path: Path, synthetic_instance: object
) -> None:
    from bitserve.server.app import build_app

    batch = BatchConfig(batch_db=str(tmp_path / "batches.sqlite3"))
    app = build_app(IN_PROCESS_SERVER, instance=synthetic_instance, batch=batch)  # type: ignore[arg-type]
    breaker = app.state.bitserve.breakers.get("batch_db")
    with TestClient(app) as client:
        assert client.get("/v1/batches").status_code == 200
        for _ in range(breaker.failure_threshold):
            breaker.record_failure()  # as N failed database calls would
        rejected_before = breaker.num_rejected
        response = client.get("/v1/batches")
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "dependency_unavailable"
        assert 1 <= int(response.headers["retry-after"]) <= breaker.cooldown_s
        health = client.get("/health").json()["components"]["breakers"]
        assert health["batch_db"]["state"] == OPEN
        assert health["batch_db"]["failures"] == breaker.failure_threshold
        time.sleep(1.2)  # the worker polls every 0.5 s: without the back-off it would try 2-3 passes
        worker_rejections = breaker.num_rejected - rejected_before - 1  # less the GET above
        assert worker_rejections <= 1
        metrics = client.get("/metrics").text
    assert 'bitserve_breaker_state{breaker="batch_db",state="open"} 1.0' in metrics


class Partition:
    """A TCP proxy to `target` on a port of its own, which `cut()` severs (every connection closed, new
    ones refused: the database host gone from the network) and `heal()` restores on the same port."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.port = free_port()
        self._connections: list[socket.socket] = []
        self._listener: socket.socket | None = None
        self.heal()

    def heal(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(16)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:  # cut()
                return
            upstream = socket.create_connection(self.target)
            self._connections += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        assert self._listener is not None
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for connection in self._connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
            connection.close()
        self._connections = []


def test_a_partitioned_postgresql_opens_the_breaker_and_a_probe_closes_it() -> None:
    psycopg = pytest.importorskip("psycopg")
    clock = FakeClock()
    breaker = CircuitBreaker("batch_db", failure_threshold=2, cooldown_s=30.0, clock=clock)
    with fresh_database() as url:
        parts = urlsplit(url)
        partition = Partition((parts.hostname or "127.0.0.1", parts.port or 5432))
        store = BatchStore(
            parts._replace(netloc=f"{parts.username}@127.0.0.1:{partition.port}").geturl(), breaker
        )
        try:
            record = store.add_file("alice", "batch", "in.jsonl", b"{}\n", 1)
            partition.cut()
            for _ in range(2):  # the broken connection, then the refused reconnect
                with pytest.raises(psycopg.OperationalError):
                    store.get_file(record.id, "alice")
            assert breaker.state == OPEN
            started = time.perf_counter()
            for _ in range(5):
                with pytest.raises(CircuitOpen):
                    store.get_file(record.id, "alice")
            assert time.perf_counter() - started < 0.1
            partition.heal()
            clock.now += 30.0
            assert store.get_file(record.id, "alice") == record  # the probe reconnects
            assert breaker.state == CLOSED
        finally:
            partition.cut()
            store.close()
