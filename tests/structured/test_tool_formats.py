"""Tool formats of chat templates (structured/tool_formats.py) without a server: detection from the
template source, the prompt the template renders with its own `tools`, the grammar each family
forces (checked on SmolLM2's vocabulary), reading replies whole and streamed, and a random synthetic
model whose greedy, grammar-forced reply is in the family's exact text format."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from bitserve.loader.gguf_reader import read_gguf
from bitserve.server.chat_tool_calls import StreamedToolCalls, message_with_tool_calls
from bitserve.structured.grammars import GrammarCompiler, compact_structural_tag
from bitserve.structured.tool_formats import (
    HERMES,
    JSON_CONVENTION,
    LLAMA3_JSON,
    ToolFormat,
    ToolRequest,
    tool_format_for,
)
from bitserve.structured.tools import assistant_tool_calls, parse_tool_choice, parse_tools
from bitserve.testing.tool_templates import HERMES_TEMPLATE, LLAMA31_TEMPLATE, write_tool_template_model
from bitserve.tokenizer.chat_template import ChatTemplate
from bitserve.tokenizer.gguf_vocab import tokenizer_from_gguf

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "London"]}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
TOOLS = parse_tools(
    [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather now",
                "parameters": WEATHER_PARAMETERS,
            },
        },
        {"type": "function", "function": {"name": "get_time"}},
    ]
)
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
# an earlier call as a client sends it back (arguments as JSON text)
PARIS_CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
# each family's exact reply text for two calls (Llama: one call per turn)
REPLIES = {
    "hermes": (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
        "\n</tool_call>\n"
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    ),
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
}
FAMILIES = {"hermes": (HERMES, HERMES_TEMPLATE), "llama3_json": (LLAMA3_JSON, LLAMA31_TEMPLATE)}
# the whole reply a forced call must be: the family's wrapper around each call's JSON
EXACT_REPLY = {
    "hermes": re.compile(
        r'<tool_call>\n\{"name": "get_weather", "arguments": (\{.*\})\}\n</tool_call>', re.S
    ),
    "llama3_json": re.compile(r'\{"name": "get_weather", "parameters": (\{.*\})\}', re.S),
}


def request(tool_choice: Any, parallel: bool = True) -> ToolRequest:
    return ToolRequest(TOOLS, parse_tool_choice(tool_choice, TOOLS), parallel)


def test_detection_from_the_template_source(tokenizer_source: Path) -> None:
    with read_gguf(tokenizer_source) as gguf:
        smollm2_template = gguf.metadata.get("tokenizer.chat_template")
    assert tool_format_for(smollm2_template) is JSON_CONVENTION  # ChatML: no tool format of its own
    assert tool_format_for(HERMES_TEMPLATE) is HERMES
    assert tool_format_for(LLAMA31_TEMPLATE) is LLAMA3_JSON
    assert tool_format_for(None) is JSON_CONVENTION
    # a template that mentions the markers but never reads `tools` keeps the convention
    assert (
        tool_format_for("{{ '<tool_call>' }}{% for m in messages %}{{ m.content }}{% endfor %}")
        is JSON_CONVENTION
    )


def test_hermes_prompt_uses_the_template_and_round_trips_calls() -> None:
    history = [
        *QUESTION,
        {
            "role": "assistant",
            "content": "",
            **HERMES.assistant_fields(assistant_tool_calls([PARIS_CALL], "m")),
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "sunny"}'},
    ]
    messages, template_tools = HERMES.prompt(history, request("auto"))
    assert messages == history  # no system-message injection: the template renders the tools
    text = ChatTemplate(HERMES_TEMPLATE).render(messages, tools=template_tools).text
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>' in text
    )
    assert '<|im_start|>user\n<tool_response>\n{"sky": "sunny"}\n</tool_response><|im_end|>' in text
    assert text.endswith("<|im_start|>assistant\n")
    none_messages, none_tools = HERMES.prompt(QUESTION, request("none"))
    assert none_tools is None and "<tools>" not in ChatTemplate(HERMES_TEMPLATE).render(none_messages).text


def test_llama_prompt_puts_tools_in_the_first_user_message() -> None:
    history = [
        *QUESTION,
        {
            "role": "assistant",
            "content": "",
            **LLAMA3_JSON.assistant_fields(assistant_tool_calls([PARIS_CALL], "m")),
        },
        {"role": "tool", "content": "21 C"},
    ]
    messages, template_tools = LLAMA3_JSON.prompt(history, request("required"))
    text = ChatTemplate(LLAMA31_TEMPLATE).render(messages, tools=template_tools).text
    assert "Environment: ipython" in text and '"name": "get_weather"' in text
    assert 'Respond in the format {"name": function name, "parameters"' in text
    assert '<|end_header_id|>\n\n{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>' in text
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n"21 C"<|eot_id|>' in text


def test_convention_prompt_is_the_system_message() -> None:
    messages, template_tools = JSON_CONVENTION.prompt(QUESTION, request("auto"))
    assert (
        template_tools is None and messages[0]["role"] == "system" and "get_weather" in messages[0]["content"]
    )


@pytest.fixture(scope="module")
def grammars(tokenizer_source: Path) -> GrammarCompiler:
    with read_gguf(tokenizer_source) as gguf:
        tokenizer = tokenizer_from_gguf(gguf.metadata)
    return GrammarCompiler(tokenizer, tokenizer.vocab_size)


def accepts(grammars: GrammarCompiler, fmt: ToolFormat, tool_request: ToolRequest, text: str) -> bool:
    guide = fmt.guide(tool_request)
    assert guide is not None
    matcher = grammars.matcher(guide)
    return matcher.accept_string(text) and matcher.is_completed()


@pytest.mark.parametrize("family", FAMILIES)
def test_forced_grammar_is_the_family_format(grammars: GrammarCompiler, family: str) -> None:
    fmt = FAMILIES[family][0]
    reply = REPLIES[family]
    assert accepts(grammars, fmt, request("required"), reply)
    first_call = reply.split("\n<tool_call>")[0] if family == "hermes" else reply
    assert accepts(grammars, fmt, request("required", parallel=False), first_call)
    if family == "hermes":  # parallel_tool_calls false: one call, as the convention's grammar
        assert not accepts(grammars, fmt, request("required", parallel=False), reply)
    named = {"type": "function", "function": {"name": "get_time"}}
    assert not accepts(grammars, fmt, request(named), first_call)  # the named function only
    bad_arguments = first_call.replace('"Paris"', '"Rome"')
    assert not accepts(grammars, fmt, request("required"), bad_arguments)
    assert not accepts(grammars, fmt, request("required"), "Sure! " + first_call)
    assert fmt.guide(request("auto")) is None


def test_structural_tag_schemas_convert_once_per_spec(
    grammars: GrammarCompiler, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forced request's tag compiles twice (validation, then the runner): each tool's schema is
    turned into its compact-JSON grammar only the first time."""
    import xgrammar

    conversions: list[str] = []
    convert = xgrammar.Grammar.from_json_schema

    def counted(schema: str, **options: Any) -> Any:
        conversions.append(schema)
        return convert(schema, **options)

    monkeypatch.setattr(xgrammar.Grammar, "from_json_schema", counted)
    compact_structural_tag.cache_clear()
    guide = HERMES.guide(request("required"))
    assert guide is not None
    grammars.validate(guide)
    assert accepts(grammars, HERMES, request("required"), REPLIES["hermes"])
    assert len(conversions) == len(TOOLS)


@pytest.mark.parametrize("family", FAMILIES)
def test_whole_and_streamed_replies_read_the_same(family: str) -> None:
    fmt, reply = FAMILIES[family][0], REPLIES[family]
    message, finish = message_with_tool_calls(reply, "stop", TOOLS, fmt)
    assert finish == "tool_calls" and message["content"] is None
    whole = [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    assert json.loads(whole[0][1]) == {"city": "Paris", "unit": "celsius"}
    stream = StreamedToolCalls(TOOLS, True, fmt)
    deltas = [stream.delta(reply[i : i + 4], None)[0] for i in range(0, len(reply), 4)]
    assert stream.delta("", "stop")[1] == "tool_calls"
    entries = [entry for delta in deltas for entry in delta.get("tool_calls", [])]
    names = [entry["function"]["name"] for entry in entries if "id" in entry]
    streamed = [
        (name, "".join(e["function"]["arguments"] for e in entries if e["index"] == index))
        for index, name in enumerate(names)
    ]
    assert streamed == whole
    held = StreamedToolCalls(TOOLS, False, fmt)  # auto: a possible call is held back until it ends
    assert held.delta(reply[:3], None) == ({}, None)
    assert held.delta(reply[3:], "stop")[1] == "tool_calls"


@pytest.mark.parametrize(
    ("family", "text"),
    [
        ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'),  # unclosed tag
        ("hermes", 'I will call it: <tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'),
        ("hermes", '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>'),
        ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {}\n</tool_call>'),  # broken JSON
        ("llama3_json", '{"name": "get_time", "parameters": {}} and then more text'),
        ("llama3_json", '{"name": "get_time", "arguments": {}}'),  # the other family's key
        ("llama3_json", '{"name": "get_time", "parameters": {}}; {"name": "get_time", "parameters": {}}'),
        ("llama3_json", "The weather is {probably} fine."),
    ],
)
def test_malformed_auto_replies_stay_text(family: str, text: str) -> None:
    fmt = FAMILIES[family][0]
    assert fmt.parse(text, TOOLS) is None
    assert message_with_tool_calls(text, "stop", TOOLS, fmt) == (
        {"role": "assistant", "content": text},
        "stop",
    )
    stream = StreamedToolCalls(TOOLS, False, fmt)
    streamed = [stream.delta(text[i : i + 7], None)[0].get("content", "") for i in range(0, len(text), 7)]
    last, finish = stream.delta("", "stop")
    assert "".join(streamed) + last.get("content", "") == text and finish == "stop"


def test_python_tag_prefix_is_a_llama_call() -> None:
    calls = LLAMA3_JSON.parse('<|python_tag|>{"name": "get_time", "parameters": {}}', TOOLS)
    assert calls is not None and calls[0].name == "get_time"


@pytest.mark.parametrize("family", FAMILIES)
def test_random_model_forced_reply_is_in_the_family_format(
    tmp_path: Path, synthetic_config: Any, synthetic_weights: Any, family: str
) -> None:
    from bitserve import LLM, SamplingParams
    from bitserve.config import EngineConfig, ModelConfig, SchedulerConfig

    fmt, template = FAMILIES[family]
    tokenizer, weights = synthetic_weights
    path = write_tool_template_model(
        tmp_path / f"{family}.gguf", template, config=synthetic_config, weights=weights, tokenizer=tokenizer
    )
    llm = LLM(
        config=EngineConfig(model=ModelConfig(model=str(path)), scheduler=SchedulerConfig(max_model_len=1024))
    )
    assert llm.instance.tool_format is fmt
    named = request({"type": "function", "function": {"name": "get_weather"}})
    messages, template_tools = fmt.prompt(list(QUESTION), named)
    prompt = llm.instance.encode_chat(messages, template_tools)
    params = SamplingParams(temperature=0, max_tokens=80, guide=fmt.guide(named))
    (output,) = llm.generate(prompt, params)[0].outputs
    assert output.finish_reason == "stop", output.text
    match = EXACT_REPLY[family].fullmatch(output.text)
    assert match, output.text
    jsonschema.validate(json.loads(match.group(1)), WEATHER_PARAMETERS)
    calls = fmt.parse(output.text, TOOLS)
    assert calls is not None and [call.name for call in calls] == ["get_weather"]
    assert calls[0].arguments == match.group(1)
