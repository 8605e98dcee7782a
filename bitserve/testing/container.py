"""The built CPU image, started as a pod would run it: `docker run --read-only --tmpfs /tmp` on the host
network (never a bridge network on these machines), bound to loopback with an API key. Used by the image
test (tests/deploy/test_deploy_built_image.py) and the start-up benchmark (benchmarks/bench_image_start.py).
"""

from __future__ import annotations

import contextlib
import datetime
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

READY_TIMEOUT_S = 240.0


@dataclass
class Container:
    docker: str
    name: str
    port: int
    api_key: str
    started_at: float  # time.monotonic() just before `docker run`

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> float:
        """Seconds from `docker run` until /health/ready answers 200; RuntimeError (with the log) if the
        container exits or the time runs out."""
        deadline = self.started_at + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.base_url}/health/ready", timeout=2).status_code == 200:
                    return time.monotonic() - self.started_at
            if not self.is_running():
                raise RuntimeError(f"the container exited before it was ready:\n{self.logs()}")
            time.sleep(0.1)
        raise RuntimeError(f"not ready after {timeout_s:.0f} s:\n{self.logs()}")

    def is_running(self) -> bool:
        state = self._inspect("{{.State.Running}}")
        return state == "true"

    def logs(self) -> str:
        result = subprocess.run([self.docker, "logs", self.name], capture_output=True, text=True, check=False)
        return result.stdout + result.stderr

    def longest_log_silence_s(self) -> float:
        """The longest gap in the start-up log: from the container's start to its first line, and between
        consecutive lines (docker's own per-line timestamps)."""
        result = subprocess.run(
            [self.docker, "logs", "--timestamps", self.name], capture_output=True, text=True, check=True
        )
        lines = (result.stdout + result.stderr).splitlines()
        stamps = [_parse_stamp(line.split(" ", 1)[0]) for line in lines]
        stamps = sorted([_parse_stamp(self._inspect("{{.State.StartedAt}}")), *stamps])
        return max((later - earlier for earlier, later in zip(stamps, stamps[1:], strict=False)), default=0.0)

    def rss_bytes(self) -> int:
        """Resident memory of the container's process tree (the server and any engine process)."""
        pid = int(self._inspect("{{.State.Pid}}"))
        return sum(_rss_of(process) for process in _process_tree(pid))

    def _inspect(self, template: str) -> str:
        result = subprocess.run(
            [self.docker, "inspect", "-f", template, self.name], capture_output=True, text=True, check=False
        )
        return result.stdout.strip()


def _parse_stamp(text: str) -> float:
    """RFC 3339 with nanoseconds (docker's) -> POSIX seconds."""
    whole, _, fraction = text.rstrip("Z").partition(".")
    moment = datetime.datetime.fromisoformat(whole).replace(tzinfo=datetime.timezone.utc)
    return moment.timestamp() + float(f"0.{fraction or 0}")


def _process_tree(pid: int) -> list[int]:
    found, pending = [], [pid]
    while pending:
        current = pending.pop()
        found.append(current)
        for task in Path(f"/proc/{current}/task").glob("*/children"):
            pending.extend(int(child) for child in task.read_text().split())
    return found


def _rss_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


@contextlib.contextmanager
def running_image(docker: str, image: str, port: int, api_key: str, *args: str) -> Iterator[Container]:
    """The image serving on 127.0.0.1:`port`, removed afterwards; `args` go to `bitserve serve`."""
    name = f"bitserve-{port}"
    started_at = time.monotonic()
    command = [
        docker, "run", "-d", "--name", name, "--read-only", "--tmpfs", "/tmp", "--network", "host",
        "-e", f"BITSERVE_API_KEY={api_key}", "-e", f"BITSERVE_PORT={port}", "-e", "BITSERVE_HOST=127.0.0.1",
        image, *args,
    ]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True, text=True)
    try:
        yield Container(docker, name, port, api_key, started_at)
    finally:
        subprocess.run([docker, "rm", "-f", name], check=False, capture_output=True)
