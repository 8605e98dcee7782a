"""A real `redis-server` for the tests that need one (the shared rate limiter, its circuit breaker):
started on a free port (or a given one, to restart it where clients expect it), or the one .ci/run
started (REDIS_TEST_URL); and a listener that accepts and never answers (a hanging Redis). Skips when
redis-server is not installed, except under CI, where a skip would hide a gap."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from http_testing import free_port

REDIS_SERVER = shutil.which("redis-server")
START_TIMEOUT_S = 10.0


class RedisProcess:
    def __init__(self, folder: Path, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process = subprocess.Popen(
            [
                REDIS_SERVER or "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(folder),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        import redis

        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                redis.Redis(port=self.port, socket_timeout=0.5).ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    self.stop()
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)


class ExternalRedis:
    """The redis-server .ci/run started (REDIS_TEST_URL); left running for .ci/run to stop."""

    def __init__(self, url: str) -> None:
        self.url = url


def shared_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProcess | ExternalRedis]:
    """The body of a module's `redis_server` fixture: the CI's Redis, else one started for the module."""
    if os.environ.get("REDIS_TEST_URL"):
        yield ExternalRedis(os.environ["REDIS_TEST_URL"])
        return
    if REDIS_SERVER is None:
        if os.environ.get("CI"):
            pytest.fail("redis-server is missing under CI: .ci/run should have installed it")
        pytest.skip("redis-server is not installed (apt-get install redis-server; .ci/run does)")
    server = RedisProcess(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


class HangingServer:
    """A TCP listener that accepts connections and never answers: a Redis behind a network partition
    (or wedged), where every command waits out the client's socket timeout. Accepted sockets are held
    open until `stop()`."""

    def __init__(self) -> None:
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port = int(self._listener.getsockname()[1])
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.num_accepted = 0
        self._held: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, name="hanging-redis", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self._listener.accept()
            except OSError:  # the listener was closed: stop()
                return
            self.num_accepted += 1
            self._held.append(connection)

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept() (close alone may not)
        self._listener.close()
        for connection in self._held:
            connection.close()
        self._thread.join(timeout=5)
