"""The burst client of bench_gpu_burst.py: `concurrency` streamed completions sent at once from several
processes (aiohttp; stdlib and aiohttp only, so a spawned process starts in well under a second)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from typing import Any

MAX_TOKENS = 128


async def _streams(url: str, model: str, indices: list[int], start_at: float) -> dict[str, Any]:
    """One client process's streams, all opened at `start_at` (time.time): status counts, output tokens
    (the final chunk's usage), the last token's arrival, and each stream's first and last token times
    (seconds after `start_at`: where a burst's time goes, intake or decode)."""
    import aiohttp

    counts: dict[str, int] = {}
    tokens, last = 0, 0.0
    firsts: list[float] = []
    ends: list[float] = []

    async def one(session: aiohttp.ClientSession, index: int) -> None:
        nonlocal tokens, last
        body = {
            "model": model,
            "prompt": f"Request {index} of the burst: tell me a long story about the sea and",
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with session.post(f"{url}/v1/completions", json=body) as response:
            key = str(response.status)
            first = None
            async for line in response.content:
                if first is None and line.startswith(b"data: {"):
                    first = time.time()
                if line.startswith(b"data: {") and b'"usage"' in line:
                    usage = json.loads(line[6:]).get("usage")
                    if usage:
                        tokens += usage["completion_tokens"]
            end = time.time()
            last = max(last, end)
            if first is not None:
                firsts.append(first - start_at)
                ends.append(end - start_at)
        counts[key] = counts.get(key, 0) + 1

    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await asyncio.sleep(max(0.0, start_at - time.time()))
        cpu, wall = time.process_time(), time.time()
        await asyncio.gather(*(one(session, index) for index in indices))
        cpu, wall = time.process_time() - cpu, time.time() - wall
    return {
        "counts": counts,
        "tokens": tokens,
        "last": last,
        "cpu_share": cpu / max(wall, 1e-9),
        "firsts": firsts,
        "ends": ends,
    }


def spread(values: list[float]) -> dict[str, float]:
    """min / median / max of `values` (seconds), rounded to the millisecond."""
    ordered = sorted(values) or [0.0]
    picks = (("min", 0), ("p50", len(ordered) // 2), ("max", -1))
    return {key: round(ordered[index], 3) for key, index in picks}


def burst(url: str, model: str, concurrency: int, processes: int) -> dict[str, Any]:
    """Send the burst, wait for every stream's end; the counts and rates of bench_gpu_burst's row. One
    fresh interpreter per share (this module's main: no torch in it, nothing inherited from the caller)."""
    start_at = time.time() + 3.0  # every process started and waiting before the first request
    workers = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                url,
                model,
                str(share),
                str(processes),
                str(concurrency),
                repr(start_at),
            ],
            stdout=subprocess.PIPE,
        )
        for share in range(processes)
    ]
    results = [json.loads(worker.communicate(timeout=900)[0]) for worker in workers]
    counts: dict[str, int] = {}
    for result in results:
        for key, value in result["counts"].items():
            counts[key] = counts.get(key, 0) + value
    tokens = sum(result["tokens"] for result in results)
    elapsed = max(result["last"] for result in results) - start_at
    return {
        "ok": counts.pop("200", 0),
        "refused_429": counts.pop("429", 0),
        "other": counts,
        "output_tokens": tokens,
        "output_tok_s": round(tokens / elapsed, 1),
        "elapsed_s": round(elapsed, 3),
        "client_cpu_share_max": round(max(result["cpu_share"] for result in results), 3),
        "first_token_s": spread([value for result in results for value in result["firsts"]]),
        "last_token_s": spread([value for result in results for value in result["ends"]]),
    }


def main() -> None:
    """One client process: URL MODEL SHARE PROCESSES CONCURRENCY START_AT -> its result as JSON on stdout."""
    url, model, share, processes, concurrency, start_at = sys.argv[1:7]
    indices = list(range(int(share), int(concurrency), int(processes)))
    sys.stdout.write(json.dumps(asyncio.run(_streams(url, model, indices, float(start_at)))) + "\n")


if __name__ == "__main__":
    main()
