r"""Resident memory of `bitserve serve` while it streams N concurrent requests (issue 4's RSS row).

    python benchmarks/bench_serve_rss.py benchmarks/out/2b4t-i2s.gguf --concurrency 8 --max-tokens 32
    python benchmarks/bench_serve_rss.py smollm2 --num-requests 2000 --max-tokens 16 --goal-mb 819 \
        --server-arg=--max-dense-weight-bytes=0

Starts `bitserve serve --model FILE` as a child process, waits for /health/ready, samples the
server's /proc/<pid>/status (VmRSS with its RssAnon / RssFile split, and VmHWM) every
`--interval-s` in a thread, and drives one level of `bitserve bench` (streaming completions,
`ignore_eos`, so every request produces --max-tokens tokens) against it. Prints the RSS after load,
the peak while streaming, the RSS after the last request, VmHWM (the whole life: load included) and
the load's own bench table. --server-arg passes one more option to `bitserve serve` (repeatable).
Timings are whatever the machine gives; nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from bitserve.bench.report import format_table, summarise  # noqa: E402
from bitserve.bench.runner import BenchConfig, run_bench_async  # noqa: E402

FIELDS = ("VmRSS", "RssAnon", "RssFile", "VmHWM")


def status_mb(pid: int) -> dict[str, float]:
    """FIELDS of /proc/<pid>/status in MB (MiB)."""
    out: dict[str, float] = {}
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        for line in fh:
            name, _, rest = line.partition(":")
            if name in FIELDS:
                out[name] = int(rest.split()[0]) / 1024.0
    return out


class Sampler:
    """Peak VmRSS (with its split) of a process, sampled in a thread."""

    def __init__(self, pid: int, interval_s: float) -> None:
        self.pid, self.interval_s = pid, interval_s
        self.peak: dict[str, float] = {"VmRSS": 0.0}
        self.num_samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            now = status_mb(self.pid)
            self.num_samples += 1
            if now.get("VmRSS", 0.0) > self.peak["VmRSS"]:
                self.peak = now
            self._stop.wait(self.interval_s)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def machine_line() -> str:
    """Date, CPU model, its ISA flags that pick the kernels, and the load average: for the row."""
    with open("/proc/cpuinfo", encoding="ascii") as fh:
        lines = fh.read().splitlines()
    model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
    isa = [flag for flag in flags if flag in ("avx2", "avx512f", "avx512_vnni", "avx_vnni")]
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}: {model}, {' '.join(isa)}, load average {load}"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_ready(url: str, process: subprocess.Popen[bytes], timeout_s: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if process.poll() is not None:
            raise SystemExit(f"the server exited with {process.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url + "/health/ready", timeout=2) as response:
                if response.status == 200:
                    return time.monotonic() - start
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"the server was not ready after {timeout_s} s")


def fmt(sample: dict[str, float]) -> str:
    return (
        f"{sample.get('VmRSS', 0):,.0f} MB (anon {sample.get('RssAnon', 0):,.0f} + file "
        f"{sample.get('RssFile', 0):,.0f})"
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model", help="catalog name or GGUF path")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--num-requests", type=int, default=None, help="default: --concurrency")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=32, help="synthetic prompt words per request")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--interval-s", type=float, default=0.05)
    parser.add_argument("--ready-timeout-s", type=float, default=300.0)
    parser.add_argument("--request-timeout-s", type=float, default=1800.0)
    parser.add_argument(
        "--goal-mb", type=float, default=2048.0, help="the RSS target printed beside the peak"
    )
    parser.add_argument(
        "--server-arg", action="append", default=[], help="one more `bitserve serve` option (repeatable)"
    )
    args = parser.parse_args()

    print(machine_line(), "|", " ".join(sys.argv), flush=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [
        sys.executable,
        "-m",
        "bitserve",
        "serve",
        "--model",
        args.model,
        "--port",
        str(port),
        "--num-threads",
        str(args.threads),
        "--log-format",
        "text",
        "--no-access-log",
        *args.server_arg,
    ]
    env = dict(os.environ)
    server = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        ready_s = wait_ready(url, server, args.ready_timeout_s)
        after_load = status_mb(server.pid)
        config = BenchConfig(
            url=url,
            endpoint="completions",
            concurrency_levels=(args.concurrency,),
            num_requests=args.num_requests or args.concurrency,
            max_tokens=args.max_tokens,
            num_prompt_words=args.prompt_tokens,
            ignore_eos=True,
            num_warmup=0,
            timeout_s=args.request_timeout_s,
        )
        with Sampler(server.pid, args.interval_s) as sampler:
            summary = summarise(asyncio.run(run_bench_async(config)))
        end = status_mb(server.pid)
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    for line in format_table(summary):
        print(line)
    level = summary["levels"][0]
    print(f"\nserver RSS: ready after {ready_s:.1f} s at {fmt(after_load)}")
    print(
        f"server RSS peak while streaming {args.concurrency} x {args.max_tokens} tokens: {fmt(sampler.peak)} "
        f"({sampler.num_samples} samples); goal <= {args.goal_mb:,.0f} MB"
    )
    print(f"server RSS after the last of {level['num_requests']} requests: {fmt(end)}")
    print(
        f"server VmHWM (whole life, load included): {end['VmHWM']:,.0f} MB; "
        f"requests ok {level['num_ok']} / {level['num_requests']}"
    )
    print(machine_line())
    return 0 if level["num_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
