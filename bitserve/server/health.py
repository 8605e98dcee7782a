"""Probes and ops endpoints: /health/live, /health/ready, /health (components and build info),
/metrics. Each answers from cached state; none waits on model compute."""

from __future__ import annotations

import dataclasses
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from bitserve.server.errors import PROBE_FAIL_STATUS, PROBE_PASS_STATUS, retry_after_value
from bitserve.server.state import get_state


def _probe(checks: dict[str, bool], details: dict[str, Any], retry_after_s: float | None) -> JSONResponse:
    is_ok = all(checks.values())
    body = {"status": "ok" if is_ok else "fail", "checks": checks, **details}
    headers = {} if is_ok else {"Retry-After": retry_after_value(retry_after_s)}
    return JSONResponse(body, status_code=PROBE_PASS_STATUS if is_ok else PROBE_FAIL_STATUS, headers=headers)


async def live(request: Request) -> Response:
    """The process and event loop answer, the model did not fail to load, the engines of the versions
    that serve live, and they make progress when work is pending (a wedged engine fails this probe)."""
    state = get_state(request)
    engines = [
        entry.current.engine for entry in state.models.aliases.values() if entry.current.engine is not None
    ]
    stall_s = max((engine.seconds_since_progress for engine in engines), default=0.0)
    checks = {
        "model_load_ok": state.load_error is None,
        "engine_alive": all(engine.is_alive for engine in engines),
        "engine_progressing": stall_s <= state.server_config.liveness_stall_s,
    }
    details = {
        "seconds_since_progress": round(stall_s, 3),
        "max_stall_s": state.server_config.liveness_stall_s,
    }
    return _probe(checks, details, None)


async def ready(request: Request) -> Response:
    """The default model loaded and warmed, its engine alive, not draining, admission queue not full."""
    state = get_state(request)
    slot = state.default_slot()
    engine = slot.engine if slot is not None else None
    checks = {
        "model_ready": slot is not None and slot.is_routable,
        "engine_alive": engine is not None and engine.is_alive,
        "not_draining": not state.is_draining,
        "queue_not_saturated": engine is not None
        and engine.num_active_requests < state.server_config.max_num_waiting,
    }
    return _probe(checks, {"phase": state.phase}, state.retry_after_s())


async def health(request: Request) -> Response:
    state = get_state(request)
    slot = state.default_slot()
    engine = slot.engine if slot is not None else None
    info = slot.info if slot is not None else None
    components: dict[str, Any] = {
        "model": dataclasses.asdict(info) if info is not None else None,
        "models": state.models.describe(),
        "engine": None,
        "http": {"is_draining": state.is_draining, "num_live_streams": state.num_live_streams},
    }
    if state.load_error is not None:
        components["model"] = {"error": state.load_error}
    if engine is not None:
        components["engine"] = {
            "is_alive": engine.is_alive,
            "num_active_requests": engine.num_active_requests,
            "seconds_since_progress": round(engine.seconds_since_progress, 3),
        }
    build = dataclasses.asdict(state.build)
    if info is not None:
        build["kernel_backend"] = info.backend
        build["tensor_types"] = info.tensor_types
    return JSONResponse({"status": state.phase, "components": components, "build": build})


async def metrics(request: Request) -> Response:
    body, content_type = get_state(request).stats.render()
    return Response(body, media_type=content_type)
