"""AppState: what the HTTP handlers share (the engine once loaded and warmed, configs, the stats
sink, build and model info, readiness, drain). app.py builds it; handlers reach it via get_state().
"""

from __future__ import annotations

import asyncio
import logging
import platform
import subprocess
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from fastapi import Request

import bitserve
from bitserve.catalog import CATALOG
from bitserve.config import EngineConfig, ServerConfig
from bitserve.errors import EngineDead, ModelNotFound, ModelUnavailable
from bitserve.frontend.async_engine import AsyncEngine
from bitserve.metrics.stats import StatsSink
from bitserve.model_instance import ModelInstance
from bitserve.server.errors import ServerShuttingDown
from bitserve.server.streaming import StreamRegistry

logger = logging.getLogger(__name__)

DRAIN_POLL_S = 0.1
DEADLINE_GRACE_S = 2.0  # after the drain deadline, time for ended streams to send their error event


class MetricsSink(StatsSink, Protocol):
    """The StatsSink the server needs: it also counts HTTP errors and renders /metrics."""

    def record_http_error(self, status: int, reason: str) -> None: ...

    def render(self) -> tuple[bytes, str]: ...


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
    return BuildInfo(bitserve.__version__, sha or "unknown", torch.__version__, platform.python_version())


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """Facts about the served model, fixed at load (no directories: file name only)."""

    id: str
    file_name: str
    architecture: str
    backend: str
    tensor_types: dict[str, int]  # GGML storage type -> number of tensors
    max_model_len: int
    vocab_size: int
    has_chat_template: bool
    created: int  # unix time of load, the OpenAI model object's `created`


def served_model_id(instance: ModelInstance, served_model_name: str | None) -> str:
    if served_model_name:
        return served_model_name
    return instance.name if instance.name in CATALOG else Path(instance.name).stem


def model_info(instance: ModelInstance, served_model_name: str | None) -> ModelInfo:
    loaded = instance.loaded
    types = Counter(info.ggml_type.name for info in loaded.gguf.tensors.values())
    return ModelInfo(
        id=served_model_id(instance, served_model_name),
        file_name=instance.path.name,
        architecture=loaded.spec.architecture,
        backend=loaded.backend.name,
        tensor_types=dict(sorted(types.items())),
        max_model_len=instance.max_model_len,
        vocab_size=instance.tokenizer.vocab_size,
        has_chat_template=not isinstance(instance.chat_template, Exception),
        created=int(time.time()),
    )


@dataclass
class AppState:
    server_config: ServerConfig
    engine_config: EngineConfig
    stats: MetricsSink
    build: BuildInfo
    engine: AsyncEngine | None = None  # set once the model is loaded and warmed
    model: ModelInfo | None = None
    load_error: str | None = None
    is_draining: bool = False
    registry: StreamRegistry = field(default_factory=StreamRegistry)
    started_at: float = field(default_factory=time.time)

    @property
    def phase(self) -> str:
        """loading | failed | ready | draining | dead."""
        if self.load_error is not None:
            return "failed"
        if self.engine is None:
            return "loading"
        if not self.engine.is_alive:
            return "dead"
        return "draining" if self.is_draining else "ready"

    def require_engine(self) -> AsyncEngine:
        """The engine, or the error a new request gets now (503 while loading, draining or dead)."""
        if self.load_error is not None:
            raise ModelUnavailable(
                "the model failed to load", hint="see the server log; the server needs a restart"
            )
        if self.engine is None:
            raise ModelUnavailable(
                "the model is still loading", hint="retry after the number of seconds in Retry-After"
            )
        if self.is_draining:
            raise ServerShuttingDown("the server is shutting down and accepts no new requests",
                                     hint="retry on another replica")  # fmt: skip
        if not self.engine.is_alive:
            raise EngineDead("the model's engine has failed", hint="the server must be restarted")
        return self.engine

    def require_instance(self) -> ModelInstance:
        """The loaded model for work that needs no engine step (tokenize), draining or not."""
        if self.engine is None:
            self.require_engine()  # raises the loading / failed error
        assert self.engine is not None
        return self.engine.instance

    def check_model(self, name: str | None) -> None:
        """A request's `model` must be the served id (or absent)."""
        if name is None or (self.model is not None and name == self.model.id):
            return
        served = self.model.id if self.model is not None else "(loading)"
        raise ModelNotFound(f"the model {name[:100]!r} does not exist on this server", param="model",
                            hint=f"this server serves {served!r}; see GET /v1/models")  # fmt: skip

    def retry_after_s(self) -> float | None:
        return self.engine.expected_wait_s() if self.engine is not None else None

    def begin_drain(self) -> None:
        """Readiness fails and new generations get 503 from now on."""
        self.is_draining = True
        if self.engine is not None:
            self.engine.is_draining = True

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
        error = ServerShuttingDown(f"the server shut down before the request finished (drain timeout {timeout_s:g} s)",
                                   hint="retry on another replica")  # fmt: skip
        num_ended = self.registry.expire(error)
        logger.warning("drain deadline: ending %d request(s) still in flight", num_ended)
        grace = loop.time() + DEADLINE_GRACE_S
        while self._num_active() > 0 and loop.time() < grace:
            await asyncio.sleep(DRAIN_POLL_S / 2)

    def _num_active(self) -> int:
        return self.engine.num_active_requests if self.engine is not None else 0


def get_state(request: Request) -> AppState:
    state: AppState = request.app.state.bitserve
    return state
