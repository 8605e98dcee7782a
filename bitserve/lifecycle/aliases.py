"""Alias: what one alias serves now and the version before it (for rollback), and the flips between
them that swaps, rollbacks and probation make; the alias-name check. Event-loop only: a flip is plain
assignments, so no request sees an alias half flipped. The ModelManager owns the aliases.
"""

from __future__ import annotations

from dataclasses import dataclass

from bitserve.errors import InvalidRequest
from bitserve.lifecycle.canary import Canary, RoutingHints, VersionSample
from bitserve.lifecycle.model_files import ModelFile
from bitserve.lifecycle.slot import ModelSlot, SlotState
from bitserve.metrics.versions import VersionCounters

MAX_ALIAS_CHARS = 128


@dataclass(eq=False)
class Alias:
    """What an alias serves now, and the version before it (for rollback)."""

    current: ModelSlot
    previous: ModelSlot | None = None  # still resident: during probation, or while it drains
    previous_source: ModelFile | None = None  # the version a later rollback reloads
    previous_devices: tuple[str, ...] = ()  # and the devices it asked for
    canary: Canary | None = None  # a version staged beside `current`, taking a share of the requests

    def serving_slot(self, alias: str, hints: RoutingHints) -> ModelSlot:
        """The version this request goes to: the canary's share, else the current version."""
        canary = self.canary
        if canary is not None and canary.slot.is_routable and canary.routes_here(alias, hints):
            return canary.slot
        return self.current

    def slots(self) -> list[ModelSlot]:
        """Every resident version of the alias: current, previous, canary."""
        canary = self.canary.slot if self.canary is not None else None
        return [slot for slot in (self.current, self.previous, canary) if slot is not None]

    def version_counters(self, alias: str) -> list[VersionCounters]:
        """Each resident version's counters (metrics/versions.py), with its role and traffic share."""
        canary_weight = self.canary.weight if self.canary is not None else 0.0
        roles = [(self.current, "stable", 1.0 - canary_weight)]
        if self.canary is not None:
            roles.append((self.canary.slot, "canary", canary_weight))
        if self.previous is not None and self.previous is not self.current:
            roles.append((self.previous, "previous", 0.0))
        return [
            VersionSample.of(slot).counters(alias, slot.version, role, weight) for slot, role, weight in roles
        ]

    def flip_to(self, new: ModelSlot) -> ModelSlot:
        """Point the alias at `new`; the old slot starts draining and becomes the previous version.
        Returns the old slot."""
        old = self.current
        old.state = SlotState.DRAINING
        self.previous, self.previous_source, self.current = old, old.source, new
        self.previous_devices = old.device_request
        return old

    def flip_back(self) -> ModelSlot:
        """Serve the previous version again (still resident); the current one starts draining and is
        what a later rollback reloads. Returns the slot flipped away from."""
        assert self.previous is not None
        current, previous = self.current, self.previous
        previous.state = SlotState.READY
        current.state = SlotState.DRAINING
        self.current, self.previous, self.previous_source = previous, None, current.source
        self.previous_devices = current.device_request
        return current


def check_alias(alias: str) -> str:
    if not 0 < len(alias) <= MAX_ALIAS_CHARS or not alias.isprintable() or alias != alias.strip():
        raise InvalidRequest(f"alias must be 1..{MAX_ALIAS_CHARS} printable characters", param="alias")
    return alias
