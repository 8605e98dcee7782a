"""Values the serving modules put in responses: a token's text, finite logprobs, the usage block, and the
request ids (a client's X-Request-Id when valid, new ones otherwise). Pure functions over plain values:
no pydantic model of a request body (those are server/protocol.py's).
"""

from __future__ import annotations

import math
import uuid
from typing import Any

from bitserve.tokenizer.base import Tokenizer

LOGPROB_FLOOR = -9999.0  # stands in for -inf, which JSON cannot carry
MAX_REQUEST_ID_CHARS = 128  # a client-chosen request id (X-Request-Id, a WebSocket request's id)


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    """The text of one token (a partial UTF-8 sequence shows as U+FFFD; `bytes` has the exact value)."""
    return tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")


def finite_logprob(value: float) -> float:
    return value if math.isfinite(value) else LOGPROB_FLOOR


def usage_payload(
    num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int
) -> dict[str, Any]:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
        "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
    }


def valid_request_id(value: bytes) -> str | None:
    """A client's request id (X-Request-Id, a WebSocket message's `id`) is kept if it is 1..128
    printable ASCII characters without spaces."""
    if not 1 <= len(value) <= MAX_REQUEST_ID_CHARS or not all(0x21 <= byte <= 0x7E for byte in value):
        return None
    return value.decode("ascii")


def new_request_id(prefix: str) -> str:
    """Unique engine / response id (client X-Request-Ids may repeat, so they are never reused here)."""
    return f"{prefix}-{uuid.uuid4().hex}"
