"""Units of the Anthropic Messages API: a conversation of content blocks -> the chat request it is
served as (system blocks, tool_use -> tool_calls, tool_result -> tool messages, tool_choice), the
refusals of what is not implemented, the streamed content-block events, and the error dialect."""

from __future__ import annotations

import json
from typing import Any

import pytest

from bitserve.errors import InvalidRequest, ModelNotFound, RateLimited
from bitserve.server.anthropic_protocol import TOOL_ERROR_PREFIX, MessagesRequest
from bitserve.server.body import validate_request
from bitserve.server.errors import error_body
from bitserve.server.serving_messages import ContentBlocks, content_blocks, event_frame

TOOL = {"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


def request(**fields: Any) -> MessagesRequest:
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], **fields}
    return validate_request(body, MessagesRequest)


def test_a_tool_conversation_becomes_chat_messages() -> None:
    messages = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Paris?"}],
        },
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "content": [{"type": "text", "text": "21 C"}],
                },
                {"type": "text", "text": "And tomorrow?"},
            ],
        },
    ]
    system = [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]
    chat = request(messages=messages, system=system, tools=[TOOL], stop_sequences=["END"]).to_chat_request()
    rendered = [message.model_dump(exclude_none=True) for message in chat.messages]
    call = {
        "id": "toolu_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    assert rendered == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [call]},
        {"role": "tool", "content": "21 C", "tool_call_id": "toolu_1"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    assert chat.tools == [
        {"type": "function", "function": {"name": "get_weather", "parameters": TOOL["input_schema"]}}
    ]
    assert chat.stop == ["END"] and chat.max_tokens == 8 and chat.n == 1


def test_a_failed_tool_result_says_so() -> None:
    result = {"type": "tool_result", "tool_use_id": "t", "content": "timeout", "is_error": True}
    chat = request(messages=[{"role": "user", "content": [result]}]).to_chat_request()
    assert [(m.role, m.content) for m in chat.messages] == [("tool", TOOL_ERROR_PREFIX + "timeout")]


@pytest.mark.parametrize(
    ("choice", "expected", "parallel"),
    [
        ({"type": "auto"}, "auto", True),
        ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
        ({"type": "none"}, "none", True),
        (
            {"type": "tool", "name": "get_weather"},
            {"type": "function", "function": {"name": "get_weather"}},
            True,
        ),
    ],
)
def test_tool_choice_maps_to_chat(choice: dict[str, Any], expected: Any, parallel: bool) -> None:
    chat = request(tools=[TOOL], tool_choice=choice).to_chat_request()
    assert chat.tool_choice == expected and chat.parallel_tool_calls is parallel
    assert chat.tool_request().choice.mode == {"any": "required", "tool": "function"}.get(
        choice["type"], choice["type"]
    )


def test_sampling_fields_and_metadata_reach_the_chat_request() -> None:
    chat = request(temperature=0.5, top_p=0.9, top_k=40, metadata={"user_id": "u-1"}).to_chat_request()
    assert (chat.temperature, chat.top_p, chat.top_k, chat.user) == (0.5, 0.9, 40, "u-1")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    structured = request(
        output_config={"format": {"type": "json_schema", "schema": schema}}
    ).to_chat_request()
    assert structured.response_format == {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": schema},
    }


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages[0].content[0].type",
        ),
        (
            {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
            "messages[1]",
        ),
        ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, "thinking"),
        ({"tools": [{**TOOL, "type": "web_search_20250305"}]}, "tools[0].type"),
        ({"output_config": {"effort": "high"}}, "output_config.effort"),
        ({"tool_choice": {"type": "tool"}, "tools": [TOOL]}, "tool_choice.name"),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
            "messages[0].content[0].tool_use_id",
        ),
        ({"max_tokens": 0}, "max_tokens"),
        ({"messages": []}, "messages"),
    ],
)
def test_what_is_not_implemented_or_malformed_is_refused(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        request(**fields).to_chat_request()
    assert caught.value.param == param


def test_thinking_disabled_is_accepted() -> None:
    assert request(thinking={"type": "disabled"}).to_chat_request().messages[0].content == "hi"


def test_streamed_deltas_become_content_block_events() -> None:
    blocks = ContentBlocks()
    events = blocks.feed({"content": "Let me"}) + blocks.feed({"content": " check."})
    first_call = {"index": 0, "id": "call_a", "type": "function", "function": {"name": "f", "arguments": ""}}
    events += blocks.feed({"tool_calls": [first_call]})
    events += blocks.feed({"tool_calls": [{"index": 0, "function": {"arguments": '{"x": '}}]})
    events += blocks.feed({"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]})
    second_call = {
        "index": 1,
        "id": "call_b",
        "type": "function",
        "function": {"name": "g", "arguments": "{}"},
    }
    events += blocks.feed({"tool_calls": [second_call]}) + blocks.close()
    summary = [(e["type"], e["index"], e.get("delta", e.get("content_block"))) for e in events]
    assert summary == [
        ("content_block_start", 0, {"type": "text", "text": ""}),
        ("content_block_delta", 0, {"type": "text_delta", "text": "Let me"}),
        ("content_block_delta", 0, {"type": "text_delta", "text": " check."}),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, {"type": "tool_use", "id": "call_a", "name": "f", "input": {}}),
        ("content_block_delta", 1, {"type": "input_json_delta", "partial_json": '{"x": '}),
        ("content_block_delta", 1, {"type": "input_json_delta", "partial_json": "1}"}),
        ("content_block_stop", 1, None),
        ("content_block_start", 2, {"type": "tool_use", "id": "call_b", "name": "g", "input": {}}),
        ("content_block_delta", 2, {"type": "input_json_delta", "partial_json": "{}"}),
        ("content_block_stop", 2, None),
    ]
    assert blocks.close() == []  # nothing open twice


def test_a_whole_reply_becomes_content_blocks() -> None:
    call = {"id": "call_a", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    assert content_blocks({"content": None, "tool_calls": [call]}) == [
        {"type": "tool_use", "id": "call_a", "name": "f", "input": {"x": 1}}
    ]
    assert content_blocks({"content": "hi"}) == [{"type": "text", "text": "hi"}]


def test_event_frames_name_their_type() -> None:
    frame = event_frame({"type": "content_block_stop", "index": 2}).decode()
    assert frame == 'event: content_block_stop\ndata: {"type":"content_block_stop","index":2}\n\n'


def test_errors_speak_the_dialect_of_their_route() -> None:
    missing = ModelNotFound("the model 'x' does not exist on this server", param="model")
    body = error_body(missing, path="/v1/messages")
    assert body["type"] == "error" and body["error"]["type"] == "not_found_error"
    assert body["error"]["message"] == missing.message
    limited = RateLimited("slow down", retry_after_s=1.0)
    assert error_body(limited, path="/v1/messages/count_tokens")["error"]["type"] == "rate_limit_error"
    assert error_body(RuntimeError("secret"), path="/v1/messages")["error"] == {
        **error_body(RuntimeError("secret"))["error"],
        "type": "api_error",
    }
    assert set(error_body(missing, path="/v1/chat/completions")) == {"error"}  # OpenAI's shape elsewhere
    assert set(error_body(missing, path="/v1/messagesX")) == {"error"}
    json.dumps(body)  # serializable as it stands
