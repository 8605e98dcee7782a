"""The Anthropic Messages API's request bodies (`POST /v1/messages`, `/v1/messages/count_tokens`), and
their one translation into the chat request every generation endpoint already serves: content blocks
become chat messages, `tool_use` blocks an assistant's `tool_calls`, `tool_result` blocks `tool`
messages, Anthropic's `tools` / `tool_choice` the OpenAI ones (structured/tools.py parses those). So
the same admission, sampling, tool formats, grammars, limits and metrics run both APIs; only the wire
shapes differ (serving_messages.py).

Every field is bounded as protocol.py bounds the chat ones; known fields bitserve does not implement
(images, documents, extended thinking, MCP servers, a final assistant message as a prefill) are refused
with 400 naming the field, never ignored.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field

from bitserve.errors import InvalidRequest
from bitserve.sampling_params import MAX_MAX_TOKENS, MAX_NUM_STOP, MAX_TEMPERATURE, MAX_TOP_K
from bitserve.server.body import validate_request
from bitserve.server.errors import UnsupportedParameter
from bitserve.server.protocol import (
    MAX_CONTENT_CHARS,
    MAX_MODEL_NAME_CHARS,
    MAX_NUM_CONTENT_PARTS,
    MAX_NUM_MESSAGES,
    MAX_USER_CHARS,
    ChatCompletionRequest,
    StopText,
    StrictModel,
)
from bitserve.structured.tools import MAX_TOOLS

MAX_TOOL_NAME_CHARS = 64  # Anthropic's rule, as OpenAI's: ^[a-zA-Z0-9_-]{1,64}$ (tools.py checks it)
MAX_TOOL_ID_CHARS = 256
MAX_DESCRIPTION_CHARS = 65_536
# Anthropic's error-marked tool results reach the model as text; this says which ones failed.
TOOL_ERROR_PREFIX = "Error: "


class ContentBlock(StrictModel):
    """One block of a message's content. Which fields a block needs depends on its type
    (checked in `_message_parts`); `cache_control` is accepted and needs nothing: bitserve's prefix
    cache reuses every shared prefix by itself."""

    type: str = Field(max_length=64)
    text: str | None = Field(None, max_length=MAX_CONTENT_CHARS)
    id: str | None = Field(None, min_length=1, max_length=MAX_TOOL_ID_CHARS)  # tool_use
    name: str | None = Field(None, min_length=1, max_length=MAX_TOOL_NAME_CHARS)  # tool_use
    input: dict[str, Any] | None = None  # tool_use
    tool_use_id: str | None = Field(None, min_length=1, max_length=MAX_TOOL_ID_CHARS)  # tool_result
    content: (  # tool_result: a string or text blocks
        Annotated[str, Field(max_length=MAX_CONTENT_CHARS)]
        | Annotated[list[ContentBlock], Field(max_length=MAX_NUM_CONTENT_PARTS)]
        | None
    ) = None
    is_error: bool = False  # tool_result
    cache_control: Any = None
    citations: Any = None


Content = (
    Annotated[str, Field(max_length=MAX_CONTENT_CHARS)]
    | Annotated[list[ContentBlock], Field(min_length=1, max_length=MAX_NUM_CONTENT_PARTS)]
)


class AnthropicMessage(StrictModel):
    role: Literal["user", "assistant"]
    content: Content


class AnthropicTool(StrictModel):
    name: str = Field(min_length=1, max_length=MAX_TOOL_NAME_CHARS)
    description: str | None = Field(None, max_length=MAX_DESCRIPTION_CHARS)
    input_schema: dict[str, Any]
    type: str | None = Field(None, max_length=64)  # "custom" or absent; server tools are refused
    cache_control: Any = None


class AnthropicToolChoice(StrictModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(None, min_length=1, max_length=MAX_TOOL_NAME_CHARS)
    disable_parallel_tool_use: bool = False


class Metadata(StrictModel):
    user_id: str | None = Field(None, max_length=MAX_USER_CHARS)


class MessagesInput(StrictModel):
    """What count_tokens and a generation share: the model, the conversation and the tools."""

    model: str = Field(min_length=1, max_length=MAX_MODEL_NAME_CHARS)
    messages: list[AnthropicMessage] = Field(min_length=1, max_length=MAX_NUM_MESSAGES)
    system: (
        Annotated[str, Field(max_length=MAX_CONTENT_CHARS)]
        | Annotated[list[ContentBlock], Field(max_length=MAX_NUM_CONTENT_PARTS)]
        | None
    ) = None
    tools: list[AnthropicTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: AnthropicToolChoice | None = None
    # Known Anthropic fields without an implementation: anything but their off value gets 400.
    thinking: Any = None
    mcp_servers: Any = None
    container: Any = None

    def check_supported(self) -> None:
        thinking_off = self.thinking is None or (
            isinstance(self.thinking, dict) and self.thinking.get("type") == "disabled"
        )
        _refuse_unless(thinking_off, "thinking", "extended thinking is not implemented")
        _refuse_unless(self.mcp_servers in (None, []), "mcp_servers", "no MCP connector")
        _refuse_unless(self.container is None, "container", "no code-execution containers")
        for index, tool in enumerate(self.tools or []):
            _refuse_unless(
                tool.type in (None, "custom"), f"tools[{index}].type", "only client tools (input_schema)"
            )
        if self.messages[-1].role == "assistant":
            raise UnsupportedParameter(
                "a final assistant message (a prefill) is not supported by bitserve",
                param=f"messages[{len(self.messages) - 1}]",
                hint="end the conversation with a user message",
            )

    def chat_fields(self) -> dict[str, Any]:
        """The chat request's messages, tools and tool_choice for this conversation."""
        messages = _system_messages(self.system)
        for index, message in enumerate(self.messages):
            messages += _chat_messages(message, f"messages[{index}]")
        fields: dict[str, Any] = {"model": self.model, "messages": messages}
        if self.tools:
            fields["tools"] = [_openai_tool(tool) for tool in self.tools]
        if self.tool_choice is not None:
            fields["tool_choice"] = _openai_tool_choice(self.tool_choice)
            fields["parallel_tool_calls"] = not self.tool_choice.disable_parallel_tool_use
        return fields

    def to_chat_request(self) -> ChatCompletionRequest:
        return validate_request(self.chat_fields(), ChatCompletionRequest)


class JSONOutputFormat(StrictModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(StrictModel):
    format: JSONOutputFormat | None = None  # structured outputs: the reply is JSON of this schema
    effort: Any = None


class MessagesRequest(MessagesInput):
    """`POST /v1/messages`. temperature / top_p / top_k are no longer typed parameters of the 2026
    SDKs (clients send them in `extra_body`); older clients send them as fields: both arrive here."""

    max_tokens: int = Field(ge=1, le=MAX_MAX_TOKENS)
    stop_sequences: list[StopText] | None = Field(None, max_length=MAX_NUM_STOP)
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=MAX_TOP_K)
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    output_config: OutputConfig | None = None

    def check_supported(self) -> None:
        super().check_supported()
        effort = self.output_config.effort if self.output_config is not None else None
        _refuse_unless(effort is None, "output_config.effort", "not a reasoning model")

    def chat_fields(self) -> dict[str, Any]:
        fields = super().chat_fields()
        fields["max_tokens"] = self.max_tokens
        fields["stream"] = self.stream
        sampling = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}
        fields.update({name: value for name, value in sampling.items() if value is not None})
        if self.stop_sequences:
            fields["stop"] = list(self.stop_sequences)
        if self.metadata is not None and self.metadata.user_id is not None:
            fields["user"] = self.metadata.user_id
        if self.output_config is not None and self.output_config.format is not None:
            schema = self.output_config.format.schema_
            fields["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "output", "schema": schema},
            }
        return fields


def _refuse_unless(allowed: bool, param: str, what: str) -> None:
    if not allowed:
        raise UnsupportedParameter(
            f"{param} is not supported by bitserve ({what})", param=param, hint=f"remove {param}"
        )


def _block_text(block: ContentBlock, where: str) -> str:
    if block.type != "text" or block.text is None:
        raise UnsupportedParameter(
            f"{where}: content of type {block.type[:40]!r} is not supported here by bitserve",
            param=f"{where}.type",
            hint="send text blocks (and tool_use / tool_result blocks in messages)",
        )
    return block.text


def _system_messages(system: str | list[ContentBlock] | None) -> list[dict[str, Any]]:
    if system is None:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}] if system else []
    text = "".join(_block_text(block, f"system[{j}]") for j, block in enumerate(system))
    return [{"role": "system", "content": text}]


def _tool_result_text(block: ContentBlock, where: str) -> str:
    if block.tool_use_id is None:
        raise InvalidRequest(f"{where}.tool_use_id is required", param=f"{where}.tool_use_id")
    content = block.content
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        text = "".join(_block_text(part, f"{where}.content[{k}]") for k, part in enumerate(content))
    return TOOL_ERROR_PREFIX + text if block.is_error else text


def _tool_call(block: ContentBlock, where: str) -> dict[str, Any]:
    if block.id is None or block.name is None or block.input is None:
        raise InvalidRequest(f"{where}: a tool_use block needs id, name and input", param=where)
    arguments = json.dumps(block.input, ensure_ascii=False)
    return {"id": block.id, "type": "function", "function": {"name": block.name, "arguments": arguments}}


def _chat_messages(message: AnthropicMessage, where: str) -> list[dict[str, Any]]:
    """One Anthropic message -> chat messages: an assistant's text and tool calls as one message; a
    user's tool results each as a `tool` message, then its text (if any) as a user message."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, block in enumerate(message.content):
        at = f"{where}.content[{j}]"
        if block.type == "tool_use" and message.role == "assistant":
            calls.append(_tool_call(block, at))
        elif block.type == "tool_result" and message.role == "user":
            results.append(
                {"role": "tool", "tool_call_id": block.tool_use_id, "content": _tool_result_text(block, at)}
            )
        else:
            texts.append(_block_text(block, at))
    text = "".join(texts)
    if message.role == "assistant":
        entry: dict[str, Any] = {"role": "assistant", "content": text or None}
        if calls:
            entry["tool_calls"] = calls
        return [entry]
    return results + ([{"role": "user", "content": text}] if texts or not results else [])


def _openai_tool(tool: AnthropicTool) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
    if tool.description is not None:
        function["description"] = tool.description
    return {"type": "function", "function": function}


def _openai_tool_choice(choice: AnthropicToolChoice) -> Any:
    if choice.type == "tool":
        if choice.name is None:
            raise InvalidRequest('tool_choice of type "tool" needs a name', param="tool_choice.name")
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]
