"""The client's methods, written once for Client and AsyncClient: each is a generator of steps (a
`Call` to send, or a `Pause` to sleep) that a client drives, blocking (Client) or with asyncio
(AsyncClient); the two cannot drift apart. Each method returns its typed answer from Client and an
awaitable of it from AsyncClient (`Reply[T]`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict, TypeVar, Union, Unpack

from bitserve.client import calls
from bitserve.client.calls import Call, Deadline, Placement, settled
from bitserve.client.schema import (
    Batch,
    BatchResult,
    Detokenized,
    Health,
    Model,
    ModelList,
    Operation,
    Probe,
    Stats,
    Tokenized,
)

T = TypeVar("T")
Reply = Union[T, Awaitable[T]]  # noqa: UP007 - a generic alias: T from Client, Awaitable[T] from AsyncClient
OperationCallback = Callable[[Operation], None]
BatchCallback = Callable[[Batch], None]


class Waiting(TypedDict, total=False):
    """How an admin action is awaited. wait (default True): poll its operation until it ends, raising
    OperationFailed if it failed (False: return the running operation); on_progress: called with each
    polled state; timeout_s: WaitTimeout past it (the action goes on)."""

    wait: bool
    on_progress: OperationCallback | None
    timeout_s: float | None


@dataclass(frozen=True, slots=True)
class Pause:
    seconds: float


Steps = Generator[Union[Call[Any], Pause], Any, T]  # noqa: UP007


def one(call: Call[T]) -> Steps[T]:
    result: T = yield call
    return result


class ClientMethods:
    """Every call of bitserve.Client. Subclasses give `_drive(steps)`; `poll_s` spaces the polls."""

    poll_s: float

    def _drive(self, steps: Steps[T]) -> Reply[T]:
        raise NotImplementedError

    # ----------------------------------------------------------------- models

    def list_models(self) -> Reply[ModelList]:
        """Every alias (what serves, the previous and pending versions) and the running operations."""
        return self._drive(one(calls.list_models()))

    def model(self, alias: str) -> Reply[Model]:
        return self._drive(one(calls.get_model(alias)))

    def load(
        self,
        model: str,
        *,
        alias: str | None = None,
        device: str | None = None,
        devices: Sequence[str] | None = None,
        validate: bool = True,
        **waiting: Unpack[Waiting],
    ) -> Reply[Operation]:
        """Load `model` (a registered or catalog name, or a path inside a model root) beside what
        serves, as `alias`. With `wait`, poll until it ends (`on_progress` sees each state) and raise
        OperationFailed if it failed; else return the running operation."""
        call = calls.load_model(model, alias, Placement(device, devices), validate)
        return self._drive(self._operation(call, **waiting))

    def swap(
        self,
        alias: str,
        model: str,
        *,
        device: str | None = None,
        devices: Sequence[str] | None = None,
        validate: bool = True,
        **waiting: Unpack[Waiting],
    ) -> Reply[Operation]:
        """Replace what `alias` serves with `model` (validated first; the old version drains)."""
        call = calls.swap_model(alias, model, Placement(device, devices), validate)
        return self._drive(self._operation(call, **waiting))

    def rollback(self, alias: str, **waiting: Unpack[Waiting]) -> Reply[Operation]:
        """Serve `alias`'s previous version again."""
        return self._drive(self._operation(calls.alias_action(alias, "rollback"), **waiting))

    def unload(self, alias: str, **waiting: Unpack[Waiting]) -> Reply[Operation]:
        """Drain `alias`, then free it."""
        return self._drive(self._operation(calls.alias_action(alias, "unload"), **waiting))

    def operation(self, operation_id: str) -> Reply[Operation]:
        return self._drive(one(calls.get_operation(operation_id)))

    def wait_operation(
        self,
        operation: Operation | str,
        *,
        on_progress: OperationCallback | None = None,
        timeout_s: float | None = None,
    ) -> Reply[Operation]:
        """Poll until the operation ends; raise OperationFailed if it failed, WaitTimeout past `timeout_s`."""
        return self._drive(self._wait_operation(operation, on_progress, timeout_s))

    def _operation(
        self,
        call: Call[Operation],
        wait: bool = True,
        on_progress: OperationCallback | None = None,
        timeout_s: float | None = None,
    ) -> Steps[Operation]:
        operation: Operation = yield call
        if not wait:
            return operation
        return (yield from self._wait_operation(operation, on_progress, timeout_s))

    def _wait_operation(
        self, operation: Operation | str, on_progress: OperationCallback | None, timeout_s: float | None
    ) -> Steps[Operation]:
        deadline = Deadline(timeout_s)
        current = operation if isinstance(operation, Operation) else (yield calls.get_operation(operation))
        while True:
            if on_progress is not None:
                on_progress(current)
            if current.is_done:
                return settled(current)
            deadline.check(f"{current.action} {current.alias}")
            yield Pause(self.poll_s)
            current = yield calls.get_operation(current.id)

    # ----------------------------------------------------------------- health, stats, tokenizer

    def health(self) -> Reply[Health]:
        return self._drive(one(calls.health()))

    def live(self) -> Reply[Probe]:
        return self._drive(one(calls.probe("live")))

    def ready(self) -> Reply[Probe]:
        return self._drive(one(calls.probe("ready")))

    def stats(self) -> Reply[Stats]:
        return self._drive(one(calls.stats()))

    def metrics(self) -> Reply[str]:
        """The Prometheus text of /metrics."""
        return self._drive(one(calls.metrics()))

    def tokenize(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict[str, Any]] | None = None,
        model: str | None = None,
        add_special_tokens: bool = True,
    ) -> Reply[Tokenized]:
        """Token ids of `prompt`, or of `messages` rendered with the model's chat template."""
        return self._drive(one(calls.tokenize(prompt, messages, model, add_special_tokens)))

    def detokenize(self, tokens: Sequence[int], *, model: str | None = None) -> Reply[Detokenized]:
        return self._drive(one(calls.detokenize(tokens, model)))

    # ----------------------------------------------------------------- batches (needs the Batch API)

    def create_batch_from_requests(
        self,
        bodies: Sequence[dict[str, Any]],
        *,
        endpoint: str = "/v1/chat/completions",
        completion_window: str = "24h",
        custom_ids: Sequence[str] | None = None,
        metadata: dict[str, str] | None = None,
    ) -> Reply[Batch]:
        """Upload the request bodies as a batch input file (custom ids "request-0", ... unless given)
        and start a batch on it. Raises BatchAPIUnavailable when the server has no Batch API."""
        content = calls.batch_jsonl(bodies, endpoint, custom_ids)
        return self._drive(self._create_batch(content, endpoint, completion_window, metadata))

    def _create_batch(
        self, content: bytes, endpoint: str, completion_window: str, metadata: dict[str, str] | None
    ) -> Steps[Batch]:
        uploaded = yield calls.upload_batch_file(content)
        return (yield calls.create_batch(uploaded.id, endpoint, completion_window, metadata))

    def batch(self, batch_id: str) -> Reply[Batch]:
        return self._drive(one(calls.get_batch(batch_id)))

    def cancel_batch(self, batch_id: str) -> Reply[Batch]:
        return self._drive(one(calls.cancel_batch(batch_id)))

    def wait_batch(
        self,
        batch_id: str,
        *,
        on_progress: BatchCallback | None = None,
        timeout_s: float | None = None,
        poll_s: float | None = None,
    ) -> Reply[Batch]:
        """Poll until the batch is completed, failed, expired or cancelled (returned either way)."""
        return self._drive(self._wait_batch(batch_id, on_progress, timeout_s, poll_s or self.poll_s))

    def _wait_batch(
        self, batch_id: str, on_progress: BatchCallback | None, timeout_s: float | None, poll_s: float
    ) -> Steps[Batch]:
        deadline = Deadline(timeout_s)
        while True:
            batch: Batch = yield calls.get_batch(batch_id)
            if on_progress is not None:
                on_progress(batch)
            if batch.is_done:
                return batch
            deadline.check(f"batch {batch_id}")
            yield Pause(poll_s)

    def batch_results(self, batch_id: str) -> Reply[list[BatchResult]]:
        """Every answer of a finished batch: its output file's lines, then its error file's."""
        return self._drive(self._batch_results(batch_id))

    def _batch_results(self, batch_id: str) -> Steps[list[BatchResult]]:
        batch: Batch = yield calls.get_batch(batch_id)
        results: list[BatchResult] = []
        for file_id in calls.result_files(batch):
            results.extend((yield calls.file_results(file_id)))
        return results
