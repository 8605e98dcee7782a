"""What the batch database costs per request, without a model: a batch of N requests run by BatchWorkers
whose executor answers at once, so the time is the store's (validate, claim, commit each result,
finalize). SQLite with one worker; PostgreSQL with one and with two workers sharing the database (two
connections, as two server processes have; each request still runs once, checked).

    python benchmarks/bench_batch_store.py --num-requests 400 \
        --postgres-url postgresql://bitserve@127.0.0.1:5432/postgres   # a role that may create databases
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

from bitserve.server.batches.config import BatchConfig
from bitserve.server.batches.executor import Outcome
from bitserve.server.batches.input_file import InputLimits
from bitserve.server.batches.store import BatchStore
from bitserve.server.batches.worker import BatchWorker
from bitserve.server.protocol import CompletionRequest

URL = "/v1/completions"
USAGE = {"prompt_tokens": 3, "completion_tokens": 2}


class InstantExecutor:
    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()

    async def __call__(self, url: str, body: dict[str, Any]) -> Outcome:
        self.calls[body["prompt"]] += 1
        return Outcome(200, {"text": "x", "model": "m", "usage": USAGE}, "req")


def input_file(num_requests: int) -> bytes:
    lines = [
        {"custom_id": f"r{i}", "method": "POST", "url": URL, "body": {"prompt": f"r{i}", "max_tokens": 1}}
        for i in range(num_requests)
    ]
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


async def run_batch(targets: list[str], num_requests: int, concurrency: int) -> tuple[float, Counter[str]]:
    """Seconds from batch creation to `completed`, and the executor's calls per request."""
    stores = [BatchStore(target) for target in targets]
    executor = InstantExecutor()
    config = BatchConfig(batch_concurrency=concurrency, batch_max_lines=num_requests)
    limits = InputLimits(max_file_bytes=1 << 30, max_lines=num_requests, max_body_bytes=1 << 16)
    workers = [BatchWorker(store, executor, config, {URL: CompletionRequest}, limits) for store in stores]
    try:
        file_id = stores[0].add_file("bench", "batch", "in.jsonl", input_file(num_requests), 1).id
        started = time.perf_counter()
        batch_id = stores[0].create_batch("bench", URL, file_id, "24h", None, 1, 1e12).id
        tasks = [asyncio.create_task(worker.run()) for worker in workers]
        for worker in workers:
            worker.wake()
        while stores[0].get_batch(batch_id).status != "completed":  # type: ignore[union-attr]
            await asyncio.sleep(0.005)
        elapsed = time.perf_counter() - started
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return elapsed, executor.calls
    finally:
        for store in stores:
            store.close()


def postgres_database(server_url: str) -> tuple[str, Any]:
    """A new database on the server and a function that drops it."""
    import psycopg

    name = f"bitserve_bench_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(server_url, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')

    def drop() -> None:
        with psycopg.connect(server_url, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    return server_url.rsplit("/", 1)[0] + f"/{name}", drop


def report(label: str, elapsed: float, calls: Counter[str], num_requests: int) -> None:
    assert len(calls) == num_requests and set(calls.values()) == {1}, "a request ran twice or not at all"
    per_request_ms = elapsed / num_requests * 1e3
    print(f"{label:<28} {elapsed:7.2f} s  {num_requests / elapsed:8.0f} req/s  {per_request_ms:6.2f} ms/req")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=8, help="--batch-concurrency of each worker")
    parser.add_argument("--postgres-url", help="a PostgreSQL server (a database is created and dropped)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        elapsed, calls = asyncio.run(
            run_batch([str(Path(folder) / "b.sqlite3")], args.num_requests, args.concurrency)
        )
        report("sqlite, 1 worker", elapsed, calls, args.num_requests)
    if args.postgres_url:
        for num_workers in (1, 2):
            url, drop = postgres_database(args.postgres_url)
            try:
                elapsed, calls = asyncio.run(
                    run_batch([url] * num_workers, args.num_requests, args.concurrency)
                )
            finally:
                drop()
            report(f"postgresql, {num_workers} worker(s)", elapsed, calls, args.num_requests)


if __name__ == "__main__":
    main()
