"""GenerationStream: the one handle on an admitted request, as the HTTP layer and the lifecycle see it.

`AsyncEngine.submit` admits synchronously (errors raise before any response is sent) and returns one
of these. Consume it with `async for`, or `await next(timeout)` for keep-alives; `close()` ends it
however it ended: an unfinished request is aborted (the engine frees its blocks before its next
step), its stats are recorded, and `on_close(error)` runs once (a lease release, say).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from bitserve.errors import DeadlineExceeded
from bitserve.frontend.output_processor import ChoiceDelta
from bitserve.outputs import CompletionOutput, RequestOutput

DEADLINE_REASON = "deadline"  # the engine's finish reason, and the aborted-requests metric's label


def deadline_error() -> DeadlineExceeded:
    return DeadlineExceeded(
        "the request's deadline passed before it finished; it was aborted",
        param="timeout",
        hint="raise `timeout` / X-Request-Timeout, lower max_tokens, or retry when the server is less busy",
    )


@dataclass(slots=True)
class StreamTiming:
    """Arrival, first and last token times of one request (time.monotonic()), for its RequestStats."""

    arrival: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    last_token_at: float | None = None
    num_output_tokens: int = 0
    itl_sum_s: float = 0.0
    itl_count: int = 0
    queue_s: float | None = None  # arrival to first schedule (the engine's clock), from the first output

    def record_tokens(self, num_tokens: int, now: float) -> None:
        if self.first_token_at is None:
            self.first_token_at = now
        elif self.last_token_at is not None:
            self.itl_sum_s += now - self.last_token_at
            self.itl_count += 1
        self.last_token_at = now
        self.num_output_tokens += num_tokens


class OutputStream:
    """What every stream a caller reads shares: `async for` over `next()`, and `collect()`. Subclasses
    give `next(timeout)` (None = keep-alive tick), `close()` and `empty_result()`."""

    async def next(self, timeout: float | None = None) -> RequestOutput | None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def empty_result(self) -> RequestOutput:
        raise NotImplementedError

    def __aiter__(self) -> OutputStream:
        return self

    async def __anext__(self) -> RequestOutput:
        output = await self.next(None)
        assert output is not None  # no timeout, so next() returns an output or raises
        return output

    async def collect(self) -> RequestOutput:
        """Run to the end and return every choice's whole output (closes the stream)."""
        result = self.empty_result()
        try:
            async for output in self:
                result.merge(output)
        finally:
            self.close()
        return result


class GenerationStream(OutputStream):
    """RequestOutput deltas of one request; the last has `finished=True`. Raises the request's error
    (EngineDead, RequestFailed, a drain deadline) from `next` once it arrives."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        num_choices: int,
        *,
        model: str,
        end: Callable[[GenerationStream], None],
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.num_choices = num_choices
        self.model = model
        self.timing = StreamTiming()
        self.unfinished = set(range(num_choices))  # choice indexes still generating
        self.finish_reason = "abort"  # of the last choice to finish; "abort" if closed before
        self.error: BaseException | None = None
        # why an unfinished stream was closed, for bitserve_requests_aborted_total; the router sets
        # "replica_failover" when it moves the request to another replica
        self.abort_reason = "client_disconnect"
        self.on_close: Callable[[BaseException | None], None] | None = None
        # deltas and errors not yet read; `_waiter` is the reader's wake-up while it waits for one
        self._items: deque[ChoiceDelta | BaseException] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._num_cached_tokens = 0
        self._end = end
        self._is_closed = False

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return not self.unfinished

    # ----------------------------------------------------------------- producer side (AsyncEngine)

    def put(self, item: ChoiceDelta | BaseException) -> None:
        """Queue a delta or the request's error (on the event loop's thread) and wake the reader."""
        self._items.append(item)
        if self._waiter is not None:
            _resolve(self._waiter)

    # ----------------------------------------------------------------- consumer side

    async def next(self, timeout: float | None = None) -> RequestOutput | None:
        """Everything that arrived since the last call, merged; None on timeout (time for a
        keep-alive); StopAsyncIteration after the finished output; the request's error."""
        if self.is_finished or self.error is not None:
            raise StopAsyncIteration
        if not self._items and not await self._wait(timeout):
            return None
        items = list(self._items)
        self._items.clear()
        return self._merge(items)

    async def _wait(self, timeout: float | None) -> bool:
        """Wait until something is queued; False when `timeout` passed first.

        A plain future the producer resolves, not a task per wait (`ensure_future(queue.get())` plus
        `asyncio.wait` cost a task, a timer and three loop turns per token: at 100 streams of a GPU's
        steps that was a measurable share of the event loop). A cancellation (client disconnect)
        raises here and is never swallowed, which `asyncio.wait_for` up to Python 3.11 could do when
        the item arrived in the same turn; queued items stay queued.
        """
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        self._waiter = waiter
        timer = None if timeout is None else loop.call_later(timeout, _resolve, waiter)
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()
        return bool(self._items)

    def _merge(self, items: list[ChoiceDelta | BaseException]) -> RequestOutput:
        output = RequestOutput(self.request_id, self.prompt_token_ids, [], False, model=self.model)
        for item in items:
            if isinstance(item, BaseException):
                self.error = item
                raise item
            if item.output.finish_reason == DEADLINE_REASON:
                # an expired deadline is an error to the client (504 or an error event), not a finish
                self.abort_reason = DEADLINE_REASON
                self.error = deadline_error()
                raise self.error
            output.add(item.output, item.num_cached_tokens)
            if item.output.finish_reason is not None:
                self.unfinished.discard(item.output.index)
                self.finish_reason = item.output.finish_reason
        self._num_cached_tokens = max(self._num_cached_tokens, output.num_cached_tokens)
        output.num_cached_tokens = self._num_cached_tokens
        output.finished = self.is_finished
        return output

    def empty_result(self) -> RequestOutput:
        """A RequestOutput with this request's ids and one empty choice per choice (collect() fills it)."""
        return RequestOutput(
            self.request_id,
            self.prompt_token_ids,
            [CompletionOutput(index) for index in range(self.num_choices)],
            False,
            model=self.model,
        )

    def close(self) -> None:
        """End the stream (idempotent): abort what is unfinished, record stats, run on_close."""
        if self._is_closed:
            return
        self._is_closed = True
        self._end(self)
        if self.on_close is not None:
            self.on_close(self.error)


def _resolve(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
