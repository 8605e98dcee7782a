"""PluginStream: an admitted stream with the output plugins applied, so every generation endpoint (SSE,
WebSocket, one JSON body, a batch line) sends the rewritten text. Streamed, each choice's text deltas go
through its plugins' StreamFilters in order, and the filters are flushed when that choice finishes;
collected whole (`collect()`), each choice's text goes through post_inference instead. Token ids and
usage are the generator's (they count what the model produced)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from bitserve.frontend.generation_stream import OutputStream
from bitserve.outputs import CompletionOutput, RequestOutput
from bitserve.server.plugins.base import OutputContext, Plugin, RequestContext, StreamFilter
from bitserve.server.plugins.chain import PluginChain


class PluginStream(OutputStream):
    """`inner` (any admitted stream: routed, batched, replayed or recorded) seen through `chain`."""

    def __init__(self, inner: Any, chain: PluginChain, context: RequestContext) -> None:
        self.inner = inner
        self.chain = chain
        self.context = context
        self._filters: dict[int, list[tuple[Plugin, StreamFilter]]] = {}  # per choice index

    def __getattr__(self, name: str) -> Any:
        """request_id, num_prompt_tokens, num_output_tokens, timing, error: the inner stream's."""
        return getattr(self.inner, name)

    @property
    def on_close(self) -> Callable[[BaseException | None], None] | None:
        return self.inner.on_close  # type: ignore[no-any-return]

    @on_close.setter
    def on_close(self, callback: Callable[[BaseException | None], None] | None) -> None:
        self.inner.on_close = callback

    async def next(self, timeout: float | None = None) -> RequestOutput | None:
        output: RequestOutput | None = await self.inner.next(timeout)
        if output is None:
            return None
        choices = [await self._filtered(choice) for choice in output.outputs]
        return dataclasses.replace(output, outputs=choices)

    async def _filtered(self, choice: CompletionOutput) -> CompletionOutput:
        filters = self._filters.get(choice.index)
        if filters is None:
            context = OutputContext(self.context, choice.index)
            filters = self._filters[choice.index] = await self.chain.stream_filters(context)
        text = choice.text
        is_finished = choice.finish_reason is not None
        # each filter's output feeds the next; when the choice finished, each is flushed in turn, so
        # what one releases at the end still passes every filter after it
        for plugin, stream_filter in filters:
            text = await self.chain.call(plugin, "stream", lambda f=stream_filter, t=text: f.feed(t))
            if is_finished:
                text += await self.chain.call(plugin, "stream", stream_filter.flush)
        return dataclasses.replace(choice, text=text)

    async def collect(self) -> RequestOutput:
        """The whole answer (closes the stream), each choice's text through post_inference."""
        result: RequestOutput = await self.inner.collect()
        for choice in result.outputs:
            choice.text = await self.chain.post_inference(
                OutputContext(self.context, choice.index), choice.text
            )
        return result

    def empty_result(self) -> RequestOutput:
        return self.inner.empty_result()  # type: ignore[no-any-return]

    def close(self) -> None:
        self.inner.close()


def with_output_plugins(stream: Any, chain: PluginChain, context: RequestContext | None) -> Any:
    """`stream` through the chain's output plugins; `stream` itself when none rewrites output (or no
    plugin saw the request: `context` None)."""
    if context is None or not chain.output_plugins:
        return stream
    return PluginStream(stream, chain, context)
