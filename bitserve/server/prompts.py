"""Request text, chat messages or token ids -> prompt token ids. Long inputs are tokenized in a
worker thread so the event loop never stalls on them. Whether the prompt fits the context is the
frontend's admission check (frontend/admission.py), the same for every caller.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from bitserve.engine.process import ServedModel
from bitserve.server.protocol import ChatMessage, PromptInput, check_token_ids, template_messages
from bitserve.structured.tool_formats import ToolRequest

# Inputs longer than this (characters) are tokenized off the event loop.
MAX_INLINE_TOKENIZE_CHARS = 8192
T = TypeVar("T")


async def _run(num_chars: int, fn: Callable[[], T]) -> T:
    if num_chars <= MAX_INLINE_TOKENIZE_CHARS:
        return fn()
    return await asyncio.to_thread(fn)


async def encode_text(instance: ServedModel, text: str, *, add_special: bool = True) -> list[int]:
    """The text's token ids (possibly none: an empty prompt is admission's refusal, not the tokenizer's)."""
    return await _run(len(text), lambda: instance.tokenizer.encode(text, add_special=add_special))


async def encode_messages(
    instance: ServedModel, messages: list[ChatMessage], tools: ToolRequest | None = None
) -> list[int]:
    """Render with the model's chat template and tokenize, `tools` put in the prompt the way the
    model's tool format says. InvalidRequest when it has no template."""
    tool_format = instance.tool_format
    rendered, template_tools = tool_format.prompt(template_messages(messages, tool_format), tools)
    num_chars = sum(len(message["content"]) for message in rendered)
    return await _run(num_chars, lambda: instance.encode_chat(rendered, template_tools))


async def encode_prompt(instance: ServedModel, prompt: PromptInput) -> list[int]:
    """The prompt's token ids, whichever form the request gave it in."""
    if prompt.messages is not None:
        return await encode_messages(instance, prompt.messages, prompt.tools)
    if prompt.text is not None:
        return await encode_text(instance, prompt.text)
    token_ids = list(prompt.token_ids or [])
    check_token_ids(token_ids, instance.tokenizer.vocab_size, prompt.param)
    return token_ids
