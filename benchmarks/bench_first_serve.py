"""The first `bitserve serve` after an install, as a newcomer runs it: seconds from the command to
/health/ready 200, the longest silence in its log, and the answer to the first question users ask.

    python -m venv /tmp/fresh && PYTHON=/tmp/fresh/bin/python bash scripts/install.sh
    /tmp/fresh/bin/python benchmarks/bench_first_serve.py --runs 2

The server runs with the interpreter that runs this script (so a fresh venv's own install is measured),
the embedded default model and no flags but the port. .ci/run prints this row after a fresh-venv install.
Timings only; nothing is asserted.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time

import httpx
from bench_image_start import QUESTION, first_answer
from bench_serve_rss import free_port

READY_TIMEOUT_S = 300.0


def _wait_ready(url: str, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(f"{url}/health/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"bitserve serve was not ready (exit status {process.poll()})")


def one_start() -> tuple[float, float, str]:
    """(seconds to ready, longest log silence, first answer) of one fresh `bitserve serve`."""
    port = free_port()
    started = time.monotonic()
    command = [sys.executable, "-m", "bitserve", "serve", "--port", str(port), "--log-format", "text"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    stamps = [started]

    def read_log() -> None:
        for _ in process.stderr:  # type: ignore[union-attr]
            stamps.append(time.monotonic())

    threading.Thread(target=read_log, daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, process)
        ready_s = time.monotonic() - started
        silence_s = max(later - earlier for earlier, later in zip(stamps, stamps[1:], strict=False))
        return ready_s, silence_s, first_answer(url)
    finally:
        process.terminate()
        process.wait(timeout=60)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=2, help="starts, one after another")
    args = parser.parse_args()
    out = sys.stdout
    out.write(f"| start | serve to ready | longest log silence | {QUESTION!r} |\n")
    out.write("| ---: | ---: | ---: | --- |\n")
    for index in range(args.runs):
        ready_s, silence_s, answer = one_start()
        out.write(f"| {index + 1} | {ready_s:.1f} s | {silence_s:.1f} s | {answer!r} |\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
