"""Black box: the Anthropic Messages API of `bitserve serve` (embedded SmolLM2), driven by the official
`anthropic` SDK over a real socket: whole and streamed messages (equal text, Anthropic's event order, no
[DONE]), stop sequences, max_tokens, forced tool use and a tool_result round trip (whole and streamed),
structured output, count_tokens, and Anthropic-shaped errors the SDK turns into its exceptions."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest
from http_testing import ServerProcess

MODEL = "smollm2-135m-instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0}  # not a typed parameter of the 2026 SDKs: sent as extra_body
WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Get the current weather for a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
FORCED = {"type": "tool", "name": "get_weather"}
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
FORCED_CALL: dict[str, Any] = {
    "model": MODEL,
    "max_tokens": 64,
    "messages": WEATHER_QUESTION,
    "tools": [WEATHER_TOOL],
    "tool_choice": FORCED,
    "extra_body": GREEDY,
}


@pytest.fixture(scope="module")
def claude(blackbox: ServerProcess) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=blackbox.url, api_key="unused", max_retries=0, timeout=120.0) as api:
        yield api


def text_of(message: Any) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def sse_events(server: ServerProcess, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of each frame of a streamed /v1/messages, read raw."""
    events: list[tuple[str, dict[str, Any]]] = []
    body = {**body, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/messages", json=body, timeout=120.0) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in response.iter_lines():
            assert line != "data: [DONE]"
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                data = json.loads(line.removeprefix("data: "))
                assert data["type"] == name  # every frame names its data's type
                events.append((name, data))
    return events


def test_a_message_answers_the_question(claude: anthropic.Anthropic) -> None:
    message = claude.messages.create(model=MODEL, max_tokens=24, messages=QUESTION, extra_body=GREEDY)
    assert message.type == "message" and message.role == "assistant" and message.model == MODEL
    assert "Paris" in text_of(message)
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    counted = claude.messages.count_tokens(model=MODEL, messages=QUESTION)
    assert message.usage.input_tokens == counted.input_tokens > 0
    assert 1 <= message.usage.output_tokens <= 24


def test_the_stream_equals_the_whole_message(claude: anthropic.Anthropic, blackbox: ServerProcess) -> None:
    whole = claude.messages.create(model=MODEL, max_tokens=16, messages=QUESTION, extra_body=GREEDY)
    with claude.messages.stream(model=MODEL, max_tokens=16, messages=QUESTION, extra_body=GREEDY) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text_of(whole) == text_of(final)
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    events = sse_events(blackbox, {"model": MODEL, "max_tokens": 16, "messages": QUESTION, **GREEDY})
    names = [name for name, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert names.count("content_block_start") == names.count("content_block_stop") == 1
    deltas = [data["delta"]["text"] for name, data in events if name == "content_block_delta"]
    assert "".join(deltas) == text_of(whole) and len(deltas) > 1  # it streamed, piece by piece
    assert events[0][1]["message"]["usage"]["input_tokens"] == whole.usage.input_tokens


def test_stop_sequences_and_max_tokens(claude: anthropic.Anthropic) -> None:
    stopped = claude.messages.create(
        model=MODEL, max_tokens=24, messages=QUESTION, stop_sequences=["Paris"], extra_body=GREEDY
    )
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "Paris"
    assert "Paris" not in text_of(stopped)
    cut = claude.messages.create(model=MODEL, max_tokens=3, messages=QUESTION, extra_body=GREEDY)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3


def test_forced_tool_use_then_a_tool_result_round_trip(claude: anthropic.Anthropic) -> None:
    called = claude.messages.create(**FORCED_CALL)
    assert called.stop_reason == "tool_use"
    (use,) = [block for block in called.content if block.type == "tool_use"]
    assert use.name == "get_weather" and isinstance(use.input["city"], str) and use.id
    with claude.messages.stream(**FORCED_CALL) as stream:
        streamed = stream.get_final_message()
    (streamed_use,) = [block for block in streamed.content if block.type == "tool_use"]
    assert streamed.stop_reason == "tool_use" and streamed_use.input == use.input  # input_json_deltas
    result = [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21 degrees"}]
    answer = claude.messages.create(
        model=MODEL,
        max_tokens=32,
        messages=[
            *WEATHER_QUESTION,
            {"role": "assistant", "content": called.content},
            {"role": "user", "content": result},
        ],
        tools=[WEATHER_TOOL],
        extra_body=GREEDY,
    )
    assert answer.stop_reason in ("end_turn", "max_tokens") and text_of(answer)
    # the tool's result reached the prompt: it is longer than the call's own prompt by the result and reply
    assert answer.usage.input_tokens > called.usage.input_tokens + called.usage.output_tokens


def test_structured_output_follows_the_schema(claude: anthropic.Anthropic) -> None:
    schema = {
        "type": "object",
        "properties": {"capital": {"type": "string"}},
        "required": ["capital"],
        "additionalProperties": False,
    }
    message = claude.messages.create(
        model=MODEL,
        max_tokens=40,
        messages=QUESTION,
        output_config={"format": {"type": "json_schema", "schema": schema}},
        extra_body=GREEDY,
    )
    reply = json.loads(text_of(message))
    assert set(reply) == {"capital"} and isinstance(reply["capital"], str)


def test_count_tokens_counts_the_system_prompt_and_tools(claude: anthropic.Anthropic) -> None:
    plain = claude.messages.count_tokens(model=MODEL, messages=QUESTION).input_tokens
    system = claude.messages.count_tokens(model=MODEL, messages=QUESTION, system="Answer in French.")
    tools = claude.messages.count_tokens(model=MODEL, messages=QUESTION, tools=[WEATHER_TOOL])
    assert system.input_tokens != plain and tools.input_tokens > plain


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (
            {"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "image",
        ),
        ({"max_tokens": 8, "messages": [*QUESTION, {"role": "assistant", "content": "The"}]}, "prefill"),
        (
            {"max_tokens": 8, "messages": QUESTION, "thinking": {"type": "enabled", "budget_tokens": 1024}},
            "thinking",
        ),
        ({"max_tokens": 8, "messages": [{"role": "system", "content": "x"}]}, "role"),
    ],
)
def test_bad_requests_get_anthropic_errors(
    claude: anthropic.Anthropic, body: dict[str, Any], needle: str
) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(model=MODEL, **body)
    error = caught.value.body
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert needle in error["error"]["message"]


def test_unknown_model_and_malformed_json(claude: anthropic.Anthropic, blackbox: ServerProcess) -> None:
    with pytest.raises(anthropic.NotFoundError) as caught:
        claude.messages.create(model="no-such-model", max_tokens=8, messages=QUESTION)
    assert caught.value.body["error"]["type"] == "not_found_error"
    for raw in (b'{"model": ', json.dumps({"model": MODEL, "messages": QUESTION}).encode()):
        response = httpx.post(f"{blackbox.url}/v1/messages", content=raw, timeout=30.0)
        assert response.status_code == 400
        assert (
            response.json()["type"] == "error" and response.json()["error"]["type"] == "invalid_request_error"
        )
    assert "max_tokens" in response.json()["error"]["message"]
    # the OpenAI routes keep OpenAI's shape
    openai_error = httpx.post(f"{blackbox.url}/v1/chat/completions", content=b'{"model": ', timeout=30.0)
    assert set(openai_error.json()) == {"error"}
