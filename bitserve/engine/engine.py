"""Engine: the synchronous heartbeat of one replica. No asyncio, no HTTP, no text.

`step()` = schedule (core) -> execute (runner) -> update (core). Everything here runs on the
engine thread (or the caller's thread for the offline LLM).
"""

from __future__ import annotations

import dataclasses
import logging
import time

from bitserve.core.kv_cache_manager import KVCacheManager
from bitserve.core.request import FinishReason
from bitserve.core.scheduler import Scheduler
from bitserve.core.scheduler_output import RunnerOutput
from bitserve.core.scheduling_config import CacheConfig, SchedulerConfig
from bitserve.engine.messages import Embed, EngineRequest, KVCacheStats, StepResult
from bitserve.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class Engine:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.num_steps = 0

    @classmethod
    def build(
        cls, runner: ModelRunner, scheduler_config: SchedulerConfig, cache_config: CacheConfig
    ) -> Engine:
        kv = KVCacheManager(
            block_size=runner.layout.block_size,
            num_blocks=runner.layout.num_blocks,
            enable_prefix_caching=cache_config.enable_prefix_caching,
        )
        return cls(Scheduler(scheduler_config, kv, num_lookahead_tokens=runner.num_lookahead_tokens), runner)

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request. Raises InvalidRequest if it can never be served (too long for the cache)."""
        self.scheduler.add_request(request.to_request())

    def abort_requests(
        self, request_ids: list[str] | tuple[str, ...], reason: FinishReason = FinishReason.ABORT
    ) -> None:
        """Finish these requests before the next step; their blocks are freed now."""
        self.scheduler.abort_requests(request_ids, reason)

    def kv_cache_stats(self) -> KVCacheStats:
        """Occupancy of the KV cache. NOTE: may be called from the event loop while the engine thread
        steps: plain counter reads, no lock, one step stale at worst."""
        kv = self.scheduler.kv
        return KVCacheStats(
            round(kv.usage, 6),
            kv.num_free_blocks,
            kv.num_usable_blocks,
            kv.block_size,
            kv.num_resident_blocks,
        )

    def embed(self, command: Embed) -> list[list[float]]:
        """Normalised embeddings of the command's inputs (runner.embed; no scheduler state changes)."""
        return self.runner.embed(command.inputs, command.pooling, command.dimensions)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> StepResult:
        """Run one step. Any exception escaping here leaves the engine untrustworthy (EngineDead)."""
        start = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        scheduled = time.perf_counter()
        if scheduler_output.requests:
            runner_output = self.runner.execute(scheduler_output)
        else:
            self.runner.free_request_state(scheduler_output.finished_request_ids)
            runner_output = RunnerOutput()
        outputs = self.scheduler.update(scheduler_output, runner_output)
        self.num_steps += 1
        stats = dataclasses.replace(
            self.scheduler.get_stats(),
            step_time_s=time.perf_counter() - start,
            schedule_time_s=scheduled - start,
            device_memory_bytes=self.runner.device_memory_bytes(),
        )
        return StepResult(outputs=outputs, stats=stats)
