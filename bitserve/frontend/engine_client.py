"""EngineClient: the thread seam between the asyncio frontend and one Engine.

ThreadEngineClient runs `EngineLoop` in its own thread: it blocks on an inbox while idle, drains every
pending command before each step (so an abort always lands before the next step), steps, and hands
each StepResult to the event loop with `call_soon_threadsafe`. The engine never touches asyncio
objects; the frontend never touches a Request or a tensor.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Protocol

from bitserve.engine.engine import Engine
from bitserve.engine.messages import AbortRequests, AddRequest, EngineRequest, Shutdown, StepResult
from bitserve.errors import BitserveError

logger = logging.getLogger(__name__)

Command = AddRequest | AbortRequests | Shutdown


class EngineClient(Protocol):
    def add_request(self, request: EngineRequest) -> None: ...

    def abort_requests(self, request_ids: list[str]) -> None: ...

    def shutdown(self) -> None: ...

    @property
    def is_alive(self) -> bool: ...


class ThreadEngineClient:
    """Owns the engine thread. `on_step(result)` and `on_rejected(request_id, error)` and
    `on_dead(error)` are called on the event loop."""

    def __init__(
        self,
        engine: Engine,
        loop: asyncio.AbstractEventLoop,
        on_step: Callable[[StepResult], None],
        on_rejected: Callable[[str, BitserveError], None],
        on_dead: Callable[[BaseException], None],
    ) -> None:
        self.engine = engine
        self._loop = loop
        self._on_step = on_step
        self._on_rejected = on_rejected
        self._on_dead = on_dead
        self._inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="bitserve-engine", daemon=True)
        self._alive = True
        self.last_progress = time.monotonic()  # updated after every step (liveness probe)
        self.num_steps = 0
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._alive and self._thread.is_alive()

    def add_request(self, request: EngineRequest) -> None:
        self._inbox.put(AddRequest(request))

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self._inbox.put(AbortRequests(tuple(request_ids)))

    def shutdown(self) -> None:
        self._inbox.put(Shutdown())

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _apply(self, command: Command) -> bool:
        """Apply one inbox command; False means stop the loop."""
        if isinstance(command, Shutdown):
            return False
        if isinstance(command, AbortRequests):
            self.engine.abort_requests(command.request_ids, command.reason)
        else:
            try:
                self.engine.add_request(command.request)
            except BitserveError as exc:  # e.g. too long for the KV cache: this request only
                self._loop.call_soon_threadsafe(self._on_rejected, command.request.request_id, exc)
        return True

    def _drain(self, block: bool) -> bool:
        try:
            command = self._inbox.get(block=block)
        except queue.Empty:
            return True
        if not self._apply(command):
            return False
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return True
            if not self._apply(command):
                return False

    def _run(self) -> None:
        try:
            while True:
                idle = not self.engine.has_unfinished_requests()
                if not self._drain(block=idle):
                    break
                if not self.engine.has_unfinished_requests():
                    continue
                result = self.engine.step()
                self.num_steps += 1
                self.last_progress = time.monotonic()
                self._loop.call_soon_threadsafe(self._on_step, result)
        except BaseException as exc:  # noqa: BLE001 - engine death is keyed on where, not what
            logger.critical("engine died: %r; scheduler: %s", exc, self._scheduler_dump(), exc_info=exc)
            self._alive = False
            self._loop.call_soon_threadsafe(self._on_dead, exc)
            return
        self._alive = False

    def _scheduler_dump(self) -> str:
        scheduler = self.engine.scheduler
        return f"running={scheduler.num_running} waiting={scheduler.num_waiting} stats={scheduler.get_stats()}"
