"""EngineLoop: the engine thread's heartbeat, the same for any transport.

Blocks on the inbox while idle, drains every pending command before each step (so an abort always
lands before the next step), steps, and publishes each StepResult. Knows no asyncio: whoever runs it
passes the callbacks that carry results to the other side (ThreadEngineClient: the event loop).
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable

from bitserve.engine.engine import Engine
from bitserve.engine.messages import AbortRequests, AddRequest, Embed, Shutdown, StepResult
from bitserve.errors import BitserveError
from bitserve.loader.model_loader import release_freed_heap

logger = logging.getLogger(__name__)

# A prefill's activations ([tokens, intermediate] f32 per layer) are freed when its step ends, but glibc
# keeps them in the engine thread's arena: ~90 MB resident after an 8 x 34-token prefill of 2B-4T
# (benchmarks/RESULTS.md). Trimming costs ~0.2 ms, noise beside a CPU prefill of this size.
TRIM_AFTER_PREFILL_TOKENS = 64
Command = AddRequest | AbortRequests | Embed | Shutdown


class EngineLoop:
    """Runs one Engine until Shutdown. `publish(result)` after each step; `reject(request_id, error)`
    for a request the engine refused on admission; `die(error)` once if anything escapes a step."""

    def __init__(
        self,
        engine: Engine,
        publish: Callable[[StepResult], None],
        reject: Callable[[str, BitserveError], None],
        die: Callable[[BaseException], None],
        embedded: Callable[[str, list[list[float]] | BitserveError], None] | None = None,
    ) -> None:
        self.engine = engine
        self._embedded = embedded
        self.inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._publish = publish
        self._reject = reject
        self._die = die
        self.is_running = True
        self.last_progress = time.monotonic()  # updated after every step (liveness probe)
        self.num_steps = 0
        # a CPU replica's activations live in this process's heap; a CUDA replica's on the device
        self._trims_heap = engine.runner.device.type == "cpu"

    def run(self) -> None:
        try:
            while True:
                idle = not self.engine.has_unfinished_requests()
                if not self._drain(block=idle):
                    break
                if not self.engine.has_unfinished_requests():
                    continue
                if idle and not self._gather_burst():
                    break
                result = self.engine.step()
                self.num_steps += 1
                self.last_progress = time.monotonic()
                self._publish(result)
                if self._trims_heap and result.stats.num_prefill_tokens >= TRIM_AFTER_PREFILL_TOKENS:
                    release_freed_heap()
        except BaseException as exc:  # noqa: BLE001 - engine death is keyed on where, not what
            logger.critical("engine died: %r; scheduler: %s", exc, self._scheduler_dump(), exc_info=exc)
            self.is_running = False
            self._die(exc)
            return
        self.is_running = False

    def _apply(self, command: Command) -> bool:
        """Apply one inbox command; False means stop the loop."""
        if isinstance(command, Shutdown):
            return False
        if isinstance(command, AbortRequests):
            self.engine.abort_requests(command.request_ids, command.reason)
        elif isinstance(command, Embed):
            # between steps, on this thread: the model is never used by two callers at once. Anything
            # but a BitserveError escapes to run() as an engine death, like an exception in a step.
            try:
                result: list[list[float]] | BitserveError = self.engine.embed(command)
            except BitserveError as exc:
                result = exc
            if self._embedded is not None:
                self._embedded(command.request_id, result)
        else:
            try:
                self.engine.add_request(command.request)
            except BitserveError as exc:  # e.g. too long for the KV cache: this request only
                self._reject(command.request.request_id, exc)
        return True

    def _gather_burst(self) -> bool:
        """Work reached an idle engine: keep applying commands until none arrives for burst_gap_s (or
        burst_wait_max_s passed), so a burst of requests starts in one step. False on Shutdown."""
        config = self.engine.scheduler.config
        if config.burst_gap_s <= 0:
            return True
        deadline = time.monotonic() + config.burst_wait_max_s
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                command = self.inbox.get(timeout=min(config.burst_gap_s, remaining))
            except queue.Empty:
                return True
            if not self._apply(command):
                return False
        return True

    def _drain(self, block: bool) -> bool:
        """Apply every queued command (waiting for the first one when `block`); False on Shutdown."""
        try:
            command = self.inbox.get(block=block)
        except queue.Empty:
            return True
        while True:
            if not self._apply(command):
                return False
            try:
                command = self.inbox.get_nowait()
            except queue.Empty:
                return True

    def _scheduler_dump(self) -> str:
        scheduler = self.engine.scheduler
        return (
            f"running={scheduler.num_running} waiting={scheduler.num_waiting} stats={scheduler.get_stats()}"
        )
