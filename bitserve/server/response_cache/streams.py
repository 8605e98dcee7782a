"""The cache seen as streams, so the serving pipeline sends a cached answer exactly as a generated one
(the same formats, SSE chunks, usage and [DONE]): ReplayStream gives a stored answer as one finished
output; RecordingStream passes a generation through and hands its answer over once it is complete."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bitserve.frontend.batch_stream import BatchStream
from bitserve.frontend.device_router import RoutedStream
from bitserve.frontend.generation_stream import OutputStream, StreamTiming
from bitserve.outputs import CompletionOutput, RequestOutput
from bitserve.server.response_cache.entry import CachedCompletion


class ReplayStream(OutputStream):
    """A cached answer: every choice, whole and finished, in the first `next()`; then the end."""

    def __init__(self, request_id: str, entry: CachedCompletion) -> None:
        self.request_id = request_id
        self.entry = entry
        self.on_close: Callable[[BaseException | None], None] | None = None
        self.error: BaseException | None = None
        self.timing = StreamTiming()
        self.timing.record_tokens(self.num_output_tokens, self.timing.arrival)
        self._is_sent = self._is_closed = False

    @property
    def num_prompt_tokens(self) -> int:
        return self.entry.num_prompt_tokens

    @property
    def num_output_tokens(self) -> int:
        return sum(len(output.token_ids) for output in self.entry.outputs)

    async def next(self, timeout: float | None = None) -> RequestOutput | None:
        if self._is_sent:
            raise StopAsyncIteration
        self._is_sent = True
        return self.entry.request_output(self.request_id)

    def empty_result(self) -> RequestOutput:
        empty = [CompletionOutput(output.index) for output in self.entry.outputs]
        return RequestOutput(self.request_id, [], empty, False)

    def close(self) -> None:
        if self._is_closed:
            return
        self._is_closed = True
        if self.on_close is not None:
            self.on_close(None)


class RecordingStream(OutputStream):
    """`inner`, unchanged to its reader; its outputs are merged aside and, when the finished one
    arrives, `on_complete(result)` gets the whole answer (which keeps it only if every choice ended
    with stop or length). An error, a deadline or a close before the end hands over nothing."""

    def __init__(
        self, inner: RoutedStream | BatchStream, on_complete: Callable[[RequestOutput], None]
    ) -> None:
        self.inner = inner
        self.on_complete = on_complete
        self._result = inner.empty_result()

    def __getattr__(self, name: str) -> Any:
        """request_id, num_prompt_tokens, num_output_tokens, timing, error: the inner stream's."""
        return getattr(self.inner, name)

    @property
    def on_close(self) -> Callable[[BaseException | None], None] | None:
        return self.inner.on_close

    @on_close.setter
    def on_close(self, callback: Callable[[BaseException | None], None] | None) -> None:
        self.inner.on_close = callback

    async def next(self, timeout: float | None = None) -> RequestOutput | None:
        output = await self.inner.next(timeout)
        if output is not None:
            self._result.merge(output)
            if output.finished:
                self.on_complete(self._result)
        return output

    def empty_result(self) -> RequestOutput:
        return self.inner.empty_result()

    def close(self) -> None:
        self.inner.close()
