"""Alias: what one alias serves now and the version before it (for rollback), and the flips between
them that swaps, rollbacks and probation make; the alias-name check. Event-loop only: a flip is plain
assignments, so no request sees an alias half flipped. The ModelManager owns the aliases.
"""

from __future__ import annotations

from dataclasses import dataclass

from bitserve.errors import InvalidRequest
from bitserve.lifecycle.model_files import ModelFile
from bitserve.lifecycle.slot import ModelSlot, SlotState

MAX_ALIAS_CHARS = 128


@dataclass(eq=False)
class Alias:
    """What an alias serves now, and the version before it (for rollback)."""

    current: ModelSlot
    previous: ModelSlot | None = None  # still resident: during probation, or while it drains
    previous_source: ModelFile | None = None  # the version a later rollback reloads
    previous_devices: tuple[str, ...] = ()  # and the devices it asked for

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
