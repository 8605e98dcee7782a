"""EngineClient: the thread seam between the asyncio frontend and one Engine.

ThreadEngineClient runs an `EngineLoop` (engine/loop.py) in its own thread and hands each of its
callbacks to the event loop with `call_soon_threadsafe`. The engine never touches asyncio objects;
the frontend never touches a Request or a tensor.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import NamedTuple, Protocol

from bitserve.engine.engine import Engine
from bitserve.engine.loop import EngineLoop
from bitserve.engine.messages import (
    AbortRequests,
    AddRequest,
    Embed,
    EngineRequest,
    KVCacheStats,
    Shutdown,
    StepResult,
)
from bitserve.errors import BitserveError


class EngineCallbacks(NamedTuple):
    """What an engine client calls on the event loop: after each step, for a request the engine refused
    on admission, once if the engine dies, and with an embedding's answer."""

    on_step: Callable[[StepResult], None]
    on_rejected: Callable[[str, BitserveError], None]
    on_dead: Callable[[BaseException], None]
    on_embedded: Callable[[str, list[list[float]] | BitserveError], None]


class EngineClient(Protocol):
    """What AsyncEngine uses of its engine: ThreadEngineClient here, ProcessEngineClient
    (frontend/process_client.py) for an engine in its own process."""

    last_progress: float
    num_steps: int

    def add_request(self, request: EngineRequest) -> None: ...

    def abort_requests(self, request_ids: list[str]) -> None: ...

    def embed(self, command: Embed) -> None: ...

    def kv_cache_stats(self) -> KVCacheStats: ...

    def shutdown(self) -> None: ...

    def join(self, timeout: float | None = None) -> None: ...

    @property
    def is_alive(self) -> bool: ...


class ThreadEngineClient:
    """Owns the engine thread; hands each of the loop's callbacks to the event loop."""

    def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop, callbacks: EngineCallbacks) -> None:
        self.engine = engine
        on_step, on_rejected, on_dead, on_embedded = callbacks
        self._loop = EngineLoop(
            engine,
            publish=lambda result: loop.call_soon_threadsafe(on_step, result),
            reject=lambda request_id, error: loop.call_soon_threadsafe(on_rejected, request_id, error),
            die=lambda error: loop.call_soon_threadsafe(on_dead, error),
            embedded=lambda request_id, result: loop.call_soon_threadsafe(on_embedded, request_id, result),
        )
        self._thread = threading.Thread(target=self._loop.run, name="bitserve-engine", daemon=True)
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._loop.is_running and self._thread.is_alive()

    @property
    def last_progress(self) -> float:
        return self._loop.last_progress

    @property
    def num_steps(self) -> int:
        return self._loop.num_steps

    def kv_cache_stats(self) -> KVCacheStats:
        return self.engine.kv_cache_stats()

    def add_request(self, request: EngineRequest) -> None:
        self._loop.inbox.put(AddRequest(request))

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self._loop.inbox.put(AbortRequests(tuple(request_ids)))

    def embed(self, command: Embed) -> None:
        self._loop.inbox.put(command)

    def shutdown(self) -> None:
        self._loop.inbox.put(Shutdown())

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)
