"""A client disconnect must always stop a stream: the cancellation may land in the same loop turn as
the next output (the race asyncio.wait_for loses on Python <= 3.11 by returning the item)."""

from __future__ import annotations

import asyncio

import pytest

from bitserve.frontend.generation_stream import GenerationStream
from bitserve.frontend.output_processor import ChoiceDelta
from bitserve.outputs import CompletionOutput


def _stream() -> GenerationStream:
    return GenerationStream("r", [1, 2], 1, model="m", end=lambda stream: None)


def _delta(text: str) -> ChoiceDelta:
    return ChoiceDelta("r", CompletionOutput(0, text, [7]), 0)


def test_cancel_that_lands_with_an_item_is_not_swallowed() -> None:
    async def scenario() -> None:
        stream = _stream()
        waiter = asyncio.ensure_future(stream.next(5.0))
        await asyncio.sleep(0)  # the waiter is now blocked on the queue
        stream.put(_delta("output"))  # wakes it ...
        waiter.cancel()  # ... and the disconnect cancels it in the same turn
        with pytest.raises(asyncio.CancelledError):
            await waiter
        # the delta the cancelled read woke for is still there for a later read: nothing is lost
        output = await stream.next(0.01)
        assert output is not None and output.outputs[0].text == "output"

    asyncio.run(scenario())


def test_timeout_returns_none_and_keeps_later_items() -> None:
    async def scenario() -> None:
        stream = _stream()
        assert await stream.next(0.01) is None
        stream.put(_delta("out"))
        stream.put(_delta("put"))
        output = await stream.next(0.01)
        assert (
            output is not None
            and output.outputs[0].text == "output"
            and output.outputs[0].token_ids == [7, 7]
        )
        assert not output.finished

    asyncio.run(scenario())


def test_a_waiting_reader_wakes_on_put_and_queued_items_come_merged() -> None:
    async def scenario() -> None:
        stream = _stream()
        reader = asyncio.ensure_future(stream.next(None))  # no timeout: waits for the producer
        await asyncio.sleep(0.01)
        assert not reader.done()
        stream.put(_delta("a"))
        first = await asyncio.wait_for(reader, 1.0)
        assert first is not None and first.outputs[0].text == "a"
        stream.put(_delta("b"))
        stream.put(_delta("c"))
        second = await stream.next(None)  # already queued: returned at once, merged
        assert second is not None and second.outputs[0].text == "bc"

    asyncio.run(scenario())


def test_an_error_put_while_waiting_is_raised() -> None:
    async def scenario() -> None:
        stream = _stream()
        reader = asyncio.ensure_future(stream.next(5.0))
        await asyncio.sleep(0)
        stream.put(RuntimeError("engine died"))
        with pytest.raises(RuntimeError, match="engine died"):
            await reader
        with pytest.raises(StopAsyncIteration):  # the error ends the stream
            await stream.next(0.01)

    asyncio.run(scenario())


def test_close_runs_its_callbacks_once() -> None:
    ended: list[GenerationStream] = []
    closed: list[BaseException | None] = []
    stream = GenerationStream("r", [1], 1, model="m", end=ended.append)
    stream.on_close = closed.append
    stream.close()
    stream.close()
    assert ended == [stream] and closed == [None]
