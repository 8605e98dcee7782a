"""BatchStream: several admitted streams (one per prompt of a batched `/v1/completions` request) seen
as one, with OpenAI's choice numbering: choice j of prompt i is index i * n + j. Outputs arrive as
each prompt's engine steps produce them, interleaved; usage is the sum over the prompts.
An OutputStream like GenerationStream / RoutedStream: `next`, `async for`, `collect`, `close`, `on_close`."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Protocol

from bitserve.frontend.generation_stream import OutputStream, StreamTiming
from bitserve.outputs import CompletionOutput, RequestOutput


class ChoiceStream(Protocol):
    """What BatchStream needs of each prompt's stream (a RoutedStream or a GenerationStream)."""

    request_id: str
    on_close: Callable[[BaseException | None], None] | None

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def num_output_tokens(self) -> int: ...

    @property
    def timing(self) -> StreamTiming: ...

    async def next(self, timeout: float | None = None) -> RequestOutput | None: ...

    def close(self) -> None: ...


class BatchStream(OutputStream):
    """`streams[i]` serves prompt i with `num_choices` choices each; closing closes every one."""

    def __init__(self, request_id: str, streams: Sequence[ChoiceStream], num_choices: int) -> None:
        self.request_id = request_id
        self.streams = list(streams)
        self.num_choices = num_choices
        self.on_close: Callable[[BaseException | None], None] | None = None
        self.error: BaseException | None = None
        self._pending: dict[int, asyncio.Future[RequestOutput | None]] = {}  # prompt index -> its next()
        self._done: set[int] = set()
        self._cached: dict[int, int] = {}
        self._is_closed = False

    @property
    def num_prompt_tokens(self) -> int:
        return sum(stream.num_prompt_tokens for stream in self.streams)

    @property
    def num_output_tokens(self) -> int:
        return sum(stream.num_output_tokens for stream in self.streams)

    @property
    def timing(self) -> StreamTiming:
        """The batch as one request (tracing): first arrival, first token of any prompt, all tokens."""
        timings = [stream.timing for stream in self.streams]
        firsts = [t.first_token_at for t in timings if t.first_token_at is not None]
        arrival = min(t.arrival for t in timings)
        # the first schedule of any prompt, measured from the batch's arrival
        scheduled = [t.arrival + t.queue_s for t in timings if t.queue_s is not None]
        return StreamTiming(
            arrival=arrival,
            first_token_at=min(firsts) if firsts else None,
            last_token_at=max((t.last_token_at or 0.0 for t in timings), default=0.0) or None,
            num_output_tokens=sum(t.num_output_tokens for t in timings),
            queue_s=min(scheduled) - arrival if scheduled else None,
        )

    async def next(self, timeout: float | None = None) -> RequestOutput | None:
        """What any prompt's stream produced since the last call, re-indexed and merged; None on
        timeout; StopAsyncIteration once every prompt finished; the first error any of them raises."""
        if len(self._done) == len(self.streams) or self.error is not None:
            raise StopAsyncIteration
        for i, stream in enumerate(self.streams):
            if i not in self._done and i not in self._pending:
                self._pending[i] = asyncio.ensure_future(stream.next(None))
        finished, _ = await asyncio.wait(
            set(self._pending.values()), timeout=timeout, return_when=asyncio.FIRST_COMPLETED
        )
        if not finished:
            return None
        merged = RequestOutput(self.request_id, [], [], False)
        for i, task in sorted((i, t) for i, t in self._pending.items() if t in finished):
            del self._pending[i]
            try:
                output = task.result()
            except StopAsyncIteration:
                self._done.add(i)
                continue
            except BaseException as exc:
                self.error = exc
                raise
            assert output is not None  # next(None) returns an output or raises
            self._cached[i] = output.num_cached_tokens
            for choice in output.outputs:
                merged.add(self._reindex(i, choice))
            if output.finished:
                self._done.add(i)
        merged.num_cached_tokens = sum(self._cached.values())
        merged.finished = len(self._done) == len(self.streams)
        return merged

    def _reindex(self, prompt_index: int, choice: CompletionOutput) -> CompletionOutput:
        return CompletionOutput(
            prompt_index * self.num_choices + choice.index,
            choice.text,
            list(choice.token_ids),
            choice.finish_reason,
            choice.stop_reason,
            choice.logprobs,
        )

    def empty_result(self) -> RequestOutput:
        """What collect() fills: all len(streams) * n choices, empty."""
        total = len(self.streams) * self.num_choices
        return RequestOutput(self.request_id, [], [CompletionOutput(k) for k in range(total)], False)

    def close(self) -> None:
        """Close every prompt's stream (idempotent; unfinished ones are aborted), then on_close once."""
        if self._is_closed:
            return
        self._is_closed = True
        for task in self._pending.values():
            if not task.done():
                task.cancel()  # a cancelled next() leaves its item queued; the stream closes below
            elif not task.cancelled():
                task.exception()  # retrieved, so asyncio logs no "exception was never retrieved"
        self._pending.clear()
        for stream in self.streams:
            stream.close()
        if self.on_close is not None:
            self.on_close(self.error)
