"""BatchService: the Batch API's store and worker for one app. Started in the app's lifespan; when the
database cannot be opened (another process holds it, a read-only disk) the server still serves
inference and the batch routes answer 503 saying why."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
from collections.abc import Callable, Mapping
from typing import Any

from fastapi import FastAPI

from bitserve.errors import ServiceUnavailable
from bitserve.metrics.stats import BatchStats
from bitserve.server.batches.config import BatchConfig
from bitserve.server.batches.database import DatabaseUnavailable
from bitserve.server.batches.executor import Endpoint, InProcessExecutor
from bitserve.server.batches.input_file import InputLimits
from bitserve.server.batches.store import BatchStore
from bitserve.server.batches.worker import BatchWorker
from bitserve.server.breakers import CircuitBreaker

logger = logging.getLogger(__name__)

NOT_CONFIGURED = "the Batch API is off in this app (no batch configuration was given)"


class BatchService:
    def __init__(
        self,
        config: BatchConfig | None,
        endpoints: Mapping[str, Endpoint],
        max_body_bytes: int,
        breaker: CircuitBreaker | None = None,
    ) -> None:
        self.config = config
        self.breaker = breaker  # the database's (server/breakers.py); None: the store makes its own
        self.endpoints = dict(endpoints)
        self.body_models = {url: endpoint.body_model for url, endpoint in endpoints.items()}
        self.limits = InputLimits(
            max_file_bytes=config.batch_max_file_bytes if config else 0,
            max_lines=config.batch_max_lines if config else 0,
            max_body_bytes=max_body_bytes,
        )
        self.store: BatchStore | None = None
        self.worker: BatchWorker | None = None
        self.unavailable: str | None = NOT_CONFIGURED if config is None else None
        self._task: asyncio.Task[None] | None = None

    async def start(self, app: FastAPI, is_ready: Callable[[], bool]) -> None:
        """Open the database (migrations, recovery) and start the worker; on failure, log and stay off."""
        if self.config is None:
            return
        location = self.config.database
        try:
            self.store = await asyncio.to_thread(BatchStore, location, self.breaker)
        except (DatabaseUnavailable, OSError, sqlite3.Error, ValueError) as exc:
            self.unavailable = f"the Batch API is off: {exc}"
            logger.error("%s", self.unavailable)
            return
        logger.info("batch database %s (schema version %d)", location.describe(), self.store.schema_version)
        execute = InProcessExecutor(app, self.endpoints)
        self.worker = BatchWorker(
            self.store, execute, self.config, self.body_models, self.limits, is_ready=is_ready
        )
        self._task = asyncio.create_task(self.worker.run(), name="batch-worker")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.worker is not None:
            await self.worker.stop()
        if self.store is not None:
            self.store.close()

    def require_store(self) -> BatchStore:
        if self.store is None:
            raise ServiceUnavailable(
                self.unavailable or "the Batch API is starting",
                hint="see the server log; --batch-db names the database",
            )
        return self.store

    def wake(self) -> None:
        if self.worker is not None:
            self.worker.wake()

    def stats(self) -> BatchStats:
        """For the bitserve_batch* metrics: zeros until the worker's first pass."""
        worker = self.worker
        if worker is None:
            return BatchStats({}, 0, 0, 0, 0, 0)
        return BatchStats(
            by_status=dict(worker.by_status),
            num_pending=worker.progress.num_pending,
            num_running=worker.progress.num_running,
            num_completed=worker.outcomes["completed"],
            num_failed=worker.outcomes["failed"],
            num_retried=worker.outcomes["retried"],
        )

    def describe(self) -> dict[str, Any]:
        """/v1/stats' `batches`: the database's batches by status and the open ones' progress (every
        process sharing it), and what this process's worker runs and has ended."""
        if self.store is None or self.worker is None:
            return {"enabled": False, "reason": self.unavailable}
        stats = self.stats()
        return {
            "enabled": True,
            "database": self.store.database.name,
            "by_status": stats.by_status,
            "progress": self.worker.progress.to_dict(),
            "worker": {
                "running": self.worker.num_running,
                "concurrency": self.config.batch_concurrency if self.config else 0,
                "completed": stats.num_completed,
                "failed": stats.num_failed,
                "retried": stats.num_retried,
            },
        }
