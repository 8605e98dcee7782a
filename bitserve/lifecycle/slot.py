"""ModelSlot: one loaded model version behind an alias (state, engine, leases, facts for /v1/models),
and Lease: a request's hold on a slot from alias resolution until its generation ends. Event-loop
only; the ModelManager owns the slots and their transitions.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from bitserve.errors import BitserveError, EngineDead, RequestFailed
from bitserve.lifecycle.model_files import ModelFile

if TYPE_CHECKING:
    from bitserve.engine.instance import ModelInstance
    from bitserve.frontend.async_engine import AsyncEngine


class SlotState(enum.Enum):
    LOADING = "loading"  # load or validation running in a worker thread; not routable
    READY = "ready"  # routable when its alias points at it
    DRAINING = "draining"  # no new requests; in-flight ones finish; kept resident during probation
    UNLOADED = "unloaded"  # engine stopped, weights freed
    FAILED = "failed"  # load or validation failed; never routable


def counts_as_model_failure(error: BaseException) -> bool:
    """Errors that count against a model version on probation: its engine died, a request failed in
    it, or anything unexpected; not a refusal, a bad request or a drain deadline."""
    return isinstance(error, (EngineDead, RequestFailed)) or not isinstance(error, BitserveError)


@dataclass(frozen=True, slots=True)
class SlotInfo:
    """Facts about a loaded model, fixed at load (no directories: file name only)."""

    id: str  # the alias clients send as `model`
    version: str  # short sha256 of the file
    file_name: str
    architecture: str
    backend: str
    tensor_types: dict[str, int]  # GGML storage type -> number of tensors
    max_model_len: int
    vocab_size: int
    has_chat_template: bool
    memory_bytes: int  # estimate: file bytes + KV cache bytes
    created: int  # unix time of load, the OpenAI model object's `created`


def model_info(alias: str, version: str, instance: ModelInstance) -> SlotInfo:
    loaded = instance.loaded
    types = Counter(info.ggml_type.name for info in loaded.gguf.tensors.values())
    return SlotInfo(
        id=alias,
        version=version,
        file_name=instance.path.name,
        architecture=loaded.spec.architecture,
        backend=loaded.backend.name,
        tensor_types=dict(sorted(types.items())),
        max_model_len=instance.max_model_len,
        vocab_size=instance.tokenizer.vocab_size,
        has_chat_template=not isinstance(instance.chat_template, Exception),
        memory_bytes=estimated_memory_bytes(instance),
        created=int(time.time()),
    )


def estimated_memory_bytes(instance: ModelInstance) -> int:
    """What keeping `instance` resident costs: its weights (about the file's size: packed formats stay
    packed, the mmap'd parts are file pages) plus its KV cache."""
    return instance.path.stat().st_size + instance.kv_cache_bytes


@dataclass(eq=False)
class ModelSlot:
    """One version of one alias. Invariant: `engine` is set from READY on until UNLOADED."""

    slot_id: str  # "alias@version#n", unique for the manager's lifetime
    alias: str
    source: ModelFile
    state: SlotState = SlotState.LOADING
    phase: str = "queued"  # finer progress inside LOADING: hashing, loading, validating
    progress: float = 0.0  # 0..1
    engine: AsyncEngine | None = None
    instance: ModelInstance | None = None
    info: SlotInfo | None = None
    error: str | None = None
    num_leases: int = 0
    num_finished: int = 0  # requests that ended on this slot, and how many of them failed (probation)
    num_failed: int = 0
    last_used: float = field(default_factory=time.monotonic)
    owns_instance: bool = True  # False for an instance the caller passed in (tests); never closed here
    _idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self._idle.set()

    @property
    def version(self) -> str:
        return self.info.version if self.info is not None else self.source.version

    @property
    def is_routable(self) -> bool:
        return self.state is SlotState.READY and self.engine is not None and self.engine.is_alive

    def acquire(self) -> Lease:
        self.num_leases += 1
        self.last_used = time.monotonic()
        self._idle.clear()
        return Lease(self)

    def _release(self, *, has_failed: bool) -> None:
        self.num_leases -= 1
        self.num_finished += 1
        self.num_failed += int(has_failed)
        self.last_used = time.monotonic()
        if self.num_leases == 0:
            self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """True when no lease is held (within `timeout_s`)."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except asyncio.TimeoutError:
            return False
        return True

    def describe(self) -> dict[str, Any]:
        info = self.info
        return {
            "slot_id": self.slot_id,
            "state": self.state.value,
            "phase": self.phase,
            "progress": round(self.progress, 3),
            "version": self.version,
            "file": info.file_name if info else self.source.path.name,
            "architecture": info.architecture if info else None,
            "quant_formats": sorted(info.tensor_types) if info else [],
            "device": "cpu",
            "backend": info.backend if info else None,
            "memory_bytes": info.memory_bytes if info else None,
            "num_active_requests": self.num_leases,
            "error": self.error,
        }


class Lease:
    """A request's hold on a slot: taken when its `model` resolves, released (once) when its
    generation ends. A slot is drained and freed only at zero leases, so a swap never pulls the
    model from under a request that already resolved to it."""

    __slots__ = ("slot", "_is_released")

    def __init__(self, slot: ModelSlot) -> None:
        self.slot = slot
        self._is_released = False

    @property
    def engine(self) -> AsyncEngine:
        assert self.slot.engine is not None, "a lease is only handed out on a READY slot"
        return self.slot.engine

    @property
    def info(self) -> SlotInfo:
        assert self.slot.info is not None
        return self.slot.info

    def finish(self, error: BaseException | None) -> None:
        """Release at the end of a generation; an engine failure (not an admission refusal, a bad
        request or a drain) counts against the version on probation."""
        self.release(has_failed=error is not None and counts_as_model_failure(error))

    def release(self, *, has_failed: bool = False) -> None:
        if not self._is_released:
            self._is_released = True
            self.slot._release(has_failed=has_failed)

    @contextlib.contextmanager
    def released_on_error(self) -> Iterator[Lease]:
        """For the code between acquire and the hand-off to a generation: any error releases."""
        try:
            yield self
        except BaseException:
            self.release()
            raise
