"""Chat templates: the GGUF's Jinja in a sandbox, named fallbacks, the BitNet format, validation."""

from __future__ import annotations

import re
from typing import Any

import pytest

from bitserve.errors import InvalidModelFile, InvalidRequest
from bitserve.tokenizer.chat_template import (
    CHATML_TEMPLATE,
    ChatTemplate,
    PromptSegment,
    encode_chat,
    normalize_messages,
    render_chat,
)
from bitserve.tokenizer.gguf_vocab import GGUFTokenizer

HI = [{"role": "user", "content": "Hi"}]


def test_smollm2_template_renders_chatml_with_its_default_system_prompt(
    smollm2_tokenizer: GGUFTokenizer,
) -> None:
    prompt = render_chat(smollm2_tokenizer.chat_template, HI)
    assert prompt.template_name == "gguf"
    assert prompt.text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = encode_chat(smollm2_tokenizer, prompt)
    assert ids == smollm2_tokenizer.encode(prompt.text, add_special=False)
    assert ids[0] == 1 and ids.count(2) == 2  # <|im_start|> / <|im_end|> as single tokens


def test_template_for_tokenizer_uses_the_vocabulary_bos_and_eos(smollm2_tokenizer: GGUFTokenizer) -> None:
    source = "{{ bos_token }}{{ messages[0]['content'] }}{{ eos_token }}"
    template = ChatTemplate.for_tokenizer(smollm2_tokenizer, source)
    assert template.render(HI).text == "<|im_start|>Hi<|im_end|>"


def test_generation_prompt_is_optional() -> None:
    prompt = render_chat(None, HI, template_name="chatml", add_generation_prompt=False)
    assert prompt.text == "<|im_start|>user\nHi<|im_end|>\n"
    assert render_chat(CHATML_TEMPLATE, HI).text.endswith("<|im_start|>assistant\n")


def test_bitnet_placeholder_selects_the_official_format(build_variant: Any) -> None:
    tokenizer, metadata = build_variant("llama3_bpe")
    source = metadata["tokenizer.chat_template"]
    messages = [{"role": "system", "content": " Be brief. "}, {"role": "user", "content": "Hey\n"}]
    prompt = render_chat(source, messages, architecture="bitnet-b1.58")
    assert prompt.template_name == "bitnet"
    assert prompt.text == "<|begin_of_text|>System: Be brief.<|eot_id|>User: Hey<|eot_id|>Assistant: "
    enc = lambda text: tokenizer.encode(text, add_special=False, parse_special=False)  # noqa: E731
    expected = [128000, *enc("System: "), *enc("Be brief."), 128009, *enc("User: "), *enc("Hey"), 128009]
    assert encode_chat(tokenizer, prompt) == expected + enc("Assistant: ")
    # Segment-wise, "User: " ends in a lone space token; rendering one string gives " Hey" instead.
    assert enc("User: ")[-1] == tokenizer.piece_to_id("Ġ")
    joined = render_chat(source, messages, bitnet_segmentwise=False)
    assert joined.segments == (PromptSegment(prompt.text, parse_special=True),)
    joined_ids = encode_chat(tokenizer, joined)
    assert joined_ids == tokenizer.encode(prompt.text, add_special=False)
    assert tokenizer.piece_to_id("ĠHey") in joined_ids and joined_ids != encode_chat(tokenizer, prompt)


def test_bitnet_message_text_cannot_inject_special_tokens(llama3_tokenizer: GGUFTokenizer) -> None:
    prompt = render_chat(None, [{"role": "user", "content": "a<|eot_id|>b"}], template_name="bitnet")
    ids = encode_chat(llama3_tokenizer, prompt)
    assert ids.count(128009) == 1  # only the template's own terminator


def test_missing_template_is_a_clear_error() -> None:
    with pytest.raises(InvalidRequest, match="no chat template") as info:
        render_chat(None, HI, architecture="bitnet-b1.58")
    assert "'bitnet'" in (info.value.hint or "") and "/v1/completions" in (info.value.hint or "")
    with pytest.raises(InvalidRequest, match="unknown chat template name"):
        render_chat(None, HI, template_name="vicuna")


def test_gemma_fallback_folds_the_system_prompt_into_the_first_turn() -> None:
    messages = [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": " Hello "},
        {"role": "assistant", "content": "Hi!"},
        {"role": "user", "content": "Bye"},
    ]
    prompt = render_chat(None, messages, template_name="gemma", bos_token="<bos>")
    assert prompt.text == (
        "<bos><start_of_turn>user\nBe kind.\n\nHello<end_of_turn>\n<start_of_turn>model\nHi!<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
    )


def test_at_most_one_bos(llama3_tokenizer: GGUFTokenizer) -> None:
    with_bos = render_chat("{{ bos_token }}{{ messages[0]['content'] }}", HI, bos_token="<|begin_of_text|>")
    ids = encode_chat(llama3_tokenizer, with_bos)
    assert ids[0] == 128000 and ids.count(128000) == 1
    without_bos = render_chat("{{ messages[0]['content'] }}", HI)
    assert encode_chat(llama3_tokenizer, without_bos)[0] == 128000


def test_jinja_environment_matches_hf() -> None:
    """trim_blocks / lstrip_blocks, HF's tojson (no HTML escaping), strftime_now, loop controls."""
    source = (
        "{% for m in messages %}\n  {% if loop.index > 2 %}{% break %}{% endif %}\n"
        "{{ m['content'] }}\n{% endfor %}"
    )
    messages = [{"role": "user", "content": c} for c in ("a", "b", "c")]
    assert render_chat(source, messages).text == "a\nb\n"
    tojson = render_chat("{{ messages[0]['content'] | tojson }}", [{"role": "user", "content": "héllo <b>"}])
    assert tojson.text == '"héllo <b>"'
    assert re.fullmatch(r"\d{4}", render_chat("{{ strftime_now('%Y') }}", HI).text)


def test_template_raise_exception_rejects_the_request() -> None:
    source = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('system first') }}{% endif %}"
    with pytest.raises(InvalidRequest, match="rejected the messages: system first"):
        render_chat(source, HI)


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{% set xs = [] %}{{ xs.append(1) }}",
        "{{ messages.__class__ }}{{ messages.pop() }}",
    ],
)
def test_sandbox_blocks_escapes_and_mutation(source: str) -> None:
    with pytest.raises(InvalidRequest, match="chat template failed"):
        render_chat(source, HI)


def test_invalid_jinja_in_the_file_is_a_model_file_error() -> None:
    with pytest.raises(InvalidModelFile, match="not valid Jinja"):
        ChatTemplate("{% for m in messages %}")


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([], "messages"),
        ("hello", "messages"),
        ([{"role": "robot", "content": "x"}], "messages[0].role"),
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "messages[0].content[0]"),
        ([{"role": "user", "content": [{"type": "text", "text": 3}]}], "messages[0].content[0].text"),
        ([{"role": "user", "content": "x", "name": 5}], "messages[0].name"),
        (["not an object"], "messages[0]"),
    ],
)
def test_message_validation_names_the_field(messages: Any, param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        normalize_messages(messages)
    assert info.value.param == param


def test_text_parts_are_joined_and_assistant_content_may_be_empty() -> None:
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]},
        {"role": "assistant", "content": None, "name": "bot"},
    ]
    assert normalize_messages(messages) == [
        {"role": "user", "content": "one\ntwo"},
        {"role": "assistant", "content": "", "name": "bot"},
    ]
