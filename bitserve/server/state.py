"""AppState: what the HTTP handlers share (the ModelManager, configs, the stats sink, build info,
readiness, drain). app.py builds it; handlers reach it via get_state().
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import platform
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from fastapi import Request

import bitserve
from bitserve.config import EngineConfig, ServerConfig
from bitserve.engine.process import ServedModel
from bitserve.errors import ModelUnavailable, ServerShuttingDown
from bitserve.lifecycle.canary import NO_HINTS, RoutingHints
from bitserve.lifecycle.manager import ModelManager
from bitserve.lifecycle.slot import Lease, ModelSlot, SlotState
from bitserve.metrics.stats import BatchStats, StatsSink
from bitserve.server.batches.service import BatchService
from bitserve.server.breakers import Breakers
from bitserve.server.plugins.chain import PluginChain
from bitserve.server.response_cache.cache import ResponseCache
from bitserve.server.security.principal import check_model_access

logger = logging.getLogger(__name__)

DRAIN_POLL_S = 0.1
DEADLINE_GRACE_S = 2.0  # after the drain deadline, time for ended streams to send their error event


class MetricsSink(StatsSink, Protocol):
    """The StatsSink the server needs: it also counts HTTP errors and renders /metrics."""

    def record_http_error(self, status: int, reason: str) -> None: ...

    def record_limiter_error(self, on_error: str) -> None: ...

    def render(self) -> tuple[bytes, str]: ...

    def energy_status(self) -> dict[str, str]: ...

    def watch_batches(self, read: Callable[[], BatchStats]) -> None: ...


@dataclass(frozen=True, slots=True)
class BuildInfo:
    version: str
    git_sha: str
    torch_version: str
    python_version: str


def read_build_info() -> BuildInfo:
    """Read once at startup; the git sha is "unknown" outside a checkout or without git."""
    repo = Path(bitserve.__file__).resolve().parent.parent
    try:
        result = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=5, check=False
        )
        sha = result.stdout.strip() if result.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        sha = "unknown"
    return BuildInfo(bitserve.__version__, sha or "unknown", _version_of("torch"), platform.python_version())


def _version_of(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


@dataclass
class AppState:
    server_config: ServerConfig
    engine_config: EngineConfig
    stats: MetricsSink
    build: BuildInfo
    models: ModelManager
    load_error: str | None = None  # the startup model failed to load
    is_starting: bool = True  # the startup model is still loading
    is_draining: bool = False
    started_at: float = field(default_factory=time.time)
    tracer: Any = None  # an OpenTelemetry tracer when tracing is on (server/tracing.py)
    batches: BatchService = field(default_factory=lambda: BatchService(None, {}, 0))  # the Batch API
    response_cache: ResponseCache | None = None  # --response-cache (server/response_cache)
    plugins: PluginChain = field(default_factory=PluginChain)  # --plugin (server/plugins); none by default
    breakers: Breakers = field(default_factory=Breakers)  # of the dependencies in use (server/breakers.py)

    @property
    def phase(self) -> str:
        """loading | failed | ready | draining | dead (of the default model)."""
        if self.load_error is not None:
            return "failed"
        slot = self.default_slot()
        if slot is None:
            return "loading"
        if slot.replicas and not slot.has_live_replica:
            return "dead"
        return "draining" if self.is_draining else "ready"

    def loading_step(self) -> dict[str, Any] | None:
        """While the startup model loads: the loading slot's step (placing, hashing, loading, warming up,
        ...), its progress and seconds so far, for /health/ready's body; None otherwise."""
        if not self.is_starting or self.load_error is not None:
            return None
        slot = next((s for s in self.models.resident_slots() if s.state is SlotState.LOADING), None)
        if slot is None:
            return None
        return {"step": slot.phase, "progress": round(slot.progress, 3), "seconds": slot.seconds_loading}

    def default_slot(self) -> ModelSlot | None:
        entry = self.models.aliases.get(self.models.default_alias) if self.models.default_alias else None
        return entry.current if entry is not None else None

    def acquire(self, model: str | None, hints: RoutingHints = NO_HINTS) -> Lease:
        """A lease on the model a request names (the default one when None); see ModelManager.acquire.
        Forbidden when the request's credential may not use that model."""
        check_model_access(model if model is not None else self.models.default_alias)
        if self.load_error is not None and not self.models.aliases:
            raise ModelUnavailable(
                "the model failed to load", hint="see the server log; the server needs a restart"
            )
        if not self.models.aliases and self.is_starting:
            raise ModelUnavailable(
                "the model is still loading", hint="retry after the number of seconds in Retry-After"
            )
        return self.models.acquire(model, hints)

    def require_instance(self, model: str | None) -> ServedModel:
        """The model a request names, for work that needs no engine step (tokenize), draining or not."""
        alias = model if model is not None else self.models.default_alias
        check_model_access(alias)
        entry = self.models.aliases.get(alias) if alias is not None else None
        if entry is None or entry.current.instance is None:
            self.acquire(model).release()  # raises the error a generation would get
            raise ModelUnavailable(
                "the model is not ready", hint="retry after the number of seconds in Retry-After"
            )
        return entry.current.instance

    @property
    def num_live_streams(self) -> int:
        return sum(engine.num_active_requests for engine in self.models.serving_engines())

    def retry_after_s(self) -> float | None:
        waits = [engine.expected_wait_s() for engine in self.models.serving_engines()]
        return max(waits) if waits else None

    def begin_drain(self) -> None:
        """Readiness fails and new generations get 503 from now on."""
        self.is_draining = True
        self.models.begin_drain()

    async def drain(self, timeout_s: float) -> None:
        """Wait for in-flight requests to finish; at `timeout_s`, end the rest with an error event."""
        self.begin_drain()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._num_active() > 0 and loop.time() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        if self._num_active() == 0:
            logger.info("drained: no requests in flight")
            return
        error = ServerShuttingDown(
            f"the server shut down before the request finished (drain timeout {timeout_s:g} s)",
            hint="retry on another replica",
        )
        num_ended = sum(engine.expire(error) for engine in self.models.serving_engines())
        logger.warning("drain deadline: ending %d request(s) still in flight", num_ended)
        grace = loop.time() + DEADLINE_GRACE_S
        while self._num_active() > 0 and loop.time() < grace:
            await asyncio.sleep(DRAIN_POLL_S / 2)

    def _num_active(self) -> int:
        return self.models.num_active_requests


def get_state(request: Request) -> AppState:
    state: AppState = request.app.state.bitserve
    return state
