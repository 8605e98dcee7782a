"""BatchWorker: the asyncio task that moves batches along. Each pass: validate new batches (their
requests become rows), stop the cancelled and the expired, finalize the finished, then claim due
requests up to `batch_concurrency` and run each as its own task through the executor. A request that
fails retryably (429, 500, 503) waits an exponential backoff and runs again, up to
`batch_max_attempts`; then it is dead-lettered to the error file. Nothing is claimed while the server
is not ready (loading, draining), so batch work never holds back a drain."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from bitserve.errors import BitserveError, CircuitOpen
from bitserve.server.batches.config import BatchConfig
from bitserve.server.batches.executor import Outcome
from bitserve.server.batches.input_file import InputLimits, parse_input_file
from bitserve.server.batches.records import BatchProgress, BatchRecord, RequestRecord
from bitserve.server.batches.results import response_line
from bitserve.server.batches.store import BatchStore

logger = logging.getLogger(__name__)

POLL_S = 0.5  # the longest a due retry or an expiry waits to be noticed
# The stats' counts (store.overview: three count queries) are read at most this often: each ended
# request wakes a pass, so under load passes come many times a second.
OVERVIEW_INTERVAL_S = 1.0
RETRYABLE_STATUSES = frozenset({429, 500, 503})  # shed by admission, engine failures, model unavailable
Execute = Callable[[str, dict[str, Any]], Awaitable[Outcome]]
Key = tuple[str, int]  # (batch id, line)


def backoff_s(attempts: int, config: BatchConfig, retry_after_s: float | None) -> float:
    """Delay before try `attempts + 1`: base * 2^(attempts - 1), jittered down to half so retries of
    one burst spread out, at least what a 429 asked for, at most `batch_retry_max_s`."""
    delay = config.batch_retry_base_s * 2 ** (attempts - 1) * random.uniform(0.5, 1.0)
    return min(config.batch_retry_max_s, max(delay, retry_after_s or 0.0))


class BatchWorker:
    def __init__(
        self,
        store: BatchStore,
        execute: Execute,
        config: BatchConfig,
        body_models: Mapping[str, type[Any]],
        limits: InputLimits,
        *,
        is_ready: Callable[[], bool] = lambda: True,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.execute = execute
        self.config = config
        self.body_models = body_models
        self.limits = limits
        self.is_ready = is_ready
        self.clock = clock
        self._running: dict[Key, asyncio.Task[None]] = {}
        self._wake = asyncio.Event()
        # requests this worker ended (completed / failed: committed) or put back for a retry, since
        # it started: the bitserve_batch_requests_total counters and /v1/stats
        self.outcomes: Counter[str] = Counter()
        # the database (every process sharing it) as of a pass at most OVERVIEW_INTERVAL_S ago (plus
        # a poll): /v1/stats and the gauges
        self.by_status: dict[str, int] = {}
        self.progress = BatchProgress(0, 0, 0, 0, 0, 0)
        self._overview_read_at = float("-inf")  # time.monotonic(); the first pass reads them

    def wake(self) -> None:
        """Look again now (a batch was created or cancelled, a request ended)."""
        self._wake.set()

    @property
    def num_running(self) -> int:
        return len(self._running)

    async def run(self) -> None:
        """Until cancelled: a pass, then wait for a wake-up or POLL_S."""
        while True:
            self._wake.clear()
            try:
                await self.step()
            except CircuitOpen as exc:
                # the database's breaker is open: back off until its probe may go, not every POLL_S
                await asyncio.sleep(max(POLL_S, exc.retry_after_s))
                continue
            except Exception:  # noqa: BLE001 - a failed pass (disk full, a locked database) is retried
                logger.exception("batch worker pass failed; retrying in %g s", POLL_S)
            await self._wait_for_wake()

    async def _wait_for_wake(self) -> None:
        """A wake-up or POLL_S. Not asyncio.wait_for: on Python < 3.12 it can swallow a cancel that
        lands as the wake-up does, and the worker would outlive stop() (a hung shutdown)."""
        waiter = asyncio.ensure_future(self._wake.wait())
        try:
            await asyncio.wait({waiter}, timeout=POLL_S)
        finally:
            waiter.cancel()

    async def stop(self) -> None:
        """Cancel the running requests; their rows go back to pending for the next start."""
        tasks = list(self._running.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def step(self) -> None:
        """One pass over the open batches, then claim what fits."""
        now = self.clock()
        for batch in await asyncio.to_thread(self.store.open_batches):
            if batch.status == "validating":
                await self._validate(batch)
            elif batch.status == "cancelling":
                await self._end(batch, "cancelled")
            elif batch.status == "in_progress" and now >= batch.expires_at:
                await self._end(batch, "expired")
            elif batch.status == "finalizing" or self._is_done(batch):
                await self._end(batch, "completed")
        if self.is_ready():
            await self._claim(now)
        await self._read_overview()

    async def _read_overview(self) -> None:
        """The database's counts for the stats, unless they were read less than
        OVERVIEW_INTERVAL_S ago."""
        started = time.monotonic()
        if started - self._overview_read_at < OVERVIEW_INTERVAL_S:
            return
        self.by_status, self.progress = await asyncio.to_thread(self.store.overview)
        self._overview_read_at = started

    def _is_done(self, batch: BatchRecord) -> bool:
        """Every request has its final result (the counts are committed with the results)."""
        return batch.status == "in_progress" and batch.num_completed + batch.num_failed >= batch.num_total

    async def _validate(self, batch: BatchRecord) -> None:
        """validating -> in_progress (its requests stored as rows), or failed naming what is wrong."""
        now = int(self.clock())
        try:
            content = await asyncio.to_thread(self.store.read_file, batch.input_file_id)
            lines = await asyncio.to_thread(parse_input_file, content, self.body_models, self.limits)
            wrong = next((line for line in lines if line.url != batch.endpoint), None)
            if wrong is not None:
                raise BitserveError(
                    f"line {wrong.line}: url {wrong.url} is not the batch's endpoint {batch.endpoint}"
                )
        except FileNotFoundError:
            error = {
                "code": "missing_file",
                "message": "the input file was deleted",
                "param": "input_file_id",
            }
            await asyncio.to_thread(self.store.fail_batch, batch.id, [error], now)
            return
        except BitserveError as exc:
            error = {"code": "invalid_request", "message": exc.message, "param": "input_file_id"}
            await asyncio.to_thread(self.store.fail_batch, batch.id, [error], now)
            return
        if await asyncio.to_thread(self.store.start_batch, batch.id, lines, now):
            logger.info("batch %s: %d request(s) in progress", batch.id, len(lines))

    async def _end(self, batch: BatchRecord, status: str) -> None:
        """Stop the batch's running requests, then write its files and final status in one transaction."""
        tasks = [task for key, task in self._running.items() if key[0] == batch.id]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if status == "completed" and batch.status != "finalizing":
            await asyncio.to_thread(self.store.mark_finalizing, batch.id, int(self.clock()))
        if await asyncio.to_thread(self.store.finalize, batch, status, int(self.clock())):
            logger.info("batch %s %s", batch.id, status)

    async def _claim(self, now: float) -> None:
        free = self.config.batch_concurrency - len(self._running)
        if free <= 0:
            return
        for request in await asyncio.to_thread(self.store.claim, free, now):
            key = (request.batch_id, request.line)
            task = asyncio.create_task(self._run(request))
            self._running[key] = task
            task.add_done_callback(lambda _, key=key: self._finished(key))

    def _finished(self, key: Key) -> None:
        self._running.pop(key, None)
        self.wake()

    async def _run(self, request: RequestRecord) -> None:
        """One try of one request; its result, a retry or a dead letter committed in one transaction."""
        attempts = request.attempts + 1
        outcome = await self.execute(request.url, json.loads(request.body))
        line = response_line(request, outcome.status_code, outcome.request_id, outcome.body)
        if 200 <= outcome.status_code < 300:
            await self._finish(request, "completed", line, attempts)
        elif outcome.status_code in RETRYABLE_STATUSES and attempts < self.config.batch_max_attempts:
            delay = backoff_s(attempts, self.config, outcome.retry_after_s)
            logger.info(
                "batch %s line %d: %d, retry %d in %.1f s",
                request.batch_id,
                request.line,
                outcome.status_code,
                attempts,
                delay,
            )
            if await asyncio.to_thread(self.store.retry_request, request, attempts, self.clock() + delay):
                self.outcomes["retried"] += 1
        else:
            logger.warning(
                "batch %s line %d failed with %d after %d attempt(s)",
                request.batch_id,
                request.line,
                outcome.status_code,
                attempts,
            )
            await self._finish(request, "failed", line, attempts)

    async def _finish(self, request: RequestRecord, status: str, line: dict[str, Any], attempts: int) -> None:
        if await asyncio.to_thread(self.store.finish_request, request, status, line, attempts):
            self.outcomes[status] += 1
