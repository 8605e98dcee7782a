"""A client disconnect must always stop a stream: the cancellation may land in the same loop turn as
the next output (the race asyncio.wait_for loses on Python <= 3.11 by returning the item)."""

from __future__ import annotations

import asyncio

import pytest

from bitserve.server.streaming import GenerationStream


def _bare_stream() -> GenerationStream:
    stream = GenerationStream.__new__(GenerationStream)  # only the queue matters for next()
    stream._queue = asyncio.Queue()
    return stream


def test_cancel_that_lands_with_an_item_is_not_swallowed() -> None:
    async def scenario() -> None:
        stream = _bare_stream()
        waiter = asyncio.ensure_future(stream.next(5.0))
        await asyncio.sleep(0)  # the waiter is now blocked on the queue
        stream._queue.put_nowait("output")  # wakes it ...
        waiter.cancel()  # ... and the disconnect cancels it in the same turn
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert stream._queue.qsize() in (0, 1)  # nothing else happened to the queue

    asyncio.run(scenario())


def test_timeout_returns_none_and_keeps_later_items() -> None:
    async def scenario() -> None:
        stream = _bare_stream()
        assert await stream.next(0.01) is None
        stream._queue.put_nowait("output")
        assert await stream.next(0.01) == "output"

    asyncio.run(scenario())
