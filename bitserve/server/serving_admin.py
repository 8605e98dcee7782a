"""/v1/models and /v1/models/{id}: the served model as OpenAI model objects. Ids are compared as
strings only; nothing here touches the filesystem. (Load / unload / swap will live here too.)"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from bitserve.errors import ModelNotFound
from bitserve.server.state import ModelInfo, get_state


def model_object(model: ModelInfo) -> dict[str, Any]:
    return {
        "id": model.id,
        "object": "model",
        "created": model.created,
        "owned_by": "bitserve",
        "root": model.file_name,
        "max_model_len": model.max_model_len,
        "architecture": model.architecture,
    }


async def list_models(request: Request) -> Response:
    model = get_state(request).model
    return JSONResponse({"object": "list", "data": [model_object(model)] if model is not None else []})


async def get_model(request: Request, model_id: str) -> Response:
    model = get_state(request).model
    if model is None or model_id != model.id:
        raise ModelNotFound(f"the model {model_id[:100]!r} does not exist on this server", param="model",
                            hint="see GET /v1/models")  # fmt: skip
    return JSONResponse(model_object(model))
