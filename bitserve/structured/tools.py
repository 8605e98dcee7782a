"""Tool calls: OpenAI's `tools` / `tool_choice` / `parallel_tool_calls` on a documented JSON convention.

Templates with a tool format of their own (Hermes, Llama 3.1) use it (tool_formats.py); any other
template, the embedded model's ChatML included, gets bitserve's convention: the tools are described
in the system message, and a reply that calls tools is only a JSON array of calls,

    [{"name": "get_weather", "arguments": {"city": "Paris"}}]

`required` and a named function force that array with the grammar engine (a JSON schema built from
the tools' parameter schemas: each call's arguments are valid for its tool; with
`parallel_tool_calls: false` exactly one call). `auto` constrains nothing: a reply whose text is such
an array of known tools becomes tool calls, any other reply is content. `none` leaves the tools out
of the prompt. Assistant messages that carried `tool_calls` are rendered back as the same array, and
`role: "tool"` messages as the template's "tool" role.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from bitserve.errors import InvalidRequest
from bitserve.structured.guide import Guide

MAX_TOOLS = 128
FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """The one home of the tool-choice rules, which the convention's grammar and the template
    formats' grammars (tool_formats.py) both follow."""

    mode: str  # "none" | "auto" | "required" | "function"
    function: str | None = None  # the forced function's name, for mode "function"

    @property
    def is_forced(self) -> bool:
        """`required` or a named function: the reply must be calls, so a grammar forces them."""
        return self.mode in ("required", "function")

    def allowed(self, tools: list[Tool]) -> list[Tool]:
        """The tools a forced reply may call: the named one, or all."""
        return [tool for tool in tools if self.function in (None, tool.name)]

    def is_one_call(self, parallel: bool) -> bool:
        """Whether a forced reply holds exactly one call (`parallel_tool_calls: false`, or a named
        function, which is called once)."""
        return not parallel or self.mode == "function"


@dataclass(slots=True)
class ToolCall:
    """One call; `arguments` is the JSON text of the arguments exactly as generated."""

    name: str
    arguments: str
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or new_call_id()

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# ----------------------------------------------------------------- request fields


def parse_tools(tools: Any) -> list[Tool]:
    if tools is None:
        return []
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise InvalidRequest(f"tools must be a list of at most {MAX_TOOLS} tools", param="tools")
    parsed = [_parse_tool(tool, f"tools[{index}]") for index, tool in enumerate(tools)]
    names = [tool.name for tool in parsed]
    duplicate = next((name for name in names if names.count(name) > 1), None)
    if duplicate is not None:
        raise InvalidRequest(f"tools name the function {duplicate!r} twice", param="tools")
    return parsed


def _parse_tool(tool: Any, where: str) -> Tool:
    if (
        not isinstance(tool, dict)
        or tool.get("type") != "function"
        or not isinstance(tool.get("function"), dict)
    ):
        raise InvalidRequest(
            f'{where} must be {{"type": "function", "function": {{"name": ..., "parameters": ...}}}}',
            param=where,
        )
    function = tool["function"]
    name = function.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME.match(name):
        raise InvalidRequest(
            f"{where}.function.name must be 1..64 letters, digits, _ or -, got {name!r:.60}",
            param=f"{where}.function.name",
        )
    description = function.get("description") or ""
    if not isinstance(description, str):
        raise InvalidRequest(f"{where}.function.description must be a string", param=f"{where}.function")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = EMPTY_PARAMETERS
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise InvalidRequest(
            f"{where}.function.parameters must be a JSON schema of type object",
            param=f"{where}.function.parameters",
        )
    return Tool(name, description, parameters)


def parse_tool_choice(tool_choice: Any, tools: list[Tool]) -> ToolChoice:
    if tool_choice is None:
        return ToolChoice("auto" if tools else "none")
    if tool_choice in ("none", "auto", "required"):
        choice = ToolChoice(tool_choice)
    elif (
        isinstance(tool_choice, dict)
        and tool_choice.get("type") == "function"
        and isinstance(tool_choice.get("function"), dict)
        and isinstance(tool_choice["function"].get("name"), str)
    ):
        choice = ToolChoice("function", tool_choice["function"]["name"])
    else:
        raise InvalidRequest(
            'tool_choice must be "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    if choice.mode != "none" and not tools:
        raise InvalidRequest(f"tool_choice {choice.mode!r} needs tools", param="tool_choice")
    if choice.function is not None and choice.function not in {tool.name for tool in tools}:
        raise InvalidRequest(
            f"tool_choice names the function {choice.function!r}, which is not among the tools",
            param="tool_choice",
        )
    return choice


# ----------------------------------------------------------------- prompt and grammar


def tools_prompt(tools: list[Tool], choice: ToolChoice, parallel: bool) -> str:
    """The system-message text that describes the tools and the reply convention."""
    lines = ["You can call these functions. Each one's arguments follow its JSON schema:"]
    for tool in tools:
        summary = f" {tool.description}" if tool.description else ""
        lines.append(f"- {tool.name}:{summary} Arguments: {json.dumps(tool.parameters)}")
    how_many = "one or more calls" if parallel else "exactly one call"
    lines.append(
        f'To call functions, reply with only a JSON array of {how_many}: [{{"name": "<function name>", '
        '"arguments": {<arguments>}}]'
    )
    if choice.mode == "auto":
        lines.append("If no function is needed, reply in plain text instead.")
    return "\n".join(lines)


def tool_call_guide(tools: list[Tool], choice: ToolChoice, parallel: bool) -> Guide | None:
    """The grammar that forces a tool-call array (`required` or a named function); None otherwise."""
    if not choice.is_forced:
        return None
    calls = [_call_schema(tool) for tool in choice.allowed(tools)]
    schema: dict[str, Any] = {
        "type": "array",
        "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
        "minItems": 1,
    }
    if choice.is_one_call(parallel):
        schema["maxItems"] = 1
    return Guide.json_schema(schema, "tools")


def _call_schema(tool: Tool) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": tool.parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def with_tools_prompt(messages: list[dict[str, str]], text: str) -> list[dict[str, str]]:
    """The messages with `text` added to the leading system message (one is inserted if there is none)."""
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0])
        first["content"] = f"{first['content']}\n\n{text}" if first["content"] else text
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def assistant_tool_calls(tool_calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls` checked: [{"id", "name", "arguments"}], the arguments parsed
    from their JSON text where they are JSON (a template writes them back as JSON)."""
    if not isinstance(tool_calls, list) or not tool_calls:
        raise InvalidRequest(f"{where}.tool_calls must be a non-empty list", param=f"{where}.tool_calls")
    calls = []
    for index, call in enumerate(tool_calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidRequest(
                f'{where}.tool_calls[{index}] must be {{"id", "type": "function", "function": {{"name", '
                '"arguments"}}',
                param=f"{where}.tool_calls[{index}]",
            )
        arguments = function.get("arguments", "{}")
        try:
            parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
        except json.JSONDecodeError:
            parsed = arguments  # kept as the string it was
        calls.append({"id": str(call.get("id") or ""), "name": function["name"], "arguments": parsed})
    return calls


def assistant_tool_calls_text(calls: list[dict[str, Any]]) -> str:
    """Checked calls (assistant_tool_calls) written back in the convention (what the model would say)."""
    return json.dumps([{"name": call["name"], "arguments": call["arguments"]} for call in calls])


# ----------------------------------------------------------------- reading the reply


@dataclass(frozen=True, slots=True)
class CallLayout:
    """Where a reply's calls sit. `call_depth`: 2 for calls inside a top-level array (the convention),
    1 for top-level call objects (template formats). `skeleton`: what the reply must be once each
    top-level JSON value is replaced by NUL (the text around and between the calls)."""

    call_depth: int = 2
    arguments_key: str = "arguments"
    skeleton: re.Pattern[str] = re.compile(r"\s*\x00\s*")


CONVENTION_LAYOUT = CallLayout()


def parse_tool_calls(
    text: str, tools: list[Tool], layout: CallLayout = CONVENTION_LAYOUT
) -> list[ToolCall] | None:
    """The calls of a complete reply laid out as `layout` says, or None when it is not one (then it
    is content)."""
    scanner = ToolCallScanner(layout)
    events = scanner.feed(text)
    if not scanner.is_complete or not events or not layout.skeleton.fullmatch(scanner.skeleton):
        return None
    calls = calls_from_events(events)
    known = {tool.name for tool in tools}
    for call in calls:
        try:
            arguments = json.loads(call.arguments)
        except json.JSONDecodeError:
            return None
        if call.name not in known or not isinstance(arguments, dict):
            return None
    return calls or None


def calls_from_events(events: list[tuple[int, str, str]]) -> list[ToolCall]:
    calls: list[ToolCall] = []
    for index, kind, value in events:
        if kind == "name":
            calls.append(ToolCall(value, ""))
        elif index < len(calls):
            calls[index].arguments += value
    return calls


class ToolCallScanner:
    """Reads a reply's calls incrementally (the convention's array, or a template's call objects):
    `feed(delta)` returns events (call index, "name", name) when a call's name is complete and (call
    index, "arguments", text) for each new piece of its arguments' JSON text, so a stream can send
    argument deltas as OpenAI does. A character-level JSON scanner (strings, escapes, depth): it does
    not validate; the grammar (or parse_tool_calls) does. `is_complete` once every top-level value
    has closed; the text around them is kept in `skeleton` (each value a NUL) for the layout's
    check."""

    def __init__(self, layout: CallLayout = CONVENTION_LAYOUT) -> None:
        self.layout = layout
        self.call_depth = layout.call_depth
        self.top_opener = "[" if layout.call_depth == 2 else "{"
        self.skeleton_parts: list[str] = []
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.string: list[str] = []
        self.last_string: str | None = None  # the last string closed at call level (a key or a name)
        self.key: str | None = None  # the call-level key whose value is being read
        self.call_index = -1
        self.in_arguments = False
        self.closed = False
        self.invalid = False

    @property
    def is_complete(self) -> bool:
        return self.closed and self.depth == 0 and not self.invalid

    @property
    def skeleton(self) -> str:
        return "".join(self.skeleton_parts)

    def feed(self, text: str) -> list[tuple[int, str, str]]:
        events: list[tuple[int, str, str]] = []
        arguments: list[str] = []
        for char in text:
            if self.in_arguments:
                arguments.append(char)
            self._step(char, events, arguments)
        if arguments:
            events.append((self.call_index, "arguments", "".join(arguments)))
        return events

    def _step(self, char: str, events: list[tuple[int, str, str]], arguments: list[str]) -> None:
        if self.depth == 0 and char not in "[{":
            self.skeleton_parts.append(char)  # text around the calls: the layout's skeleton judges it
        elif self.in_string:
            self._string_char(char, events)
        elif char == '"':
            self.in_string, self.string = True, []
        elif char in "[{":
            self._open(char, arguments)
        elif char in "]}":
            self._close(events, arguments)
        elif self.depth == self.call_depth and char == ":":
            self.key = self.last_string
        elif self.depth == self.call_depth and char == ",":
            self.key = None

    def _string_char(self, char: str, events: list[tuple[int, str, str]]) -> None:
        if self.escape:
            self.escape = False
        elif char == "\\":
            self.escape = True
        elif char == '"':
            self.in_string = False
            if self.depth == self.call_depth:
                raw = "".join(self.string)
                if self.key == "name":
                    events.append((self.call_index, "name", _json_string(raw)))
                self.last_string = _json_string(raw)
            return
        self.string.append(char)

    def _open(self, char: str, arguments: list[str]) -> None:
        if self.depth == 0:
            self.skeleton_parts.append("\x00")
            if char != self.top_opener:
                self.invalid = True
        self.depth += 1
        if self.depth == self.call_depth and char == "{":
            self.call_index += 1
            self.key = self.last_string = None
        elif (
            self.depth == self.call_depth + 1
            and self.key == self.layout.arguments_key
            and not self.in_arguments
        ):
            self.in_arguments = True
            arguments.append(char)

    def _close(self, events: list[tuple[int, str, str]], arguments: list[str]) -> None:
        if self.in_arguments and self.depth == self.call_depth + 1:
            self.in_arguments = False
            events.append((self.call_index, "arguments", "".join(arguments)))
            arguments.clear()
        self.depth -= 1
        if self.depth == 0:
            self.closed = True
        elif self.depth < 0:
            self.invalid = True


def _json_string(raw: str) -> str:
    try:
        return str(json.loads(f'"{raw}"'))
    except json.JSONDecodeError:
        return raw
