"""ModelManager: named slots behind aliases. Resolves a request's `model` to a lease on a READY slot;
loads, swaps, rolls back and unloads versions without failing a request; keeps resident models
within a memory budget (idle ones unloaded LRU). Runs on the event loop; loads run in a worker thread.

A swap: load beside (the old version keeps serving) -> validate -> flip the alias (one assignment)
-> the old version drains (leases run out) and, after the probation window, is freed. Probation
watches the new version and flips back while the old one is still resident. Admin actions on one
alias are serialized: a second one gets Conflict (409) at once.

A version runs on one or more devices (`device` / `devices`; `auto` resolved here, before any
EngineConfig is built): one replica each, all loaded, validated, flipped and drained together, so a
swap replaces every replica of an alias at once. The slot's DeviceRouter picks a replica per request.
The alias record and its flips live in lifecycle/aliases.py, the memory budget's sums in
lifecycle/memory_budget.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from bitserve import heap
from bitserve.config import EngineConfig, ServerConfig
from bitserve.engine.devices import CPU, DeviceProbe
from bitserve.engine.instance import ModelInstance
from bitserve.errors import (
    BitserveError,
    Conflict,
    EngineDead,
    ModelLoadError,
    ModelNotFound,
    ModelUnavailable,
    ServerShuttingDown,
)
from bitserve.frontend.async_engine import AsyncEngine
from bitserve.lifecycle.aliases import Alias, check_alias
from bitserve.lifecycle.canary import NO_HINTS, RoutingHints
from bitserve.lifecycle.canary_rollout import CanaryRollouts
from bitserve.lifecycle.memory_budget import (
    least_recently_used_idle,
    load_bytes,
    not_enough_memory,
    resident_bytes,
)
from bitserve.lifecycle.model_files import ModelFile, ModelFiles
from bitserve.lifecycle.operations import Operation, OperationLog
from bitserve.lifecycle.probation import ProbationPolicy, watch_probation
from bitserve.lifecycle.replicas import InstanceLoader, ReplicaBuilder
from bitserve.lifecycle.slot import Lease, ModelSlot, SlotState, model_info
from bitserve.metrics.stats import LifecycleEvent, SlotLabels, StatsSink

logger = logging.getLogger(__name__)


class ModelManager:
    """`probe` discovers devices (torch.cuda unless given: tests pass a fake); `load_instance` builds one
    replica from its EngineConfig (ModelInstance.load unless given). Both live on `self.replica_builder`."""

    def __init__(
        self,
        engine_config: EngineConfig,
        server_config: ServerConfig,
        stats: StatsSink,
        files: ModelFiles,
        *,
        probe: DeviceProbe | None = None,
        load_instance: InstanceLoader | None = None,
    ) -> None:
        self.engine_config = engine_config
        self.config = server_config
        self.stats = stats
        self.files = files
        self.replica_builder = ReplicaBuilder(engine_config, server_config, stats, probe, load_instance)
        self.aliases: dict[str, Alias] = {}
        self.default_alias: str | None = None
        self.operations = OperationLog()
        self.is_draining = False
        self._slots: list[ModelSlot] = []  # every resident or loading slot
        self._busy_aliases: set[str] = set()  # aliases with an admin action running
        self._tasks: set[asyncio.Task[Any]] = set()
        self._num_slots = 0
        self.canaries = CanaryRollouts(self)

    # ----------------------------------------------------------------- routing

    def acquire(self, name: str | None, hints: RoutingHints = NO_HINTS) -> Lease:
        """A lease on the READY slot `name` (the default alias when None; its canary's share by `hints`).
        Raises ModelNotFound (404), ModelUnavailable (503: loading, draining, shutting down) or EngineDead."""
        if self.is_draining:
            raise ServerShuttingDown(
                "the server is shutting down and accepts no new requests", hint="retry on another replica"
            )
        alias = name if name is not None else self.default_alias
        entry = self.aliases.get(alias) if alias is not None else None
        if entry is None:
            if alias is not None and any(
                slot.alias == alias and slot.state is SlotState.LOADING for slot in self._slots
            ):
                raise ModelUnavailable(
                    f"the model {alias[:100]!r} is still loading", hint="retry after Retry-After seconds"
                )
            available = ", ".join(sorted(self.aliases)) or "(none)"
            shown = "(default)" if alias is None else repr(alias[:100])
            raise ModelNotFound(
                f"the model {shown} does not exist on this server",
                param="model",
                hint=f"available: {available}",
            )
        slot = entry.serving_slot(alias, hints)
        if slot.replicas and not slot.has_live_replica:
            raise EngineDead(
                "the model's engine has failed", hint="roll back or reload the model; retry later"
            )
        if not slot.is_routable:
            raise ModelUnavailable(
                f"the model {slot.alias!r} is not ready", hint="retry after Retry-After seconds"
            )
        return slot.acquire()

    def resident_slots(self) -> list[ModelSlot]:
        return list(self._slots)

    def serving_engines(self) -> list[AsyncEngine]:
        """Every replica's engine of every resident version."""
        return [
            engine for slot in self._slots if slot.state is not SlotState.UNLOADED for engine in slot.engines
        ]

    @property
    def num_active_requests(self) -> int:
        return sum(slot.num_leases for slot in self._slots)

    # ----------------------------------------------------------------- admin actions

    def submit(
        self,
        action: str,
        alias: str,
        model: str | None = None,
        *,
        source: ModelFile | None = None,
        devices: str | Sequence[str] | None = None,
        **options: Any,
    ) -> Operation:
        """Start `action` on `alias` in the background; Conflict when one is already running there.
        `model` is resolved through the model files (403 outside the roots); `source` is taken as is.
        `devices` (load, swap): one device or several (replicas); a load defaults to the configured
        device, a swap to the devices the alias asked for. A bad or absent device is InvalidRequest."""
        check_alias(alias)
        if self.is_draining:
            raise ServerShuttingDown("the server is shutting down", hint="retry on another replica")
        if alias in self._busy_aliases:
            raise Conflict(
                f"another model operation is running on {alias!r}",
                param="alias",
                hint="wait for its operation to finish and retry",
            )
        runner = {
            "load": self._load,
            "swap": self._swap,
            "rollback": self._rollback,
            "unload": self._unload,
            "promote": self.canaries.promote,
        }[action]
        if action != "load" and alias not in self.aliases:
            raise ModelNotFound(
                f"no model is served as {alias!r}",
                param="alias",
                hint=f"available: {', '.join(sorted(self.aliases)) or '(none)'}",
            )
        if action == "load" and alias in self.aliases:
            raise Conflict(
                f"{alias!r} is already served", param="alias", hint="swap it to replace the version it serves"
            )
        if action == "swap" and self.aliases[alias].canary is not None:
            raise Conflict(f"{alias!r} has a canary", param="alias", hint="promote it or roll it back first")
        if action in ("load", "swap"):
            entry = self.aliases.get(alias)
            default = entry.current.device_request if entry is not None else None  # a swap keeps them
            options["devices"] = self.replica_builder.device_request(devices, default)
        if source is None and model is not None:
            source = self.files.resolve(model)
        operation = self.operations.new(action, alias, model or (source.name if source else None))
        self._busy_aliases.add(alias)
        self._spawn(self._run(operation, runner, source, **options))
        return operation

    async def _run(self, operation: Operation, runner: Any, source: ModelFile | None, **options: Any) -> None:
        try:
            result = (
                await runner(operation, source, **options)
                if source is not None
                else await runner(operation, **options)
            )
            heap.refreeze(f"after {operation.action} {operation.alias}")
            operation.succeed(**result)
        except BitserveError as exc:
            operation.fail(exc)
        except Exception as exc:  # noqa: BLE001 - reported on the operation; the serving path is untouched
            logger.exception("model operation %s failed", operation.id)
            operation.fail(ModelLoadError(f"{type(exc).__name__}: {exc}"))
        finally:
            self._busy_aliases.discard(operation.alias)
            self._publish()

    async def _load(
        self, operation: Operation, source: ModelFile, devices: tuple[str, ...], validate: bool = True
    ) -> dict[str, Any]:
        slot = await self._bring_up(operation, source, devices, validate=validate)
        self.aliases[operation.alias] = Alias(slot)
        if self.default_alias is None:
            self.default_alias = operation.alias
        logger.info("serving %s as %r (version %s)", source.path.name, operation.alias, slot.version)
        return {"version": slot.version, "slot_id": slot.slot_id, "devices": list(slot.placement)}

    async def _swap(
        self,
        operation: Operation,
        source: ModelFile,
        devices: tuple[str, ...],
        validate: bool = True,
        action: str = "swap",
        canary: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        if canary is not None:  # {"weight", "window_s"}: staged beside, not flipped (canary_rollout.py)
            return await self.canaries.stage(operation, source, devices, validate=validate, **canary)
        try:
            slot = await self._bring_up(operation, source, devices, validate=validate)
        except BitserveError:
            self._record(action, operation.alias, source.version, "rejected")
            raise
        entry = self.aliases[operation.alias]
        old = self._flip(entry, slot)
        self._record(action, operation.alias, slot.version, "success")
        logger.info("swapped %r: version %s -> %s", operation.alias, old.version, slot.version)
        self._spawn(self._probation_then_retire(entry, slot, old))
        return {
            "version": slot.version,
            "previous_version": old.version,
            "slot_id": slot.slot_id,
            "devices": list(slot.placement),
        }

    async def _rollback(self, operation: Operation) -> dict[str, Any]:
        entry = self.aliases[operation.alias]
        if entry.canary is not None:  # rolling back a canary retires it; the stable version serves on
            return await self.canaries.roll_back(operation)
        previous = entry.previous
        if previous is not None and previous.state is SlotState.DRAINING and previous.has_live_replica:
            current = entry.flip_back()
            self._record("rollback", operation.alias, previous.version, "success")
            self._spawn(self._retire(current))
            return {"version": previous.version, "rolled_back_from": current.version, "reloaded": False}
        if entry.previous_source is None:
            raise Conflict(f"{operation.alias!r} has no previous version", param="alias")
        result = await self._swap(
            operation, entry.previous_source, entry.previous_devices, validate=True, action="rollback"
        )
        return {
            "version": result["version"],
            "rolled_back_from": result["previous_version"],
            "reloaded": True,
        }

    async def _unload(self, operation: Operation) -> dict[str, Any]:
        entry = self._remove_alias(operation.alias)
        await asyncio.gather(*(self._retire(slot) for slot in entry.slots()))
        self._record("unload", operation.alias, entry.current.version, "success")
        return {"version": entry.current.version}

    # ----------------------------------------------------------------- flips

    def _flip(self, entry: Alias, new: ModelSlot) -> ModelSlot:
        """Point the alias at `new` (one assignment on the loop); the old slot starts draining."""
        if entry.previous is not None and entry.previous is not entry.current:
            self._spawn(self._retire(entry.previous))  # a third version: the oldest goes now
        return entry.flip_to(new)

    async def _probation_then_retire(self, entry: Alias, new: ModelSlot, old: ModelSlot) -> None:
        """Watch `new`; on failure flip back to `old` (still resident) and retire `new`; else retire `old`."""
        policy = ProbationPolicy.from_config(self.config)
        reason = await watch_probation(new, policy, lambda: entry.current is new and entry.previous is old)
        if (
            reason is not None
            and entry.current is new
            and entry.previous is old
            and self.aliases.get(new.alias) is entry
        ):
            logger.error(
                "probation failed for %r version %s (%s): rolling back to %s",
                new.alias,
                new.version,
                reason,
                old.version,
            )
            entry.flip_back()
            self._record("auto_rollback", new.alias, old.version, "success")
            self._publish()
            await self._retire(new)
            return
        if entry.previous is old:
            entry.previous = None
            await self._retire(old)

    # ----------------------------------------------------------------- load and free

    async def _bring_up(
        self, operation: Operation, source: ModelFile, devices: tuple[str, ...], *, validate: bool
    ) -> ModelSlot:
        """Load `source` as a new slot beside what serves, one replica per device, warm and validate
        each; READY on success. On any failure the slot is freed and the error raised; nothing else
        changes."""
        slot = self._new_slot(operation.alias, source, source.version)
        slot.device_request = devices
        operation.slot = slot
        self._slots.append(slot)
        start = time.monotonic()
        try:
            slot.phase = "placing"
            placements = await asyncio.to_thread(self.replica_builder.place, source, devices)
            placed = tuple(placement.device for placement in placements)
            await self._make_room(source, operation.alias, placed)
            slot.placement = placed  # from here its bytes count as resident (it is not in `needed` twice)
            slot.phase, slot.progress = "hashing", 0.05
            digest = await asyncio.to_thread(self.files.verify_sha256, source)
            await self.replica_builder.load(slot, source, placements)
            slot.info = model_info(slot.alias, digest[:12], slot.replicas)
            slot.phase, slot.progress = "validating", 0.8
            await self.replica_builder.check(slot, source.golden if validate else None)
        except BaseException as exc:
            slot.state, slot.error = SlotState.FAILED, f"{type(exc).__name__}: {exc}"
            logger.warning("loading %s as %r failed: %s", source.path.name, operation.alias, slot.error)
            self._record("load", operation.alias, source.version, "rejected")
            await self._free(slot)
            raise
        slot.state, slot.phase, slot.progress = SlotState.READY, "ready", 1.0
        self._record("load", operation.alias, slot.version, "success", time.monotonic() - start)
        return slot

    async def adopt(
        self,
        instances: ModelInstance | Mapping[str, ModelInstance],
        alias: str,
        version: str = "adopted",
    ) -> ModelSlot:
        """Serve instances loaded by the caller (tests): one, on its configured device, or a mapping of
        device label -> instance (replicas). They are warmed but never closed here."""
        replicas = (
            dict(instances) if isinstance(instances, Mapping) else {instances.config.model.device: instances}
        )
        first = next(iter(replicas.values()))
        slot = self._new_slot(alias, ModelFile(alias, first.path), version, owns_instance=False)
        slot.device_request = slot.placement = tuple(replicas)
        self._slots.append(slot)
        for device, instance in replicas.items():
            self.replica_builder.start(slot, device, instance)
        slot.info = model_info(alias, version, slot.replicas)
        await self.replica_builder.check(slot, None)
        slot.state, slot.phase, slot.progress = SlotState.READY, "ready", 1.0
        self.aliases[alias] = Alias(slot)
        self.default_alias = self.default_alias or alias
        self._publish()
        return slot

    async def _retire(self, slot: ModelSlot) -> None:
        """Drain `slot` (leases run out, or the deadline ends them with an error event), then free it."""
        if slot.state in (SlotState.UNLOADED, SlotState.FAILED):
            return
        slot.state = SlotState.DRAINING
        if not await slot.wait_idle(self.config.swap_drain_timeout_s) and slot.replicas:
            error = ModelUnavailable(
                f"the model version {slot.version} was unloaded before the request finished",
                hint="retry; the alias now serves another version",
            )
            num_ended = sum(engine.expire(error) for engine in slot.engines)
            logger.warning("drain deadline for %s: ended %d request(s)", slot.slot_id, num_ended)
            await slot.wait_idle(self.config.swap_drain_timeout_s)
        await self._free(slot)
        logger.info("unloaded %s", slot.slot_id)
        heap.refreeze(f"after unloading {slot.slot_id}")

    async def _free(self, slot: ModelSlot) -> None:
        for replica in slot.replicas:
            await replica.engine.shutdown()
            if slot.owns_instance:
                replica.instance.close()
        if slot.state is not SlotState.FAILED:
            slot.state = SlotState.UNLOADED
        if slot in self._slots:
            self._slots.remove(slot)
        siblings = [other for other in self._slots if other.alias == slot.alias]
        if not siblings:
            self.stats.forget_model(slot.alias)
            return
        for device in set(slot.placement).difference(*(other.placement for other in siblings)):
            self.stats.forget_model(slot.alias, device)  # e.g. swapped from [cuda:0, cpu] to [cpu]

    async def _make_room(self, source: ModelFile, alias: str, devices: tuple[str, ...]) -> None:
        """Unload idle aliases, least recently used first, until `source`'s replicas on the CPU fit the
        memory budget (host memory: GPU replicas are placed by their device's free memory)."""
        budget = self.config.max_models_memory_bytes
        if budget is None:
            return
        needed = load_bytes(source, self.engine_config) * devices.count(CPU)
        while resident_bytes(self._slots, self.engine_config) + needed > budget:
            victim = least_recently_used_idle(self.aliases, alias, self._busy_aliases)
            if victim is None:
                raise not_enough_memory(needed, resident_bytes(self._slots, self.engine_config), budget)
            entry = self._remove_alias(victim)
            logger.info(
                "evicting idle model %r (least recently used) to make room for %s", victim, source.path.name
            )
            for slot in entry.slots():
                await self._free(slot)
            self._record("evict", victim, entry.current.version, "success")

    def _new_slot(
        self, alias: str, source: ModelFile, version: str, *, owns_instance: bool = True
    ) -> ModelSlot:
        self._num_slots += 1
        slot = ModelSlot(f"{alias}@{version}#{self._num_slots}", alias, source, owns_instance=owns_instance)
        slot.router.max_stall_s = self.config.liveness_stall_s  # a wedged replica gets no new requests
        return slot

    def _remove_alias(self, alias: str) -> Alias:
        """Stop routing `alias` (new requests get 404); the default moves to another alias if it was this
        one."""
        entry = self.aliases.pop(alias)
        if self.default_alias == alias:
            self.default_alias = next(iter(self.aliases), None)
        return entry

    # ----------------------------------------------------------------- lifecycle of the manager

    def begin_drain(self) -> None:
        self.is_draining = True

    async def shutdown(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for slot in list(self._slots):
            await self._free(slot)
        self.aliases.clear()

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _record(
        self, action: str, alias: str, version: str, result: str, duration_s: float | None = None
    ) -> None:
        self.stats.record_lifecycle(LifecycleEvent(action, alias, version, result, duration_s))

    def _publish(self) -> None:
        self.stats.set_served_models(
            [
                SlotLabels(
                    name, entry.current.version, entry.current.info.file_name, entry.current.info.architecture
                )
                for name, entry in self.aliases.items()
                if entry.current.info is not None
            ]
        )

    def describe(self) -> list[dict[str, Any]]:
        """One entry per alias (what serves, plus the version beside it), then loads of new aliases."""
        entries = []
        for name, entry in sorted(self.aliases.items()):
            pending = [s.describe() for s in self._slots if s.alias == name and s.state is SlotState.LOADING]
            entries.append(
                {
                    "alias": name,
                    "is_default": name == self.default_alias,
                    **entry.current.describe(),
                    "previous": entry.previous.describe() if entry.previous is not None else None,
                    "canary": entry.canary.describe(entry.current) if entry.canary is not None else None,
                    "pending": pending[0] if pending else None,
                }
            )
        for slot in self._slots:
            if slot.alias not in self.aliases and slot.state is SlotState.LOADING:
                entries.append(
                    {
                        "alias": slot.alias,
                        "is_default": False,
                        **slot.describe(),
                        "previous": None,
                        "pending": None,
                    }
                )
        return entries
