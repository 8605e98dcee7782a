"""Chat messages -> prompt: the GGUF's Jinja template in a sandbox, or a named fallback format.

Rendering yields text segments, each with its own parse_special; encode_chat() turns them into
token ids. The file's BitNet placeholder template is never rendered (docs/formats.md §5.3).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from bitserve.errors import InvalidModelFile, InvalidRequest
from bitserve.tokenizer.base import Tokenizer

logger = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool")  # "tool": results of tool calls (structured/tools.py)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Gemma turns: no system role, so a leading system message prefixes the first user turn (as in
# Google's template for the -it models); the model speaks as `model`.
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}"
    "{% set first_user_prefix = messages[0]['content'] + '\n\n' %}{% set loop_messages = messages[1:] %}"
    "{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if message['role'] == 'system' %}"
    "{{ raise_exception('Gemma takes a system message only first') }}{% endif %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') "
    "+ message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
# The official BitNet b1.58 2B-4T format (microsoft/BitNet gpu/tokenizer.py), built in code.
BITNET_TEMPLATE_NAME = "bitnet"
NAMED_TEMPLATES = ("chatml", BITNET_TEMPLATE_NAME, "gemma")
_NAMED_SOURCES = {"chatml": CHATML_TEMPLATE, "gemma": GEMMA_TEMPLATE}
# convert-ms-to-gguf-bitnet.py writes a placeholder holding this marker; llama.cpp keys on it too.
_BITNET_MARKER = "BITNET"


@dataclass(frozen=True)
class PromptSegment:
    """A piece of prompt text; parse_special says whether special tokens written in it count."""

    text: str
    parse_special: bool


@dataclass(frozen=True)
class ChatPrompt:
    """A rendered chat. `template_name` is "gguf" for the file's own template, else the name used."""

    segments: tuple[PromptSegment, ...]
    template_name: str

    @property
    def text(self) -> str:
        return "".join(segment.text for segment in self.segments)


class _TemplateRaised(Exception):
    """raise_exception() called from inside a template: the messages break the template's rules."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # HF's override: Jinja's own tojson HTML-escapes, which chat templates do not expect.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(date_format: str) -> str:
    return datetime.now().strftime(date_format)


def _sandbox() -> ImmutableSandboxedEnvironment:
    """The environment HF transformers renders chat templates in (minus its generation tracker)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """One model's chat format, compiled once; `render` is safe to call from any thread.

    source: the GGUF's `tokenizer.chat_template` (None if absent). name: a named template to use
    instead (one of NAMED_TEMPLATES). A source holding the BitNet placeholder selects "bitnet".
    bitnet_segmentwise: encode BitNet headers and contents separately, as Microsoft's code does
    (default, docs/formats.md §5.3); False renders one string, as llama.cpp-style servers would.
    """

    def __init__(
        self,
        source: str | None,
        *,
        name: str | None = None,
        bos_token: str = "",
        eos_token: str = "",
        architecture: str | None = None,
        bitnet_segmentwise: bool = True,
    ) -> None:
        self._bos_token = bos_token
        self._eos_token = eos_token
        self._bitnet_segmentwise = bitnet_segmentwise
        self._compiled: jinja2.Template | None = None
        self.source: str | None = None  # the GGUF's Jinja source when it is what renders (tool formats)
        if name is not None:
            if name not in NAMED_TEMPLATES:
                raise InvalidRequest(
                    f"unknown chat template name {name!r}",
                    param="chat_template",
                    hint=f"one of {', '.join(NAMED_TEMPLATES)}",
                )
            self.name = name
        elif source is None:
            raise _no_template_error(architecture)
        elif _BITNET_MARKER in source:
            logger.info("chat template is the BitNet placeholder: using the official BitNet format")
            self.name = BITNET_TEMPLATE_NAME
        else:
            self.name = "gguf"
            self.source = source
        if self.name != BITNET_TEMPLATE_NAME:
            template_source = _NAMED_SOURCES[self.name] if self.name in _NAMED_SOURCES else source
            assert template_source is not None  # "gguf" is chosen only with a source
            try:
                self._compiled = _sandbox().from_string(template_source)
            except jinja2.TemplateSyntaxError as exc:
                raise InvalidModelFile(
                    f"tokenizer.chat_template is not valid Jinja: {exc.message} (line {exc.lineno})",
                    hint=f"configure a named chat template instead ({', '.join(NAMED_TEMPLATES)})",
                ) from exc

    @classmethod
    def for_tokenizer(
        cls,
        tokenizer: Tokenizer,
        source: str | None,
        *,
        name: str | None = None,
        architecture: str | None = None,
        bitnet_segmentwise: bool = True,
    ) -> ChatTemplate:
        """The template with `bos_token` / `eos_token` taken from the tokenizer's vocabulary."""
        bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
        return cls(
            source,
            name=name,
            bos_token="" if bos is None else tokenizer.id_to_piece(bos),
            eos_token="" if eos is None else tokenizer.id_to_piece(eos),
            architecture=architecture,
            bitnet_segmentwise=bitnet_segmentwise,
        )

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> ChatPrompt:
        """Validate `messages` and render them; `tools` (OpenAI tool objects) is the template's own
        `tools` variable, for templates with a tool format (structured/tool_formats.py). Raises
        InvalidRequest for bad messages or when the template rejects them (its raise_exception) or
        fails on them."""
        clean = normalize_messages(messages)
        if self._compiled is None:
            return ChatPrompt(
                _bitnet_segments(clean, add_generation_prompt, self._bitnet_segmentwise), self.name
            )
        try:
            text = self._compiled.render(
                messages=clean,
                add_generation_prompt=add_generation_prompt,
                bos_token=self._bos_token,
                eos_token=self._eos_token,
                tools=tools,
                documents=None,
            )
        except _TemplateRaised as exc:
            raise InvalidRequest(f"the chat template rejected the messages: {exc}", param="messages") from exc
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError) as exc:
            raise InvalidRequest(
                f"the chat template failed on these messages: {type(exc).__name__}: {exc}",
                param="messages",
                hint="the model's chat template may not support this conversation shape",
            ) from exc
        return ChatPrompt((PromptSegment(text, parse_special=True),), self.name)


def render_chat(
    template: str | None,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    architecture: str | None = None,
    template_name: str | None = None,
    bitnet_segmentwise: bool = True,
) -> ChatPrompt:
    """One-shot `ChatTemplate(...).render(...)`; servers should build the ChatTemplate once."""
    chat_template = ChatTemplate(
        template,
        name=template_name,
        bos_token=bos_token,
        eos_token=eos_token,
        architecture=architecture,
        bitnet_segmentwise=bitnet_segmentwise,
    )
    return chat_template.render(messages, add_generation_prompt=add_generation_prompt)


def encode_chat(tokenizer: Tokenizer, prompt: ChatPrompt) -> list[int]:
    """Token ids for a rendered chat: each segment encoded on its own, then at most one BOS.

    Templates often write the BOS themselves; the vocabulary's add_bos then adds none, and a
    vocabulary that wants a BOS gets exactly one (llama.cpp strips the duplicate the same way).
    """
    ids: list[int] = []
    for segment in prompt.segments:
        ids.extend(tokenizer.encode(segment.text, add_special=False, parse_special=segment.parse_special))
    bos = tokenizer.bos_token_id
    if tokenizer.add_bos and bos is not None and (not ids or ids[0] != bos):
        ids.insert(0, bos)
    return ids


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Check OpenAI-style messages; returns plain {"role", "content"[, "name"]} dicts with string
    content (a list of text parts is joined with newlines), keeping an assistant's `tool_calls` list
    and a tool result's `tool_call_id` for templates that render them. Raises InvalidRequest naming
    the field."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise InvalidRequest("messages must be a non-empty list", param="messages")
    result: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, Mapping):
            raise InvalidRequest(f"{where} must be an object", param=where)
        role = message.get("role")
        if role not in ROLES:
            raise InvalidRequest(
                f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", param=f"{where}.role"
            )
        clean: dict[str, Any] = {"role": role, "content": _content_text(message.get("content"), role, where)}
        name = message.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise InvalidRequest(f"{where}.name must be a string", param=f"{where}.name")
            clean["name"] = name
        _keep_tool_fields(message, clean, where)
        result.append(clean)
    return result


def _keep_tool_fields(message: Mapping[str, Any], clean: dict[str, Any], where: str) -> None:
    tool_calls = message.get("tool_calls")
    if tool_calls is not None:
        if message["role"] != "assistant" or not isinstance(tool_calls, list):
            raise InvalidRequest(
                f"{where}.tool_calls must be a list, on an assistant message", param=f"{where}.tool_calls"
            )
        clean["tool_calls"] = tool_calls
    if isinstance(message.get("tool_call_id"), str):
        clean["tool_call_id"] = message["tool_call_id"]


def _content_text(content: Any, role: str, where: str) -> str:
    if isinstance(content, str):
        return content
    if content is None and role == "assistant":
        return ""
    if isinstance(content, Sequence) and not isinstance(content, (str, bytes)):
        texts: list[str] = []
        for part_index, part in enumerate(content):
            part_where = f"{where}.content[{part_index}]"
            if not isinstance(part, Mapping) or part.get("type") != "text":
                raise InvalidRequest(
                    f"{part_where}: only text parts ({{'type': 'text'}}) are supported", param=part_where
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise InvalidRequest(f"{part_where}.text must be a string", param=f"{part_where}.text")
            texts.append(text)
        return "\n".join(texts)
    raise InvalidRequest(
        f"{where}.content must be a string or a list of text parts", param=f"{where}.content"
    )


def _bitnet_segments(
    messages: list[dict[str, str]], add_generation_prompt: bool, segmentwise: bool
) -> tuple[PromptSegment, ...]:
    """`<|begin_of_text|>`, then `{Role}: ` + stripped content + `<|eot_id|>` per message, then
    `Assistant: `. Segment-wise, message text is plain text (special tokens in it are not parsed),
    as tiktoken encodes it in Microsoft's ChatFormat."""
    segments = [PromptSegment("<|begin_of_text|>", parse_special=True)]
    for message in messages:
        segments.append(PromptSegment(f"{message['role'].capitalize()}: ", parse_special=False))
        content = message["content"].strip()
        if content:
            segments.append(PromptSegment(content, parse_special=False))
        segments.append(PromptSegment("<|eot_id|>", parse_special=True))
    if add_generation_prompt:
        segments.append(PromptSegment("Assistant: ", parse_special=False))
    if not segmentwise:
        return (PromptSegment("".join(segment.text for segment in segments), parse_special=True),)
    return tuple(segments)


def _no_template_error(architecture: str | None) -> InvalidRequest:
    suggestion = BITNET_TEMPLATE_NAME if architecture and "bitnet" in architecture else "chatml"
    return InvalidRequest(
        "this model has no chat template (its GGUF has no tokenizer.chat_template), so chat messages "
        "cannot be formatted",
        param="messages",
        hint=(
            f"configure the model's chat_template with a name ({', '.join(NAMED_TEMPLATES)}; likely "
            f"{suggestion!r}) or Jinja source, or send a raw prompt to /v1/completions"
        ),
    )
