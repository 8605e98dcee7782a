"""A chat choice's text -> OpenAI `tool_calls`, whole or streamed (the convention of structured/tools.py).

Forced calls (`tool_choice` required or a named function: the grammar makes the whole reply a call
array) stream as OpenAI streams them: a first delta per call with its id, type and name, then
`function.arguments` pieces as the model writes them. Under `auto` a reply that starts with "[" may
be a call array: it is held back until it ends, then sent as calls (whole arguments in one delta)
if it is one, else as content; any other reply streams as content at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from bitserve.structured.tools import Tool, ToolCall, ToolCallScanner, new_call_id, parse_tool_calls

TOOL_CALLS_FINISH = "tool_calls"


def message_with_tool_calls(
    text: str, finish_reason: str | None, tools: list[Tool]
) -> tuple[dict, str | None]:
    """A whole reply -> (message, finish_reason): tool calls when it is a complete call array."""
    calls = parse_tool_calls(text, tools) if finish_reason == "stop" else None
    if calls is None:
        return {"role": "assistant", "content": text}, finish_reason
    message = {"role": "assistant", "content": None, "tool_calls": [call.to_openai() for call in calls]}
    return message, TOOL_CALLS_FINISH


@dataclass(slots=True)
class StreamedToolCalls:
    """One choice's stream. `delta(text, finish_reason)` -> (the OpenAI `delta`, its finish_reason)."""

    tools: list[Tool]
    forced: bool
    scanner: ToolCallScanner = field(default_factory=ToolCallScanner)
    held: str = ""
    is_content: bool = False  # auto: the reply turned out to be text
    num_calls: int = 0

    def delta(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        if self.forced:
            calls = self._entries(self.scanner.feed(text))
            finish = TOOL_CALLS_FINISH if finish_reason == "stop" and self.num_calls else finish_reason
            return ({"tool_calls": calls} if calls else {}), finish
        if self.is_content:
            return ({"content": text} if text else {}), finish_reason
        self.held += text
        stripped = self.held.lstrip()
        if stripped and not stripped.startswith("["):
            self.is_content = True
            return {"content": self.held}, finish_reason
        if finish_reason is None:
            return {}, None
        calls = parse_tool_calls(self.held, self.tools) if finish_reason == "stop" else None
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
