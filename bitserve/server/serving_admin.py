"""/v1/models: the served models as OpenAI model objects (inference scope), and the admin actions
(admin scope): load beside, swap (or stage a canary, then promote it), rollback, unload, operation
status. Actions run in the background
(202 + status URL) unless `wait` is true (the final result: 200, or the error's status and body).
Model references are resolved only by the ModelFiles (names, or paths inside the model roots).
Load and swap take `device` ("auto", "cpu", "cuda", "cuda:N") or `devices` (a list: one replica each).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ConfigDict, Field

from bitserve.engine.devices import MAX_DEVICE_CHARS, MAX_NUM_REPLICAS
from bitserve.errors import InvalidRequest, ModelNotFound
from bitserve.lifecycle.operations import Operation
from bitserve.server.body import parse_request
from bitserve.server.protocol import MAX_MODEL_NAME_CHARS, StrictModel
from bitserve.server.security.principal import CURRENT_PRINCIPAL, check_model_access
from bitserve.server.state import AppState, get_state

MAX_MODEL_REFERENCE_CHARS = 4096
OPERATIONS_PATH = "/v1/models/operations"
MAX_CANARY_WINDOW_S = 7 * 24 * 3600.0


class AdminRequest(StrictModel):
    # Admin bodies forbid unknown fields: a typo in an operator's call must not pass silently.
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, populate_by_name=True)

    wait: bool = False


DeviceName = Annotated[str, Field(min_length=1, max_length=MAX_DEVICE_CHARS)]


class PlacementRequest(AdminRequest):
    """Where a load or swap puts the version: `device` (one) or `devices` (replicas), not both; neither
    means the configured device for a load, and the alias's current devices for a swap."""

    device: DeviceName | None = None
    devices: list[DeviceName] | None = Field(None, min_length=1, max_length=MAX_NUM_REPLICAS)

    def check_supported(self) -> None:
        if self.device is not None and self.devices is not None:
            raise InvalidRequest(
                "give device or devices, not both", param="devices", hint="devices: a list, one replica each"
            )

    @property
    def device_request(self) -> str | list[str] | None:
        return self.devices if self.devices is not None else self.device


class LoadModelRequest(PlacementRequest):
    model: str = Field(min_length=1, max_length=MAX_MODEL_REFERENCE_CHARS)
    alias: str | None = Field(None, min_length=1, max_length=MAX_MODEL_NAME_CHARS)
    should_validate: bool = Field(True, alias="validate")


class CanaryRequest(AdminRequest):
    """A swap's canary: the new version takes `percent` of the alias's requests beside the stable one
    for `window_s` (default --canary-window-s), then is promoted or rolled back (lifecycle/canary.py)."""

    percent: float = Field(gt=0.0, lt=100.0)
    window_s: float | None = Field(None, gt=0.0, le=MAX_CANARY_WINDOW_S)


class SwapModelRequest(PlacementRequest):
    model: str = Field(min_length=1, max_length=MAX_MODEL_REFERENCE_CHARS)
    should_validate: bool = Field(True, alias="validate")
    canary: CanaryRequest | None = None

    @property
    def canary_options(self) -> dict[str, Any]:
        if self.canary is None:
            return {}
        return {"canary": {"weight": self.canary.percent / 100.0, "window_s": self.canary.window_s}}


class AliasActionRequest(AdminRequest):
    """rollback / unload: only `wait`."""


def _model_objects(state: AppState) -> list[dict[str, Any]]:
    """OpenAI model objects, one per alias, extended with the ModelManager's description of it."""
    objects = []
    for entry in state.models.describe():
        alias_entry = state.models.aliases.get(entry["alias"])
        info = alias_entry.current.info if alias_entry is not None else None
        objects.append(
            {
                "id": entry["alias"],
                "object": "model",
                "created": info.created if info else 0,
                "owned_by": "bitserve",
                "root": entry["file"],
                "max_model_len": info.max_model_len if info else None,
                **entry,
            }
        )
    return objects


async def list_models(request: Request) -> Response:
    state = get_state(request)
    running = [op.describe() for op in state.models.operations.running()]
    principal = CURRENT_PRINCIPAL.get()
    models = [obj for obj in _model_objects(state) if principal is None or principal.may_use(obj["id"])]
    return JSONResponse({"object": "list", "data": models, "operations": running})


async def get_model(request: Request, model_id: str) -> Response:
    state = get_state(request)
    for obj in _model_objects(state):
        if obj["id"] == model_id:
            return JSONResponse(obj)
    raise ModelNotFound(
        f"the model {model_id[:100]!r} does not exist on this server",
        param="model",
        hint=f"available: {', '.join(sorted(state.models.aliases)) or '(none)'}",
    )


async def get_operation(request: Request, operation_id: str) -> Response:
    operation = get_state(request).models.operations.get(operation_id)
    if operation is None:
        raise ModelNotFound(
            f"no model operation {operation_id[:64]!r}",
            param="operation_id",
            hint="operations are kept for the last 128 actions",
        )
    return JSONResponse(operation.describe())


async def _answer(operation: Operation, wait: bool) -> Response:
    """202 + status URL now, or (wait) the final state: 200, or the operation's error via the table."""
    if not wait:
        url = f"{OPERATIONS_PATH}/{operation.id}"
        return JSONResponse(
            {**operation.describe(), "status_url": url}, status_code=202, headers={"Location": url}
        )
    await operation.wait()
    if operation.error is not None:
        raise operation.error
    return JSONResponse(operation.describe())


async def load_model(request: Request) -> Response:
    body = parse_request(await request.body(), LoadModelRequest)
    manager = get_state(request).models
    alias = body.alias or manager.files.resolve(body.model).name
    check_model_access(alias)
    operation = manager.submit(
        "load", alias, body.model, devices=body.device_request, validate=body.should_validate
    )
    return await _answer(operation, body.wait)


async def swap_model(request: Request, alias: str) -> Response:
    body = parse_request(await request.body(), SwapModelRequest)
    operation = get_state(request).models.submit(
        "swap",
        alias,
        body.model,
        devices=body.device_request,
        validate=body.should_validate,
        **body.canary_options,
    )
    return await _answer(operation, body.wait)


async def promote_canary(request: Request, alias: str) -> Response:
    """Promote the alias's canary now (the swap's flip); rollback retires it instead."""
    body = await _optional_body(request)
    return await _answer(get_state(request).models.submit("promote", alias), body.wait)


async def rollback_model(request: Request, alias: str) -> Response:
    body = await _optional_body(request)
    return await _answer(get_state(request).models.submit("rollback", alias), body.wait)


async def unload_model(request: Request, alias: str) -> Response:
    body = await _optional_body(request)
    return await _answer(get_state(request).models.submit("unload", alias), body.wait)


async def _optional_body(request: Request) -> AliasActionRequest:
    raw = await request.body()
    return parse_request(raw, AliasActionRequest) if raw.strip() else AliasActionRequest()
