"""ModelSlot: one loaded model version behind an alias (state, its replicas, one per device, and their
router; leases; facts for /v1/models), and Lease: a request's hold on a slot from alias resolution
until its generation ends. Event-loop only; the ModelManager owns the slots and their transitions.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from bitserve.engine.messages import Priority
from bitserve.errors import BitserveError, EngineDead, RequestFailed
from bitserve.frontend.device_router import DeviceRouter, Replica, RoutedStream
from bitserve.lifecycle.model_files import ModelFile
from bitserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from bitserve.engine.process import ServedModel
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
    backend: str  # of the first replica (each replica's is in ModelSlot.describe)
    devices: tuple[str, ...]  # one replica per device, in the order they were requested
    tensor_types: dict[str, int]  # GGML storage type -> number of tensors
    max_model_len: int
    vocab_size: int
    has_chat_template: bool
    memory_bytes: int  # estimate: file bytes + KV cache bytes, summed over the replicas
    host_memory_bytes: int  # the same for the replicas on the CPU (the --max-models-memory-bytes budget)
    created: int  # unix time of load, the OpenAI model object's `created`


def model_info(alias: str, version: str, replicas: Sequence[Replica]) -> SlotInfo:
    """Facts of a version from its replicas (the first one's file, spec and tokenizer: all the same)."""
    instance = replicas[0].instance
    loaded = instance.loaded
    types = Counter(info.ggml_type.name for info in loaded.gguf.tensors.values())
    return SlotInfo(
        id=alias,
        version=version,
        file_name=instance.path.name,
        architecture=loaded.spec.architecture,
        backend=loaded.backend.name,
        devices=tuple(replica.device for replica in replicas),
        tensor_types=dict(sorted(types.items())),
        max_model_len=instance.max_model_len,
        vocab_size=instance.tokenizer.vocab_size,
        has_chat_template=not isinstance(instance.chat_template, Exception),
        memory_bytes=sum(estimated_memory_bytes(replica.instance) for replica in replicas),
        host_memory_bytes=sum(
            estimated_memory_bytes(replica.instance) for replica in replicas if replica.device == "cpu"
        ),
        created=int(time.time()),
    )


def estimated_memory_bytes(instance: ServedModel) -> int:
    """What keeping `instance` resident costs: its weights (about the file's size: packed formats stay
    packed, the mmap'd parts are file pages) plus its KV cache."""
    return instance.path.stat().st_size + instance.kv_cache_bytes


@dataclass(eq=False)
class ModelSlot:
    """One version of one alias. Invariant: from READY on, `replicas` holds one replica per placed device
    (their engines stopped once UNLOADED); `router` routes over that same list."""

    slot_id: str  # "alias@version#n", unique for the manager's lifetime
    alias: str
    source: ModelFile
    state: SlotState = SlotState.LOADING
    phase: str = "queued"  # finer progress inside LOADING: placing, hashing, loading, validating, warming up
    progress: float = 0.0  # 0..1
    device_request: tuple[str, ...] = ()  # the devices as asked ("auto" unresolved): a swap repeats it
    placement: tuple[str, ...] = ()  # the resolved devices, once placed
    replicas: list[Replica] = field(default_factory=list)
    router: DeviceRouter = field(init=False)
    info: SlotInfo | None = None
    error: str | None = None
    num_leases: int = 0
    num_finished: int = 0  # requests that ended on this slot, and how many of them failed (probation)
    num_failed: int = 0
    last_used: float = field(default_factory=time.monotonic)
    created_at: float = field(default_factory=time.monotonic)
    owns_instance: bool = True  # False for an instance the caller passed in (tests); never closed here
    _idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self._idle.set()
        self.router = DeviceRouter(self.replicas)

    @property
    def seconds_loading(self) -> float:
        """Seconds since this slot began loading (its age)."""
        return round(time.monotonic() - self.created_at, 1)

    @property
    def version(self) -> str:
        return self.info.version if self.info is not None else self.source.version

    @property
    def instance(self) -> ServedModel | None:
        """The first replica's instance: tokenizer, chat template and limits (the same on every replica)."""
        return self.replicas[0].instance if self.replicas else None

    @property
    def engines(self) -> list[AsyncEngine]:
        return [replica.engine for replica in self.replicas]

    @property
    def has_live_replica(self) -> bool:
        return any(replica.is_alive for replica in self.replicas)

    @property
    def dead_devices(self) -> list[str]:
        return [replica.device for replica in self.replicas if not replica.is_alive]

    @property
    def is_routable(self) -> bool:
        return self.state is SlotState.READY and self.has_live_replica

    @property
    def itl_totals(self) -> tuple[float, int]:
        """Inter-token latency sum and count over every replica's finished requests (probation)."""
        return (
            sum(engine.itl_sum_s for engine in self.engines),
            sum(engine.itl_count for engine in self.engines),
        )

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
        devices = list(self.placement or self.device_request)
        return {
            "slot_id": self.slot_id,
            "state": self.state.value,
            "phase": self.phase,
            "progress": round(self.progress, 3),
            "version": self.version,
            "file": info.file_name if info else self.source.path.name,
            "architecture": info.architecture if info else None,
            "quant_formats": sorted(info.tensor_types) if info else [],
            "device": devices[0] if devices else None,
            "devices": devices,
            "backend": info.backend if info else None,
            "memory_bytes": info.memory_bytes if info else None,
            "num_active_requests": self.num_leases,
            "replicas": [describe_replica(replica) for replica in self.replicas],
            "error": self.error,
        }


def describe_replica(replica: Replica) -> dict[str, Any]:
    """One replica as /v1/models and /health show it: device, backend, health and the router's inputs."""
    engine = replica.engine
    return {
        "device": replica.device,
        "backend": replica.instance.loaded.backend.name,
        "kernels": replica.instance.loaded.backend.describe(),  # ISA variant, block-weight activations
        "kv_cache": replica.instance.kv_cache_description,  # tokens it holds, bytes, dtype
        "is_alive": engine.is_alive,
        "is_draining": engine.is_draining,
        "num_active_requests": engine.num_active_requests,
        "mean_step_time_s": None if engine.mean_step_time_s is None else round(engine.mean_step_time_s, 6),
        "seconds_since_progress": round(engine.seconds_since_progress, 3),
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
    def instance(self) -> ServedModel:
        """Tokenizer, chat template and limits of the leased version (the same on every replica)."""
        instance = self.slot.instance
        assert instance is not None, "a lease is only handed out on a READY slot"
        return instance

    def submit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str,
        priority: Priority = Priority.NORMAL,
        deadline: float | None = None,
        prompt_param: str = "prompt",
        device: str | None = None,
    ) -> RoutedStream:
        """Route one request to a replica of the leased version (DeviceRouter.submit: `device` is the
        request's hint); the lease is released when the stream closes."""
        stream = self.slot.router.submit(
            prompt_token_ids,
            params,
            request_id=request_id,
            priority=priority,
            deadline=deadline,
            prompt_param=prompt_param,
            device=device,
        )
        stream.on_close = self.finish
        return stream

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
