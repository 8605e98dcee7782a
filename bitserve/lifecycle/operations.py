"""Operation: one admin action on the models (load, swap, rollback, unload) running in the
background, with the state and final result that `GET /v1/models/operations/{id}` and `wait=true`
report. OperationLog keeps the recent ones (bounded). Event-loop only.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from bitserve.errors import BitserveError

if TYPE_CHECKING:
    from bitserve.lifecycle.slot import ModelSlot

MAX_NUM_OPERATIONS_KEPT = 128


class OperationState(enum.Enum):
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


@dataclass(eq=False)
class Operation:
    id: str
    action: str  # load | swap | rollback | unload
    alias: str
    model: str | None  # the requested model reference (load, swap)
    state: OperationState = OperationState.RUNNING
    slot: ModelSlot | None = None  # the slot being brought up, for progress
    error: BitserveError | None = None
    result: dict[str, Any] = field(default_factory=dict)
    started_at: float = field(default_factory=time.time)
    finished_at: float | None = None
    _done: asyncio.Event = field(default_factory=asyncio.Event)

    def succeed(self, **result: Any) -> None:
        self.state, self.result, self.finished_at = OperationState.SUCCEEDED, result, time.time()
        self._done.set()

    def fail(self, error: BitserveError) -> None:
        self.state, self.error, self.finished_at = OperationState.FAILED, error, time.time()
        self._done.set()

    async def wait(self) -> None:
        await self._done.wait()

    @property
    def is_done(self) -> bool:
        return self._done.is_set()

    def describe(self) -> dict[str, Any]:
        slot = self.slot
        return {
            "id": self.id,
            "object": "model.operation",
            "action": self.action,
            "alias": self.alias,
            "model": self.model,
            "state": self.state.value,
            "phase": slot.phase if slot is not None and self.state is OperationState.RUNNING else None,
            "progress": 1.0
            if self.state is OperationState.SUCCEEDED
            else round(slot.progress, 3)
            if slot
            else 0.0,
            "error": None
            if self.error is None
            else {"message": self.error.message, "hint": self.error.hint, "type": type(self.error).__name__},
            "result": self.result,
            "started_at": round(self.started_at, 3),
            "finished_at": None if self.finished_at is None else round(self.finished_at, 3),
        }


class OperationLog:
    """The last MAX_NUM_OPERATIONS_KEPT operations by id (running ones are never dropped)."""

    def __init__(self) -> None:
        self._operations: OrderedDict[str, Operation] = OrderedDict()
        self._ids = itertools.count(1)

    def new(self, action: str, alias: str, model: str | None) -> Operation:
        operation = Operation(f"op-{next(self._ids)}", action, alias, model)
        self._operations[operation.id] = operation
        while len(self._operations) > MAX_NUM_OPERATIONS_KEPT:
            oldest = next((op_id for op_id, op in self._operations.items() if op.is_done), None)
            if oldest is None:
                break
            del self._operations[oldest]
        return operation

    def get(self, operation_id: str) -> Operation | None:
        return self._operations.get(operation_id)

    def running(self) -> list[Operation]:
        return [op for op in self._operations.values() if not op.is_done]
