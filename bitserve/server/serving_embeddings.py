"""POST /v1/embeddings (OpenAI's shape): `input` as a string, a list of strings, a list of token ids
or a list of token-id lists; `encoding_format` float or base64 (little-endian float32, what the
`openai` client decodes); `dimensions` truncates and renormalises (400 past the hidden size).

The vectors are the loaded model's final hidden states (after the output norm), pooled (the GGUF's
pooling type, else mean) and L2-normalised, computed by the serving engine on its own thread between
steps (frontend AsyncEngine.embed -> engine Embed command -> runner/embeddings.py): one model runtime.
"""

from __future__ import annotations

import base64
import struct
from typing import Annotated, Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field, field_validator

from bitserve.errors import ContextLengthExceeded, InvalidRequest, ModelUnavailable
from bitserve.frontend.async_engine import AsyncEngine
from bitserve.lifecycle.slot import Lease
from bitserve.server.body import parse_request
from bitserve.server.prompts import encode_text
from bitserve.server.protocol import (
    MAX_MODEL_NAME_CHARS,
    MAX_PROMPT_CHARS,
    MAX_PROMPT_TOKEN_IDS,
    MAX_USER_CHARS,
    StrictModel,
    check_token_ids,
    new_request_id,
)
from bitserve.server.security.request_context import charge_tokens, request_security
from bitserve.server.state import get_state
from bitserve.server.streaming import (
    CLIENT_CLOSED_STATUS,
    ClientDisconnected,
    until_disconnect,
    version_header,
)

MAX_EMBEDDING_INPUTS = 256  # inputs in one request (each is one forward on the engine thread)
MAX_EMBEDDING_TOKENS = 65_536  # all inputs together: bounds how long one request holds the engine
MAX_DIMENSIONS = 65_536

InputText = Annotated[str, Field(max_length=MAX_PROMPT_CHARS)]
InputIds = Annotated[list[int], Field(max_length=MAX_PROMPT_TOKEN_IDS)]


def _check_input(value: Any) -> Any:
    """Say which shape is wrong, and the batch cap, before the union's per-member errors would."""
    if isinstance(value, list) and value and isinstance(value[0], (str, list)):
        if len(value) > MAX_EMBEDDING_INPUTS:
            raise ValueError(f"at most {MAX_EMBEDDING_INPUTS} inputs per request, got {len(value)}")
    elif isinstance(value, list) and not value:
        raise ValueError("input is empty")
    return value


class EmbeddingRequest(StrictModel):
    model: str | None = Field(None, max_length=MAX_MODEL_NAME_CHARS)
    input: (
        InputText
        | Annotated[list[InputText], Field(max_length=MAX_EMBEDDING_INPUTS)]
        | InputIds
        | Annotated[list[InputIds], Field(max_length=MAX_EMBEDDING_INPUTS)]
    )
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, le=MAX_DIMENSIONS)
    user: str | None = Field(None, max_length=MAX_USER_CHARS)

    _check_input = field_validator("input", mode="before")(_check_input)

    def inputs(self) -> list[tuple[str, str | list[int]]]:
        """(param, text or token ids) per input, in order."""
        value = self.input
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            return [(f"input[{i}]", item) for i, item in enumerate(value)]  # type: ignore[misc]
        return [("input", value)]  # type: ignore[list-item]


async def _token_ids(lease: Lease, body: EmbeddingRequest) -> list[list[int]]:
    """Each input's token ids, checked against the vocabulary, the context and the request's cap."""
    instance = lease.instance
    inputs, total = [], 0
    for param, value in body.inputs():
        token_ids = await encode_text(instance, value) if isinstance(value, str) else list(value)
        check_token_ids(token_ids, instance.tokenizer.vocab_size, param)
        if len(token_ids) > instance.max_model_len:
            raise ContextLengthExceeded(
                f"{param} has {len(token_ids)} tokens; this model's context is {instance.max_model_len}",
                param=param,
                hint="shorten the input or split it",
            )
        total += len(token_ids)
        if total > MAX_EMBEDDING_TOKENS:
            raise InvalidRequest(
                f"the inputs hold more than {MAX_EMBEDDING_TOKENS} tokens together",
                param="input",
                hint="split them over several requests",
            )
        inputs.append(token_ids)
    return inputs


def _engine(lease: Lease) -> AsyncEngine:
    """A live replica of the leased version, CPU first (embeddings run on CPU replicas)."""
    router = lease.slot.router
    ranked = router.rank(router.candidates(None))
    ranked.sort(key=lambda replica: replica.device != "cpu")  # stable: keeps the ranking within each kind
    if not ranked:
        raise ModelUnavailable(
            "no replica of this model is available", hint="retry after Retry-After seconds"
        )
    return ranked[0].engine


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


async def create_embeddings(request: Request) -> Response:
    body = parse_request(await request.body(), EmbeddingRequest)
    lease = get_state(request).acquire(body.model)
    try:
        hidden_size = lease.instance.hidden_size
        if body.dimensions is not None and body.dimensions > hidden_size:
            raise InvalidRequest(
                f"dimensions={body.dimensions} is larger than this model's hidden size {hidden_size}",
                param="dimensions",
                hint=f"ask for at most {hidden_size} dimensions, or leave dimensions out",
            )
        inputs = await _token_ids(lease, body)
        num_tokens = sum(len(token_ids) for token_ids in inputs)
        engine = _engine(lease)
        settle = await charge_tokens(request_security(request), num_tokens)
        num_used = 0  # a refusal or failure gives the tokens back
        try:
            vectors = await until_disconnect(
                request.receive, engine.embed(new_request_id("emb"), inputs, body.dimensions)
            )
            num_used = num_tokens
        except ClientDisconnected:
            num_used = num_tokens  # the engine computes them anyway
            return Response(status_code=CLIENT_CLOSED_STATUS)
        finally:
            settle(num_used)
    finally:
        lease.release()
    data = [
        {"object": "embedding", "index": index, "embedding": _encode(vector, body.encoding_format)}
        for index, vector in enumerate(vectors)
    ]
    payload = {
        "object": "list",
        "data": data,
        "model": lease.info.id,
        "model_version": lease.info.version,
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
    }
    return JSONResponse(payload, headers=version_header(lease.info.version))
