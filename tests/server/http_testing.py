"""Helpers for the server tests: a `bitserve serve` subprocess on a free port, and SSE parsing."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

REPO_ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 180.0
SMOLLM2_ALIAS = "smollm2-135m-instruct"  # the embedded default model's id on /v1/models


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until_ready(
    url: str, timeout_s: float, check: Callable[[], None] | None = None, *, poll_s: float = 0.1
) -> bool:
    """Poll `url`/health/ready until it answers 200 (True) or `timeout_s` passes (False); `check`
    runs before each poll and may raise (the server died)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check is not None:
            check()
        try:
            if httpx.get(f"{url}/health/ready", timeout=2.0).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(poll_s)
    return False


class ServerProcess:
    """`python -m bitserve serve` on 127.0.0.1:<free port>; its log goes to `log_path`."""

    def __init__(self, log_path: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        command = [
            sys.executable,
            "-m",
            "bitserve",
            "serve",
            "--port",
            str(self.port),
            "--log-format",
            "text",
            *args,
        ]
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            command,
            cwd=REPO_ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            # each server its own batch database (the Batch API's file lock allows one process per file)
            env={
                **os.environ,
                "BITSERVE_BATCH_DB": str(log_path.with_suffix(".batches.sqlite3")),
                **(env or {}),
            },
        )

    def log_tail(self, num_chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        if not wait_until_ready(self.url, timeout_s, self._check_running, poll_s=0.25):
            raise RuntimeError(f"server not ready after {timeout_s} s:\n{self.log_tail()}")

    def _check_running(self) -> None:
        if self.process.poll() is not None:
            raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log_tail()}")

    def terminate(self) -> None:
        """SIGTERM (the graceful drain), to this process only."""
        self.process.send_signal(signal.SIGTERM)

    def wait_exit(self, timeout_s: float) -> int:
        return self.process.wait(timeout=timeout_s)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self._log.close()


def chat_body(max_tokens: int, **extra: Any) -> dict[str, Any]:
    """A streamed chat request to the embedded SmolLM2 (`extra` adds or overrides fields)."""
    return {
        "model": SMOLLM2_ALIAS,
        "messages": [{"role": "user", "content": "Tell me about rivers."}],
        "max_tokens": max_tokens,
        "stream": True,
        **extra,
    }


def sse_data(lines: list[str]) -> list[str]:
    """The `data:` payloads of an SSE body, checking every line is data, a comment or blank."""
    payloads = []
    for line in lines:
        if line.startswith("data: "):
            payloads.append(line[len("data: ") :])
        else:
            assert line == "" or line.startswith(":"), f"unexpected SSE line {line!r}"
    return payloads


def parse_stream(lines: list[str]) -> tuple[list[dict[str, Any]], bool]:
    """(JSON chunks, ended with [DONE]); every payload but the final [DONE] must be JSON."""
    payloads = sse_data(lines)
    is_done = bool(payloads) and payloads[-1] == "[DONE]"
    chunks = [json.loads(payload) for payload in (payloads[:-1] if is_done else payloads)]
    return chunks, is_done
