"""The model-memory budget (ServerConfig.max_models_memory_bytes) in numbers: what a load will take
before its real size is known, what the resident slots hold, and which idle alias an over-budget load
evicts first (least recently used). Host memory only: GPU replicas are placed by their device's free
memory. The ModelManager does the evicting.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping

from bitserve.config import EngineConfig, kv_cache_budget_estimate
from bitserve.engine.devices import CPU
from bitserve.errors import ModelUnavailable
from bitserve.lifecycle.aliases import Alias
from bitserve.lifecycle.model_files import ModelFile
from bitserve.lifecycle.slot import ModelSlot, SlotState


def load_bytes(source: ModelFile, engine_config: EngineConfig) -> int:
    """What loading `source` will take before its real size is known: file bytes + the KV cache budget."""
    return source.path.stat().st_size + kv_cache_budget_estimate(engine_config)


def resident_bytes(slots: Iterable[ModelSlot], engine_config: EngineConfig) -> int:
    """Host bytes of `slots`: a loaded slot's measured size, a placed one still loading its estimate."""
    total = 0
    for slot in slots:
        if slot.info is not None:
            total += slot.info.host_memory_bytes
        elif slot.state is SlotState.LOADING:  # placed, not yet loaded
            total += load_bytes(slot.source, engine_config) * slot.placement.count(CPU)
    return total


def least_recently_used_idle(aliases: Mapping[str, Alias], loading: str, busy: Container[str]) -> str | None:
    """The idle alias used least recently, other than `loading`: no admin action running on it, no
    lease on what it serves nor on the version beside it. None when every other alias is busy."""
    idle = [
        (entry.current.last_used, name)
        for name, entry in aliases.items()
        if name != loading
        and name not in busy
        and entry.current.num_leases == 0
        and (entry.previous is None or entry.previous.num_leases == 0)
    ]
    if not idle:
        return None
    _, victim = min(idle)
    return victim


def not_enough_memory(needed: int, resident: int, budget: int) -> ModelUnavailable:
    """The error for a load that does not fit even after every idle alias is evicted."""
    return ModelUnavailable(
        f"not enough model memory: {needed / 1e6:.0f} MB needed, "
        f"{resident / 1e6:.0f} of {budget / 1e6:.0f} MB in use by busy models",
        hint="unload a model, raise max_models_memory_bytes, or retry when traffic is lower",
    )
