"""The tool-call convention without a model: request fields, the grammar's schema, the incremental
scanner (streamed pieces reassemble to the whole reply's calls) and the auto-mode reader."""

from __future__ import annotations

import json

import jsonschema
import pytest

from bitserve.errors import InvalidRequest
from bitserve.server.chat_tool_calls import StreamedToolCalls, message_with_tool_calls
from bitserve.structured.tool_formats import JSON_CONVENTION
from bitserve.structured.tools import (
    ToolCallScanner,
    calls_from_events,
    parse_tool_calls,
    parse_tool_choice,
    parse_tools,
    tool_call_guide,
)

TOOLS = parse_tools(
    [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        },
        {"type": "function", "function": {"name": "get_time"}},
    ]
)
REPLY = (
    '[{"name": "get_weather", "arguments": {"city": "Pa\\"ris}", "n": {"a": [1, 2]}}}, '
    '{"name": "get_time", "arguments": {}}]'
)


def test_scanner_pieces_reassemble_to_the_whole_reply() -> None:
    whole = calls_from_events(ToolCallScanner().feed(REPLY))
    assert [(call.name, json.loads(call.arguments)) for call in whole] == [
        ("get_weather", {"city": 'Pa"ris}', "n": {"a": [1, 2]}}),
        ("get_time", {}),
    ]
    scanner, events = ToolCallScanner(), []
    for start in range(0, len(REPLY), 3):  # three characters at a time, splitting escapes and braces
        events += scanner.feed(REPLY[start : start + 3])
    assert scanner.is_complete
    assert [(c.name, c.arguments) for c in calls_from_events(events)] == [
        (c.name, c.arguments) for c in whole
    ]


@pytest.mark.parametrize(
    "text",
    ["The weather is fine.", '[{"name": "unknown", "arguments": {}}]', '[{"name": "get_time"', "[1, 2]"],
)
def test_anything_else_is_content(text: str) -> None:
    assert parse_tool_calls(text, TOOLS) is None
    message, finish = message_with_tool_calls(text, "stop", TOOLS, JSON_CONVENTION)
    assert message["content"] == text and finish == "stop"


def test_streamed_deltas_follow_openai() -> None:
    stream = StreamedToolCalls(TOOLS, True, JSON_CONVENTION)
    deltas = [stream.delta(REPLY[i : i + 5], None)[0] for i in range(0, len(REPLY), 5)]
    _, finish = stream.delta("", "stop")
    entries = [entry for delta in deltas for entry in delta.get("tool_calls", [])]
    firsts = [entry for entry in entries if "id" in entry]
    assert [entry["function"]["name"] for entry in firsts] == ["get_weather", "get_time"]
    assert all(entry["id"].startswith("call_") and entry["type"] == "function" for entry in firsts)
    for index in (0, 1):
        arguments = "".join(e["function"]["arguments"] for e in entries if e["index"] == index)
        assert arguments == calls_from_events(ToolCallScanner().feed(REPLY))[index].arguments
    assert finish == "tool_calls"


def test_auto_holds_a_possible_call_and_streams_text_at_once() -> None:
    text = StreamedToolCalls(TOOLS, False, JSON_CONVENTION)
    assert text.delta("  Hel", None) == ({"content": "  Hel"}, None)
    assert text.delta("lo", "stop") == ({"content": "lo"}, "stop")
    call = StreamedToolCalls(TOOLS, False, JSON_CONVENTION)
    assert call.delta(REPLY[:20], None) == ({}, None)
    delta, finish = call.delta(REPLY[20:], "stop")
    assert finish == "tool_calls" and [e["function"]["name"] for e in delta["tool_calls"]] == [
        "get_weather",
        "get_time",
    ]


def test_required_schema_accepts_only_calls_of_the_tools() -> None:
    choice = parse_tool_choice("required", TOOLS)
    schema = json.loads(tool_call_guide(TOOLS, choice, parallel=False).spec)
    jsonschema.validate([{"name": "get_time", "arguments": {}}], schema)
    for bad in ([], [{"name": "nope", "arguments": {}}], [{"name": "get_weather", "arguments": {"city": 3}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    with pytest.raises(jsonschema.ValidationError):  # parallel_tool_calls false: exactly one call
        jsonschema.validate([{"name": "get_time", "arguments": {}}] * 2, schema)
    named = json.loads(
        tool_call_guide(
            TOOLS, parse_tool_choice({"type": "function", "function": {"name": "get_time"}}, TOOLS), True
        ).spec
    )
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "arguments": {}}], named)
    assert tool_call_guide(TOOLS, parse_tool_choice("auto", TOOLS), True) is None


def test_tool_choice_rules() -> None:
    """The rules both the convention's grammar and the template formats' grammars follow."""
    named = parse_tool_choice({"type": "function", "function": {"name": "get_time"}}, TOOLS)
    required, auto = parse_tool_choice("required", TOOLS), parse_tool_choice("auto", TOOLS)
    assert named.is_forced and required.is_forced and not auto.is_forced
    assert [tool.name for tool in named.allowed(TOOLS)] == ["get_time"]
    assert required.allowed(TOOLS) == TOOLS
    assert named.is_one_call(parallel=True) and required.is_one_call(parallel=False)
    assert not required.is_one_call(parallel=True)


@pytest.mark.parametrize(
    ("tools", "tool_choice", "param"),
    [
        ([{"type": "function", "function": {"name": "has space"}}], None, "tools[0].function.name"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
            None,
            "tools[0].function.parameters",
        ),
        ([{"type": "retrieval"}], None, "tools[0]"),
        (None, "required", "tool_choice"),
        ([{"type": "function", "function": {"name": "f"}}], "sometimes", "tool_choice"),
    ],
)
def test_bad_tool_fields_name_the_field(tools: object, tool_choice: object, param: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_tool_choice(tool_choice, parse_tools(tools))
    assert caught.value.param == param
