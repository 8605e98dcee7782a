"""Black box, official `openai` client: tool calls in a chat template's own format. `bitserve serve`
runs the random synthetic model with a Hermes (Qwen2.5) or a Llama 3.1 template in its GGUF; with
`tool_choice` required or named and greedy decoding, the grammar makes its reply the family's call
text, which the server reads back into OpenAI `tool_calls`, whole and streamed.
(Template detection, prompts, grammars and the raw reply text: tests/structured/test_tool_formats.py.)"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
from http_testing import ServerProcess

from bitserve.testing.tool_templates import TOOL_TEMPLATES, write_tool_template_model

PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "London", "Tokyo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
FORECAST = {"type": "function", "function": {"name": "get_forecast", "parameters": PARAMETERS}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "Local time"}}
QUESTION = [{"role": "user", "content": "Will it rain in Paris this week?"}]
FORCED = {"type": "function", "function": {"name": "get_forecast"}}


@pytest.fixture(scope="module", params=sorted(TOOL_TEMPLATES))
def client(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    synthetic_config: Any,
    synthetic_weights: Any,
) -> Iterator[openai.OpenAI]:
    folder = tmp_path_factory.mktemp(f"tools-{request.param}")
    tokenizer, weights = synthetic_weights
    path = write_tool_template_model(
        folder / "model.gguf",
        TOOL_TEMPLATES[request.param],
        config=synthetic_config,
        weights=weights,
        tokenizer=tokenizer,
    )
    server = ServerProcess(folder / "server.log", "--model", str(path), "--max-model-len", "1024")
    try:
        server.wait_ready()
        url = f"{server.url}/v1"
        with openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120.0) as api:
            yield api
    finally:
        server.stop()


def model_id(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def check_call(call: Any) -> dict[str, Any]:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_forecast"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, PARAMETERS)
    return arguments


def test_required_and_named_calls_whole_and_streamed(client: openai.OpenAI) -> None:
    model = model_id(client)
    required = client.chat.completions.create(
        model=model, messages=QUESTION, tools=[FORECAST], tool_choice="required", max_tokens=60, temperature=0
    )
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [check_call(call) for call in choice.message.tool_calls]
    request = {"model": model, "messages": QUESTION, "tools": [FORECAST, CLOCK], "tool_choice": FORCED}
    whole = client.chat.completions.create(**request, max_tokens=60, temperature=0)
    (call,) = whole.choices[0].message.tool_calls
    expected = check_call(call)
    pieces, names, finish = [], [], None
    for chunk in client.chat.completions.create(**request, max_tokens=60, temperature=0, stream=True):
        for streamed in chunk.choices:
            for delta in streamed.delta.tool_calls or []:
                assert delta.index == 0
                names += [delta.function.name] if delta.function.name else []
                pieces.append(delta.function.arguments or "")
            finish = streamed.finish_reason or finish
    assert names == ["get_forecast"] and finish == "tool_calls"
    assert len([piece for piece in pieces if piece]) > 1  # argument deltas, as OpenAI streams them
    assert "".join(pieces) == call.function.arguments and json.loads("".join(pieces)) == expected


def test_tool_result_follow_up_renders_through_the_template(client: openai.OpenAI) -> None:
    arguments = json.dumps({"city": "Paris", "days": 3})
    call = {"id": "call_1", "type": "function", "function": {"name": "get_forecast", "arguments": arguments}}
    follow_up = [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"rain": [0, 1, 0]})},
    ]
    answer = client.chat.completions.create(
        model=model_id(client), messages=follow_up, tools=[FORECAST], max_tokens=8, temperature=0
    )
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert answer.usage is not None and answer.usage.prompt_tokens > 50  # the tools and the call went in
