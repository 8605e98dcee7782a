"""PluginChain: the enabled plugins in order, and the one place their hooks are called: each call under
the time budget (`plugin_timeout_s`) and isolated, so a plugin that raises or runs late fails its request
with PluginFailed (a 500 naming it, logged with its name) and a 4xx BitserveError it raises is that
request's refusal. The serving pipeline calls `pre_inference` before admission and `wrap` on the admitted
stream (server/plugins/stream.py applies the output hooks)."""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from bitserve.errors import BitserveError, InvalidRequest, PluginFailed
from bitserve.server.body import validate_request
from bitserve.server.errors import lookup
from bitserve.server.plugins.base import MaybeAwaitable, OutputContext, Plugin, RequestContext, StreamFilter
from bitserve.server.protocol import GenerationRequest

logger = logging.getLogger(__name__)

T = TypeVar("T")
# (plugin name, outcome): "refused" (a 4xx it raised), "error" (it raised), "timeout" (over budget)
PluginEventSink = Callable[[str, str], None]


class PluginChain:
    """The plugins a server runs, in hook order; empty (the default) costs a request nothing."""

    def __init__(
        self, plugins: Sequence[Plugin] = (), budget_s: float = 1.0, on_event: PluginEventSink | None = None
    ) -> None:
        # a stable sort: equal `order`s keep the order the operator listed them in
        self.plugins = sorted(plugins, key=lambda plugin: plugin.order)
        self.budget_s = budget_s
        self.on_event = on_event
        self.output_plugins = [plugin for plugin in self.plugins if plugin.rewrites_output]
        # (plugin, outcome) -> times: what a metrics collector would export (`on_event` sees each too)
        self.num_events: dict[tuple[str, str], int] = {}

    @property
    def names(self) -> list[str]:
        return [plugin.name for plugin in self.plugins]

    async def pre_inference(self, context: RequestContext) -> RequestContext:
        """Run every pre-inference hook in order; the context of the body the request is admitted with.
        Raises the refusal a plugin raised, or PluginFailed."""
        for plugin in self.plugins:
            rewritten = await self.call(
                plugin, "pre_inference", lambda p=plugin, c=context: p.pre_inference(c)
            )
            if rewritten is not None:
                try:
                    context = context.with_body(_revalidated(context.body, rewritten))
                except TypeError as exc:  # the plugin's rewrite is unusable: its failure, not the client's
                    raise self._failed(plugin, "pre_inference", "error", str(exc)) from None
        if self.output_plugins and context.body.num_logprobs is not None:
            names = ", ".join(plugin.name for plugin in self.output_plugins)
            raise InvalidRequest(
                f"logprobs are not available while an output-rewriting plugin ({names}) is enabled: "
                "they would carry the unrewritten tokens",
                param="logprobs",
                hint="send the request without logprobs / top_logprobs",
            )
        return context

    async def post_inference(self, context: OutputContext, text: str) -> str:
        """A choice's whole text through every output plugin's post_inference, in order."""
        for plugin in self.output_plugins:
            text = await self.call(
                plugin, "post_inference", lambda p=plugin, t=text: p.post_inference(context, t)
            )
        return text

    async def stream_filters(self, context: OutputContext) -> list[tuple[Plugin, StreamFilter]]:
        """One filter per output plugin (those that return one) for one streamed choice, in order."""
        filters = []
        for plugin in self.output_plugins:
            made = await self.call(plugin, "stream_filter", lambda p=plugin: p.stream_filter(context))
            if made is not None:
                filters.append((plugin, made))
        return filters

    async def call(self, plugin: Plugin, hook: str, run: Callable[[], MaybeAwaitable[T]]) -> T:
        """`run()` (one hook of `plugin`), awaited if it returns an awaitable, within the time budget.

        NOTE: an awaitable is cancelled at the budget; a synchronous hook cannot be interrupted, so its
        time is checked when it returns (it blocked the event loop meanwhile: keep them short)."""
        started = time.monotonic()
        try:
            result = run()
            if inspect.isawaitable(result):
                remaining = max(self.budget_s - (time.monotonic() - started), 0.0)
                result = await asyncio.wait_for(_awaited(result), remaining)
        except TimeoutError:
            raise self._failed(plugin, hook, "timeout", f"ran past its {self.budget_s:g} s budget") from None
        except BitserveError as exc:
            if lookup(exc).status >= 500:
                raise self._failed(plugin, hook, "error", type(exc).__name__, exc) from exc
            self._record(plugin, "refused")
            logger.info("plugin %s refused the request in %s: %s", plugin.name, hook, type(exc).__name__)
            raise
        except Exception as exc:  # noqa: BLE001 - isolation: any plugin bug fails only this request
            raise self._failed(plugin, hook, "error", type(exc).__name__, exc) from exc
        if time.monotonic() - started > self.budget_s:
            raise self._failed(plugin, hook, "timeout", f"ran past its {self.budget_s:g} s budget")
        return result

    def _failed(
        self, plugin: Plugin, hook: str, outcome: str, what: str, exc: BaseException | None = None
    ) -> PluginFailed:
        self._record(plugin, outcome)
        # ERROR with the plugin's name (and its traceback when it raised); the client's body names it too
        logger.error("plugin %s failed in %s: %s", plugin.name, hook, what, exc_info=exc)
        return PluginFailed(
            f"the server plugin {plugin.name!r} failed ({hook}: {what}); the request was not served",
            plugin=plugin.name,
            hint="retry; if it persists, the server's operator should check the plugin (see the server log)",
        )

    def _record(self, plugin: Plugin, outcome: str) -> None:
        key = (plugin.name, outcome)
        self.num_events[key] = self.num_events.get(key, 0) + 1
        if self.on_event is not None:
            self.on_event(plugin.name, outcome)


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def _revalidated(body: GenerationRequest, rewritten: Any) -> GenerationRequest:
    """A rewritten body (`body.model_copy(update=...)`, say), checked like a client's: the same type,
    its fields' bounds, supported fields. TypeError when it is not a valid body."""
    if type(rewritten) is not type(body):
        raise TypeError(f"pre_inference returned {type(rewritten).__name__}, not {type(body).__name__}")
    try:
        return validate_request(rewritten.model_dump(exclude_unset=True), type(body))
    except InvalidRequest as exc:
        raise TypeError(f"pre_inference returned an invalid body: {exc.message}") from None
