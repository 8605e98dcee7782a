"""The plugin chain as a unit: hook order, rewrites validated like a client's body, refusals passed
through, failures and overruns isolated as PluginFailed naming the plugin, output hooks applied per
streamed choice with a flush at its end; and discovery by entry point or module:attr."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from bitserve.errors import Forbidden, InvalidRequest, PluginFailed
from bitserve.outputs import CompletionOutput, RequestOutput
from bitserve.server.plugins.base import OutputContext, Plugin, RequestContext
from bitserve.server.plugins.chain import PluginChain
from bitserve.server.plugins.config import PluginConfig
from bitserve.server.plugins.registry import load_plugins
from bitserve.server.plugins.stream import PluginStream
from bitserve.server.protocol import ChatCompletionRequest, CompletionRequest


class Tagger(Plugin):
    """Appends its tag to the prompt (pre) and to each output (post); streams get the tag at the end."""

    def __init__(self, name: str, order: int = 100, seen: list[str] | None = None) -> None:
        super().__init__()
        self.name, self.order, self.seen = name, order, seen if seen is not None else []

    def pre_inference(self, context: RequestContext) -> CompletionRequest:
        self.seen.append(self.name)
        body = context.body
        return body.model_copy(update={"prompt": f"{body.prompt}+{self.name}"})

    async def post_inference(self, context: OutputContext, text: str) -> str:
        return f"{text}<{self.name}>"


class Failing(Plugin):
    name = "failing"

    def __init__(self, error: BaseException | None = None, sleep_s: float = 0.0, is_async: bool = False):
        super().__init__()
        self.error, self.sleep_s, self.is_async = error, sleep_s, is_async

    def pre_inference(self, context: RequestContext) -> Any:
        if self.is_async:
            return asyncio.sleep(self.sleep_s)
        time.sleep(self.sleep_s)
        if self.error is not None:
            raise self.error
        return None


def context(body: dict[str, Any] | None = None) -> RequestContext:
    request = CompletionRequest.model_validate(body or {"prompt": "p"})
    return RequestContext("cmpl", "model", request, None)  # type: ignore[arg-type]


def test_hooks_run_by_order_then_listed_order_and_rewrites_are_revalidated() -> None:
    seen: list[str] = []
    chain = PluginChain([Tagger("b", 200, seen), Tagger("a1", 100, seen), Tagger("a2", 100, seen)])
    assert chain.names == ["a1", "a2", "b"]
    result = asyncio.run(chain.pre_inference(context()))
    assert seen == ["a1", "a2", "b"] and result.body.prompt == "p+a1+a2+b"
    assert asyncio.run(chain.post_inference(OutputContext(result, 0), "out")) == "out<a1><a2><b>"

    class BadRewrite(Plugin):
        name = "bad_rewrite"

        def pre_inference(self, context: RequestContext) -> CompletionRequest:
            return context.body.model_copy(update={"max_tokens": -5})  # not a valid body

    with pytest.raises(PluginFailed, match="'bad_rewrite'.*invalid body") as failed:
        asyncio.run(PluginChain([BadRewrite()]).pre_inference(context()))
    assert failed.value.plugin == "bad_rewrite"


def test_a_4xx_is_a_refusal_anything_else_a_failure_naming_the_plugin() -> None:
    events: list[tuple[str, str]] = []
    refusing = PluginChain([Failing(Forbidden("no"))], on_event=lambda *event: events.append(event))
    with pytest.raises(Forbidden):
        asyncio.run(refusing.pre_inference(context()))
    failing = PluginChain([Failing(ZeroDivisionError("boom"))], on_event=lambda *event: events.append(event))
    with pytest.raises(PluginFailed, match="'failing' failed \\(pre_inference: ZeroDivisionError\\)"):
        asyncio.run(failing.pre_inference(context()))
    assert events == [("failing", "refused"), ("failing", "error")]
    assert failing.num_events == {("failing", "error"): 1}


def test_the_time_budget_cancels_an_awaitable_and_fails_a_slow_synchronous_hook() -> None:
    for plugin in (Failing(sleep_s=5.0, is_async=True), Failing(sleep_s=0.15)):
        chain = PluginChain([plugin], budget_s=0.1)
        started = time.monotonic()
        with pytest.raises(PluginFailed, match="ran past its 0.1 s budget"):
            asyncio.run(chain.pre_inference(context()))
        assert time.monotonic() - started < 1.0  # the awaitable was cancelled at the budget
        assert chain.num_events == {("failing", "timeout"): 1}


def test_logprobs_are_refused_while_an_output_plugin_runs() -> None:
    with pytest.raises(InvalidRequest, match="logprobs") as refused:
        asyncio.run(PluginChain([Tagger("t")]).pre_inference(context({"prompt": "p", "logprobs": 2})))
    assert refused.value.param == "logprobs"
    asyncio.run(
        PluginChain([Failing()]).pre_inference(context({"prompt": "p", "logprobs": 2}))
    )  # no output hook


class ScriptedStream:
    """An admitted stream's reading side, from a list of outputs."""

    def __init__(self, outputs: list[RequestOutput]) -> None:
        self.outputs, self.request_id, self.is_closed = outputs, "req", False

    async def next(self, timeout: float | None = None) -> RequestOutput | None:
        if not self.outputs:
            raise StopAsyncIteration
        return self.outputs.pop(0)

    def close(self) -> None:
        self.is_closed = True


def delta(*choices: tuple[int, str, str | None]) -> RequestOutput:
    return RequestOutput(
        "req", [], [CompletionOutput(i, text, [1], finish) for i, text, finish in choices], False
    )


def test_streamed_choices_are_filtered_apart_and_flushed_when_each_finishes() -> None:
    outputs = [delta((0, "a", None), (1, "x", None)), delta((0, "b", "stop")), delta((1, "y", "length"))]
    stream = PluginStream(ScriptedStream(outputs), PluginChain([Tagger("t1"), Tagger("t2")]), context())

    async def read() -> list[list[tuple[int, str]]]:
        return [[(c.index, c.text) for c in output.outputs] async for output in stream]

    # a whole-text plugin holds each choice to its end, then rewrites it; t2 sees what t1 released
    assert asyncio.run(read()) == [[(0, ""), (1, "")], [(0, "ab<t1><t2>")], [(1, "xy<t1><t2>")]]
    assert stream.request_id == "req"
    stream.close()
    assert stream.inner.is_closed


def test_discovery_by_module_attr_and_loud_failures(tmp_path: Any) -> None:
    rules = tmp_path / "rules.txt"
    rules.write_text("banned\n", encoding="utf-8")
    chain = load_plugins(
        PluginConfig(
            plugins="bitserve.server.plugins.content_filter:ContentFilter", content_filter_rules=str(rules)
        )
    )
    assert chain.names == ["content_filter"] and chain.output_plugins
    assert load_plugins(PluginConfig()).plugins == []
    with pytest.raises(InvalidRequest, match="'no_such_plugin' is not installed"):
        load_plugins(PluginConfig(plugins="no_such_plugin"))
    with pytest.raises(InvalidRequest, match="cannot be imported"):
        load_plugins(PluginConfig(plugins="bitserve.nowhere:Plugin"))
    with pytest.raises(InvalidRequest, match="could not start: the content filter needs its rules file"):
        load_plugins(PluginConfig(plugins="bitserve.server.plugins.content_filter:ContentFilter"))
    with pytest.raises(InvalidRequest, match="not a bitserve Plugin"):
        load_plugins(PluginConfig(plugins="bitserve.server.plugins.config:PluginConfig"))


def test_prompt_texts_cover_messages_parts_and_token_ids() -> None:
    class Decoder:
        def decode(self, token_ids: list[int]) -> str:
            return f"ids{token_ids}"

    chat = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "system", "content": "sys"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}],
                },
            ]
        }
    )
    assert RequestContext("chatcmpl", "m", chat, Decoder()).prompt_texts() == ("sys", "one", "two")  # type: ignore[arg-type]
    batch = CompletionRequest.model_validate({"prompt": [[1, 2], [3]]})
    assert RequestContext("cmpl", "m", batch, Decoder()).prompt_texts() == ("ids[1, 2]", "ids[3]")  # type: ignore[arg-type]
