"""Which requests the response cache may answer, and the key it files them under.

A request is cacheable when its answer is a function of the request: greedy decoding (temperature 0,
or top_k 1), or sampling with a fixed `seed`. The key is a SHA-256 over the model version that will
serve it (alias, file digest, backend, devices, bitserve's version: a swap, a rollback or an upgrade
never reuses an answer) and the canonical JSON of the request fields that shape the output."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from bitserve import __version__
from bitserve.lifecycle.slot import SlotInfo
from bitserve.sampling_params import SamplingParams
from bitserve.server.protocol import GenerationRequest

# Fields that change how or when an answer is delivered, never what it is: the transport (stream,
# stream_options: usage is recomputed from the stored answer), the end user's id, the deadline and
# the queue class. Unknown fields the server ignores are left out too (only declared fields count).
NON_OUTPUT_FIELDS = frozenset({"stream", "stream_options", "user", "timeout", "priority"})


def is_deterministic(params: SamplingParams) -> bool:
    """Greedy, or seeded: the same request gives the same answer from the same model version."""
    return params.is_greedy or params.seed is not None


def normalized_request(body: GenerationRequest, model_id: str) -> dict[str, Any]:
    """The output-shaping fields, every one present (an unset field and its default compare equal),
    with `model` resolved to the alias that serves it (None and the default alias are one model)."""
    fields = set(type(body).model_fields) - NON_OUTPUT_FIELDS
    normalized = body.model_dump(mode="json", include=fields)
    normalized["model"] = model_id
    return normalized


def cache_key(endpoint: str, body: GenerationRequest, info: SlotInfo) -> str:
    """Hex SHA-256 naming the answer to `body` on `endpoint` ("chatcmpl", "cmpl", "inf") from the
    version `info` describes."""
    identity = {
        "bitserve": __version__,
        "model": info.id,
        "version": info.version,
        "backend": info.backend,
        "devices": list(info.devices),
        "endpoint": endpoint,
        "request": normalized_request(body, info.id),
    }
    canonical = json.dumps(identity, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()
