"""Request text, chat messages or token ids -> prompt token ids that fit the model's context, and
the max_tokens a request gets. Long inputs are tokenized in a worker thread so the event loop
never stalls on them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from bitserve.errors import InvalidRequest
from bitserve.lifecycle.instance import ModelInstance
from bitserve.server.errors import ContextLengthExceeded
from bitserve.server.protocol import ChatMessage, check_token_ids, template_messages

# Inputs longer than this (characters) are tokenized off the event loop.
MAX_INLINE_TOKENIZE_CHARS = 8192
T = TypeVar("T")


async def _run(num_chars: int, fn: Callable[[], T]) -> T:
    if num_chars <= MAX_INLINE_TOKENIZE_CHARS:
        return fn()
    return await asyncio.to_thread(fn)


async def encode_text(
    instance: ModelInstance, text: str, *, add_special: bool = True, allow_empty: bool = False
) -> list[int]:
    token_ids = await _run(len(text), lambda: instance.tokenizer.encode(text, add_special=add_special))
    if not token_ids and not allow_empty:
        raise InvalidRequest("the prompt is empty (it has no tokens)", param="prompt", hint="send some text")
    return token_ids


async def encode_messages(instance: ModelInstance, messages: list[ChatMessage]) -> list[int]:
    """Render with the model's chat template and tokenize. InvalidRequest when it has no template."""
    rendered = template_messages(messages)
    num_chars = sum(len(message["content"]) for message in rendered)
    return await _run(num_chars, lambda: instance.encode_chat(rendered))


def prompt_from_ids(instance: ModelInstance, token_ids: list[int], param: str = "prompt") -> list[int]:
    check_token_ids(token_ids, instance.tokenizer.vocab_size, param)
    return list(token_ids)


def resolve_max_tokens(num_prompt_tokens: int, requested: int | None, default: int | None, max_model_len: int,
                       *, prompt_param: str = "prompt") -> int:  # fmt: skip
    """Output tokens the request may make: `requested` if it fits, else the default capped by room.

    The prompt alone must leave room for one output token; prompt + requested max_tokens must fit
    in the context (OpenAI answers 400 too, rather than silently truncating).
    """
    room = max_model_len - num_prompt_tokens
    if room < 1:
        raise ContextLengthExceeded(
            f"the prompt has {num_prompt_tokens} tokens; this model's context is {max_model_len} tokens, "
            "which leaves no room for output",
            param=prompt_param, hint=f"shorten the prompt to at most {max_model_len - 1} tokens",
        )  # fmt: skip
    if requested is not None:
        if requested > room:
            raise ContextLengthExceeded(
                f"the prompt ({num_prompt_tokens} tokens) plus max_tokens ({requested}) exceeds this model's "
                f"context of {max_model_len} tokens",
                param="max_tokens", hint=f"lower max_tokens to at most {room} or shorten the prompt",
            )  # fmt: skip
        return requested
    return room if default is None else min(default, room)
