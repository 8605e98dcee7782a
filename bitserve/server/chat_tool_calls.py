"""A chat choice's text -> OpenAI `tool_calls`, whole or streamed, in the model's tool format
(structured/tool_formats.py: the template's own, or the JSON convention).

Forced calls (`tool_choice` required or a named function: the grammar makes the whole reply calls)
stream as OpenAI streams them: a first delta per call with its id, type and name, then
`function.arguments` pieces as the model writes them. Under `auto` a reply that starts the way the
format's calls start ("[", "<tool_call>", "{") may be calls: it is held back until it ends, then sent
as calls (whole arguments in one delta) if it is, else as content; any other reply streams as
content at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from bitserve.structured.tool_formats import ToolFormat
from bitserve.structured.tools import Tool, ToolCall, ToolCallScanner, new_call_id

TOOL_CALLS_FINISH = "tool_calls"


def message_with_tool_calls(
    text: str, finish_reason: str | None, tools: list[Tool], tool_format: ToolFormat
) -> tuple[dict, str | None]:
    """A whole reply -> (message, finish_reason): tool calls when it is complete calls in the format."""
    calls = tool_format.parse(text, tools) if finish_reason == "stop" else None
    if calls is None:
        return {"role": "assistant", "content": text}, finish_reason
    message = {"role": "assistant", "content": None, "tool_calls": [call.to_openai() for call in calls]}
    return message, TOOL_CALLS_FINISH


@dataclass(slots=True)
class StreamedToolCalls:
    """One choice's stream. `delta(text, finish_reason)` -> (the OpenAI `delta`, its finish_reason)."""

    tools: list[Tool]
    forced: bool
    tool_format: ToolFormat
    scanner: ToolCallScanner = field(init=False)
    held: str = ""
    is_content: bool = False  # auto: the reply turned out to be text
    num_calls: int = 0

    def __post_init__(self) -> None:
        self.scanner = self.tool_format.scanner()

    def delta(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        if self.forced:
            calls = self._entries(self.scanner.feed(text))
            finish = TOOL_CALLS_FINISH if finish_reason == "stop" and self.num_calls else finish_reason
            return ({"tool_calls": calls} if calls else {}), finish
        if self.is_content:
            return ({"content": text} if text else {}), finish_reason
        self.held += text
        if self.held.strip() and not self.tool_format.may_be_call(self.held):
            self.is_content = True
            return {"content": self.held}, finish_reason
        if finish_reason is None:
            return {}, None
        calls = self.tool_format.parse(self.held, self.tools) if finish_reason == "stop" else None
        if calls is None:
            return ({"content": self.held} if self.held else {}), finish_reason
        return {"tool_calls": self._whole(calls)}, TOOL_CALLS_FINISH

    def _entries(self, events: list[tuple[int, str, str]]) -> list[dict[str, Any]]:
        """Scanner events -> tool_calls delta entries, one per call touched (a name opens a call)."""
        entries: list[dict[str, Any]] = []
        for index, kind, value in events:
            if kind == "name":
                self.num_calls += 1
                function = {"name": value, "arguments": ""}
                entries.append(
                    {"index": index, "id": new_call_id(), "type": "function", "function": function}
                )
            elif entries and entries[-1]["index"] == index:
                entries[-1]["function"]["arguments"] += value
            else:
                entries.append({"index": index, "function": {"arguments": value}})
        return entries

    def _whole(self, calls: list[ToolCall]) -> list[dict[str, Any]]:
        self.num_calls = len(calls)
        return [{"index": index, **call.to_openai()} for index, call in enumerate(calls)]
