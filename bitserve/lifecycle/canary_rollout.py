"""The canary's actions for the ModelManager: stage a version beside the stable one (a swap with
`canary`), watch it against the stable version, promote it (the swap's flip, then the usual
probation) or roll it back (retire it; the stable version never stopped serving). The verdicts are
lifecycle/canary.py's; every end of a canary is recorded as a lifecycle event (canary_promote,
canary_rollback) beside the swaps'.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Protocol

from bitserve.config import ServerConfig
from bitserve.errors import BitserveError, Conflict
from bitserve.lifecycle.aliases import Alias
from bitserve.lifecycle.canary import Canary, CanaryPolicy, VersionSample, canary_verdict
from bitserve.lifecycle.model_files import ModelFile
from bitserve.lifecycle.operations import Operation
from bitserve.lifecycle.slot import ModelSlot

logger = logging.getLogger(__name__)


class RolloutHost(Protocol):
    """What the canary needs of the ModelManager (which owns it: no import back, no cycle)."""

    aliases: dict[str, Alias]
    config: ServerConfig

    async def _bring_up(
        self, operation: Operation, source: ModelFile, devices: tuple[str, ...], *, validate: bool
    ) -> ModelSlot: ...

    async def _retire(self, slot: ModelSlot) -> None: ...

    async def _probation_then_retire(self, entry: Alias, new: ModelSlot, old: ModelSlot) -> None: ...

    def _flip(self, entry: Alias, new: ModelSlot) -> ModelSlot: ...

    def _record(
        self, action: str, alias: str, version: str, result: str, duration_s: float | None = None
    ) -> None: ...

    def _publish(self) -> None: ...

    def _spawn(self, coroutine: Any) -> None: ...


CANARY_POLL_S = 0.1


class CanaryRollouts:
    def __init__(self, manager: RolloutHost) -> None:
        self.manager = manager

    async def stage(
        self,
        operation: Operation,
        source: ModelFile,
        devices: tuple[str, ...],
        *,
        validate: bool,
        weight: float,
        window_s: float | None,
    ) -> dict[str, Any]:
        """Load and validate `source` beside the alias's stable version, then give it `weight` of the
        traffic; the watcher decides the rest."""
        manager, alias = self.manager, operation.alias
        try:
            slot = await manager._bring_up(operation, source, devices, validate=validate)
        except BitserveError:
            manager._record("canary", alias, source.version, "rejected")
            raise
        entry = manager.aliases.get(alias)
        if entry is None:  # unloaded while the canary loaded (an admin action on it is refused, but eviction)
            await manager._retire(slot)
            raise Conflict(f"{alias!r} is no longer served", param="alias")
        stable = entry.current
        policy = CanaryPolicy.from_config(manager.config, window_s)
        canary = Canary(slot, weight, policy, VersionSample.of(stable), VersionSample.of(slot))
        entry.canary = canary
        manager._record("canary", alias, slot.version, "success")
        logger.info(
            "canary for %r: version %s takes %.1f%% of its requests beside %s for %g s",
            alias,
            slot.version,
            weight * 100,
            stable.version,
            policy.window_s,
        )
        manager._spawn(self.watch(entry, canary))
        return {"version": stable.version, "canary": canary.describe(stable)}

    async def watch(self, entry: Alias, canary: Canary) -> None:
        """Until the canary ends (an admin promoted it or rolled it back): its verdict, each poll."""
        while entry.canary is canary:
            decision, reason = canary_verdict(canary, entry.current, time.monotonic())
            if decision == "rollback":
                logger.error(
                    "canary %s of %r failed (%s): rolling back",
                    canary.slot.version,
                    canary.slot.alias,
                    reason,
                )
                await self.end(entry, canary, "canary_rollback")
                return
            if decision == "promote":
                logger.info("canary %s of %r promoted: %s", canary.slot.version, canary.slot.alias, reason)
                self.promote_now(entry, canary)
                return
            await asyncio.sleep(CANARY_POLL_S)

    async def end(self, entry: Alias, canary: Canary, action: str) -> None:
        """Stop routing to the canary and retire it (its in-flight requests finish first)."""
        entry.canary = None
        self.manager._record(action, canary.slot.alias, canary.slot.version, "success")
        await self.manager._retire(canary.slot)

    def promote_now(self, entry: Alias, canary: Canary) -> str:
        """Flip the alias to the canary (the swap's flip: the stable version drains, probation watches
        the promoted one); returns the version flipped away from."""
        manager = self.manager
        entry.canary = None
        old = manager._flip(entry, canary.slot)
        manager._record("canary_promote", canary.slot.alias, canary.slot.version, "success")
        manager._publish()
        manager._spawn(manager._probation_then_retire(entry, canary.slot, old))
        return old.version

    def _staged(self, operation: Operation) -> tuple[Alias, Canary]:
        entry = self.manager.aliases[operation.alias]
        if entry.canary is None:
            raise Conflict(
                f"{operation.alias!r} has no canary", param="alias", hint="swap with a canary first"
            )
        return entry, entry.canary

    async def promote(self, operation: Operation) -> dict[str, Any]:
        entry, canary = self._staged(operation)
        previous = self.promote_now(entry, canary)
        return {"version": canary.slot.version, "previous_version": previous}

    async def roll_back(self, operation: Operation) -> dict[str, Any]:
        entry, canary = self._staged(operation)
        await self.end(entry, canary, "canary_rollback")
        return {"version": entry.current.version, "rolled_back_from": canary.slot.version, "reloaded": False}
