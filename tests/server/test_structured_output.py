"""Black box, official `openai` client: structured output (response_format json_object / json_schema, the
parse() helper, guided_choice / regex / grammar) and tool calls (required, named, streamed argument
deltas, a role "tool" follow-up) from `bitserve serve` with the embedded SmolLM2.

Every guided reply must parse and validate, greedy and sampled: the grammar, not luck, makes it so.
Schemas bound their strings and numbers, so that a 135M model closes the JSON within max_tokens.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any, Literal

import jsonschema
import openai
import pytest
from http_testing import ServerProcess
from pydantic import BaseModel, Field

MODEL = "smollm2-135m-instruct"
PERSON_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,11}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "likes_cats": {"type": "boolean"},
        "city": {"enum": ["Paris", "London", "Tokyo"]},
    },
    "required": ["name", "age", "likes_cats", "city"],
    "additionalProperties": False,
}
PROMPTS = ["Describe a person called Ada who lives in London.", "Invent a character for a short story."]
# greedy, and three seeded samples in one request (n=3: one batch, each choice its own seed)
SAMPLINGS = [{"temperature": 0}, {"temperature": 0.9, "seed": 7, "n": 3, "top_p": 0.95}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the local time in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
        },
    },
}
TOOLS = [WEATHER, TIME]
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(blackbox: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{blackbox.url}/v1", api_key="unused", max_retries=0, timeout=120.0) as api:
        yield api


def ask(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "sampled"])
def test_json_schema_replies_validate_on_every_prompt(
    client: openai.OpenAI, sampling: dict[str, Any]
) -> None:
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True},
    }
    for prompt in PROMPTS:
        response = client.chat.completions.create(
            model=MODEL, messages=ask(prompt), response_format=response_format, max_tokens=60, **sampling
        )
        assert len(response.choices) == sampling.get("n", 1)
        for choice in response.choices:
            assert choice.finish_reason == "stop", choice.message.content
            jsonschema.validate(json.loads(choice.message.content), PERSON_SCHEMA)


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "sampled"])
def test_json_object_replies_are_objects(client: openai.OpenAI, sampling: dict[str, Any]) -> None:
    prompt = "Reply with a JSON object with the keys name and color for a red apple. Keep it short."
    response = client.chat.completions.create(
        model=MODEL, messages=ask(prompt), response_format={"type": "json_object"}, max_tokens=60, **sampling
    )
    for choice in response.choices:
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(json.loads(choice.message.content), dict)


class Pet(BaseModel):
    name: str = Field(max_length=12)
    species: Literal["cat", "dog", "parrot"]
    age: int = Field(ge=0, le=30)


def test_parse_helper_fills_a_pydantic_model(client: openai.OpenAI) -> None:
    completion = client.chat.completions.parse(
        model=MODEL,
        messages=ask("Describe my old cat Tom."),
        response_format=Pet,
        max_tokens=50,
        temperature=0,
    )
    pet = completion.choices[0].message.parsed
    assert isinstance(pet, Pet) and pet.species in ("cat", "dog", "parrot")


def test_guided_choice_regex_and_grammar_on_each_api(client: openai.OpenAI, blackbox: ServerProcess) -> None:
    choices = ["yes", "no", 'maybe "so"']
    chat = client.chat.completions.create(
        model=MODEL, messages=ask("Is the sky blue?"), max_tokens=8, extra_body={"guided_choice": choices}
    )
    assert chat.choices[0].message.content in choices and chat.choices[0].finish_reason == "stop"
    completion = client.completions.create(
        model=MODEL,
        prompt="My phone number is",
        max_tokens=16,
        temperature=0.8,
        seed=3,
        extra_body={"guided_regex": r" \d{3}-\d{4}"},
    )
    assert re.fullmatch(r" \d{3}-\d{4}", completion.choices[0].text)
    grammar = 'root ::= "Dear " name ","\nname ::= [A-Z] [a-z]+'
    native = client.post(
        "/inference",
        body={"prompt": "Start a letter:", "max_tokens": 12, "temperature": 0, "guided_grammar": grammar},
        cast_to=dict,
    )
    assert re.fullmatch(r"Dear [A-Z][a-z]+,", native["choices"][0]["text"]), native


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                }
            },
            "response_format.json_schema.schema",
        ),
        ({"extra_body": {"guided_regex": "a(b"}}, "guided_regex"),
        ({"extra_body": {"guided_grammar": "root ::= undefined_rule"}}, "guided_grammar"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}},
            "tool_choice",
        ),
    ],
)
def test_invalid_guides_are_a_400_naming_the_problem(
    client: openai.OpenAI, fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=ask("hi"), max_tokens=4, **fields)
    error = caught.value.body
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def check_weather_call(call: Any) -> dict[str, Any]:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])
    return arguments


def test_tool_choice_required_gives_valid_calls(client: openai.OpenAI) -> None:
    sampled = SAMPLINGS[1]  # greedy decoding is the named-function test's
    response = client.chat.completions.create(
        model=MODEL,
        messages=WEATHER_QUESTION,
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=60,
        **sampled,
    )
    for choice in response.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            check_weather_call(call)


def test_named_tool_call_streams_argument_deltas_that_reassemble(client: openai.OpenAI) -> None:
    forced = {"type": "function", "function": {"name": "get_weather"}}
    request = {"model": MODEL, "messages": WEATHER_QUESTION, "tools": TOOLS, "tool_choice": forced}
    whole = client.chat.completions.create(**request, max_tokens=60, temperature=0)
    assert whole.choices[0].finish_reason == "tool_calls"
    (call,) = whole.choices[0].message.tool_calls
    expected = check_weather_call(call)
    pieces: list[str] = []
    names, finish = [], None
    for chunk in client.chat.completions.create(**request, max_tokens=60, temperature=0, stream=True):
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                assert delta.index == 0
                if delta.function.name:
                    names.append(delta.function.name)
                pieces.append(delta.function.arguments or "")
            finish = choice.finish_reason or finish
    assert names == ["get_weather"] and finish == "tool_calls"
    assert len([piece for piece in pieces if piece]) > 1  # arguments arrive in pieces, as OpenAI streams them
    assert "".join(pieces) == call.function.arguments and json.loads("".join(pieces)) == expected


def test_tool_result_follow_up(client: openai.OpenAI) -> None:
    # what a client sends back after running the call it received (the calls' own shape)
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
    }
    result = json.dumps({"temperature": 21, "sky": "sunny"})
    follow_up = [
        *WEATHER_QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": result},
    ]
    answer = client.chat.completions.create(
        model=MODEL, messages=follow_up, tools=TOOLS, max_tokens=24, temperature=0
    )
    choice = answer.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls
