"""Request bodies -> validated request models: strict UTF-8 and JSON (no NaN, Infinity, overflow or
runaway nesting), pydantic validation errors as InvalidRequest naming the field, unknown fields
logged, unimplemented ones refused (each model's `check_supported`)."""

from __future__ import annotations

import json
import logging
import math
from typing import Any, TypeVar

from pydantic import ValidationError

from bitserve.errors import InvalidRequest
from bitserve.server.errors import invalid_request_from_errors
from bitserve.server.protocol import StrictModel

logger = logging.getLogger(__name__)

MAX_LOGGED_UNKNOWN_FIELDS = 20
RequestT = TypeVar("RequestT", bound=StrictModel)


def _reject_constant(name: str) -> float:
    raise InvalidRequest(f"{name} is not valid JSON (numbers must be finite)", hint="send finite numbers")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise InvalidRequest(f"the number {text[:40]} is out of range (numbers must be finite)")
    return value


def parse_json_object(body: bytes) -> dict[str, Any]:
    """Strict UTF-8, strict JSON (no NaN / Infinity / overflow), a top-level object. Raises InvalidRequest."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequest(
            f"the request body is not valid UTF-8 (byte {exc.start})", hint="encode the body as UTF-8"
        ) from None
    if not text.strip():
        raise InvalidRequest("the request body is empty", hint="send a JSON object")
    try:
        data = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(
            f"the request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None
    except (RecursionError, ValueError) as exc:  # nesting too deep; an integer of > 4300 digits
        if isinstance(exc, InvalidRequest):
            raise
        raise InvalidRequest(
            "the request body is not acceptable JSON (nested too deeply or a number too long)"
        ) from None
    if not isinstance(data, dict):
        raise InvalidRequest(f"the request body must be a JSON object, got {type(data).__name__}")
    return data


def parse_request(body: bytes, model_cls: type[RequestT]) -> RequestT:
    """Body bytes -> validated request model. Unknown fields are logged and otherwise ignored."""
    return validate_request(parse_json_object(body), model_cls)


def validate_request(data: dict[str, Any], model_cls: type[RequestT]) -> RequestT:
    """A parsed JSON object -> validated request model (InvalidRequest naming the field)."""
    try:
        request = model_cls.model_validate(data)
    except ValidationError as exc:
        raise invalid_request_from_errors(exc.errors()) from None
    extra = sorted(request.model_extra or {})
    if extra:
        names = ", ".join(name[:64] for name in extra[:MAX_LOGGED_UNKNOWN_FIELDS])
        logger.warning("ignoring %d unknown request field(s): %s", len(extra), names)
    request.check_supported()
    return request


def with_model_defaults(request: RequestT, defaults: dict[str, Any]) -> RequestT:
    """`request` with the model's default parameters (its sidecar's `default_params`) filled into the
    fields the client left unset; the merged body is validated again like a client's."""
    missing = {
        name: value
        for name, value in defaults.items()
        if name in type(request).model_fields and name not in request.model_fields_set
    }
    if not missing:
        return request
    try:
        merged = type(request).model_validate({**missing, **request.model_dump(exclude_unset=True)})
    except ValidationError as exc:
        raise invalid_request_from_errors(exc.errors()) from None
    merged.check_supported()
    return merged
