r"""Served p99 latency and tok/s with HTTP/2 on and off (issue 43): uvicorn + httptools (today's server,
HTTP/1.1) against `bitserve serve --http2` (hypercorn), over HTTP/2 (h2c, prior knowledge: every stream
multiplexed on one connection) and over HTTP/1.1 on the same hypercorn port (the server's own cost apart
from the protocol's).

    python benchmarks/bench_http2.py --rounds 3 --concurrency 16 --num-requests 48 --max-tokens 64

Both servers run at once (same model, each `--threads` engine threads; the one not measured idles), and
the rounds alternate the three cells so that a slower minute of the machine falls on all of them. One
client for all: httpx's AsyncClient (http2=True, http1=False for h2c; a pool of `--concurrency`
HTTP/1.1 connections otherwise), streaming chat completions with `ignore_eos` so that every request
decodes `--max-tokens` tokens; a request's tokens are its SSE content chunks. Per cell and round: p50 /
p99 end-to-end latency, p99 time to first chunk, tok/s (tokens of all requests / wall time) and the
server process's CPU time per token (/proc: engine and HTTP together; the engine's share is the same in
every cell, so the difference is the HTTP stack's). The closing lines give the medians over rounds and
each hypercorn cell / uvicorn ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_serve_rss import free_port, machine_line, wait_ready  # noqa: E402

from bitserve.bench.report import percentile  # noqa: E402
from bitserve.loader.catalog import CATALOG, DEFAULT_MODEL  # noqa: E402

CELLS = ("uvicorn http/1.1", "hypercorn h2c", "hypercorn http/1.1")


def start_server(
    model: str, threads: int, http2: bool, extra: list[str]
) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    argv = [sys.executable, "-m", "bitserve", "serve", "--model", model, "--port", str(port)]
    argv += ["--num-threads", str(threads), "--log-format", "text", "--no-access-log"]
    argv += (["--http2"] if http2 else []) + extra
    env = {**os.environ, "BITSERVE_BATCH_DB": f"/tmp/bench_http2_{port}.sqlite3"}
    process = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return process, f"http://127.0.0.1:{port}"


async def one_request(client: httpx.AsyncClient, body: dict[str, Any]) -> tuple[float, float, int]:
    """(e2e s, time to the first content chunk s, content chunks) of one streamed chat completion."""
    started = time.perf_counter()
    first: float | None = None
    num_tokens = 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            choices = json.loads(line[len("data: ") :])["choices"]
            if choices and choices[0]["delta"].get("content"):
                num_tokens += 1
                first = first if first is not None else time.perf_counter() - started
    return time.perf_counter() - started, first or 0.0, num_tokens


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (/proc/<pid>/stat: utime, stime), all its threads."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
        fields = fh.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run_cell(url: str, pid: int, http2: bool, args: argparse.Namespace) -> dict[str, float]:
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": "Tell me a long story about rivers and the sea."}],
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    async with httpx.AsyncClient(
        base_url=url, http1=not http2, http2=http2, limits=limits, timeout=600.0
    ) as client:
        models = (await client.get("/v1/models")).json()["data"]
        body["model"] = models[0]["id"]
        await asyncio.gather(*(one_request(client, body) for _ in range(2)))  # warm the connection(s)
        queue: asyncio.Queue[int] = asyncio.Queue()
        for index in range(args.num_requests):
            queue.put_nowait(index)
        results: list[tuple[float, float, int]] = []

        async def worker() -> None:
            while not queue.empty():
                queue.get_nowait()
                results.append(await one_request(client, body))

        started, cpu_started = time.perf_counter(), cpu_seconds(pid)
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        wall_s = time.perf_counter() - started
        cpu_s = cpu_seconds(pid) - cpu_started
    num_tokens = sum(result[2] for result in results)
    e2e = sorted(result[0] for result in results)
    ttft = sorted(result[1] for result in results)
    return {
        "p50_s": percentile(e2e, 50),
        "p99_s": percentile(e2e, 99),
        "ttft_p99_s": percentile(ttft, 99),
        "tok_s": num_tokens / wall_s,
        "req_s": len(results) / wall_s,
        "cpu_ms_per_token": cpu_s * 1000 / num_tokens,  # the server's engine + HTTP work per streamed token
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="GGUF path or catalog name (default: SmolLM2's file)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--response-cache",
        action="store_true",
        help="serve with --response-cache: after the warm-up every request is a replay that skips the "
        "engine (one SSE chunk with the whole answer), so the HTTP stack bounds req/s",
    )
    args = parser.parse_args()
    model = args.model or smollm2_path()
    print(machine_line(), "|", " ".join(sys.argv), flush=True)
    extra = ["--response-cache"] if args.response_cache else []
    servers = {
        "uvicorn": start_server(model, args.threads, False, extra),
        "hypercorn": start_server(model, args.threads, True, extra),
    }
    rows: dict[str, list[dict[str, float]]] = {cell: [] for cell in CELLS}
    try:
        for process, url in servers.values():
            wait_ready(url, process, 300.0)
        for round_index in range(args.rounds):
            order = CELLS if round_index % 2 == 0 else tuple(reversed(CELLS))
            for cell in order:
                name, protocol = cell.split()
                process, url = servers[name]
                result = asyncio.run(run_cell(url, process.pid, protocol == "h2c", args))
                rows[cell].append(result)
                print(f"round {round_index + 1} {cell:>20}: " + fmt(result), flush=True)
    finally:
        for process, _ in servers.values():
            process.terminate()
            process.wait(timeout=60)
    medians = {
        cell: {key: statistics.median(r[key] for r in rows[cell]) for key in rows[cell][0]} for cell in CELLS
    }
    print(f"\nmedians over {args.rounds} rounds, {args.concurrency} streams x {args.max_tokens} tokens:")
    base = medians[CELLS[0]]
    for cell in CELLS:
        ratios = ", ".join(
            f"{label} {medians[cell][key] / base[key]:.3f}x"
            for label, key in (
                ("tok/s", "tok_s"),
                ("req/s", "req_s"),
                ("p99", "p99_s"),
                ("CPU/token", "cpu_ms_per_token"),
            )
        )
        print(f"{cell:>20}: {fmt(medians[cell])}" + ("" if cell == CELLS[0] else f"  | vs uvicorn: {ratios}"))
    print(machine_line())
    return 0


def fmt(result: dict[str, float]) -> str:
    return (
        f"p50 {result['p50_s'] * 1000:7.0f} ms  p99 {result['p99_s'] * 1000:7.0f} ms  "
        f"ttft p99 {result['ttft_p99_s'] * 1000:6.0f} ms  {result['tok_s']:6.1f} tok/s  "
        f"{result['req_s']:5.1f} req/s  "
        f"server CPU {result['cpu_ms_per_token']:.2f} ms/token"
    )


def smollm2_path() -> str:
    """The embedded SmolLM2 file by path: its format's default numerics (q8 activations, the fast decode
    every served row uses), not the catalog name's f32."""
    entry = CATALOG[DEFAULT_MODEL]
    spec = importlib.util.find_spec(entry.module)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"SmolLM2 is not installed ({entry.install_command})")
    return str(Path(next(iter(spec.submodule_search_locations))) / entry.filename)


if __name__ == "__main__":
    sys.exit(main())
