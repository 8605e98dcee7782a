"""Probes and ops endpoints: /health/live, /health/ready, /health (components and build info, one
component per replica), /metrics. Each answers from cached state; none waits on model compute.

A model version may run as several replicas (one per device): it is alive while one of them is, and
the router routes around a dead or wedged one; a replica that is down shows in /health and /v1/models.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from bitserve.lifecycle.slot import describe_replica
from bitserve.server.errors import PROBE_FAIL_STATUS, PROBE_PASS_STATUS, retry_after_value
from bitserve.server.security.request_context import request_principal
from bitserve.server.state import get_state


def _probe(checks: dict[str, bool], details: dict[str, Any], retry_after_s: float | None) -> JSONResponse:
    is_ok = all(checks.values())
    body = {"status": "ok" if is_ok else "fail", "checks": checks, **details}
    headers = {} if is_ok else {"Retry-After": retry_after_value(retry_after_s)}
    return JSONResponse(body, status_code=PROBE_PASS_STATUS if is_ok else PROBE_FAIL_STATUS, headers=headers)


async def live(request: Request) -> Response:
    """The process and event loop answer, the model did not fail to load, every version that serves
    has a live engine (one replica's is enough: the router skips a dead one), and the live engines make
    progress when work is pending (a wedged engine fails this probe)."""
    state = get_state(request)
    slots = [entry.current for entry in state.models.aliases.values() if entry.current.replicas]
    engines = [replica.engine for slot in slots for replica in slot.replicas if replica.is_alive]
    stall_s = max((engine.seconds_since_progress for engine in engines), default=0.0)
    checks = {
        "model_load_ok": state.load_error is None,
        "engine_alive": all(slot.has_live_replica for slot in slots),
        "engine_progressing": stall_s <= state.server_config.liveness_stall_s,
    }
    details = {
        "seconds_since_progress": round(stall_s, 3),
        "max_stall_s": state.server_config.liveness_stall_s,
    }
    return _probe(checks, details, None)


async def ready(request: Request) -> Response:
    """The default model loaded and warmed, an engine of it alive, not draining, and the admission queue
    of one live replica not full."""
    state = get_state(request)
    slot = state.default_slot()
    live = [replica.engine for replica in slot.replicas if replica.is_alive] if slot is not None else []
    checks = {
        "model_ready": slot is not None and slot.is_routable,
        "engine_alive": bool(live),
        "not_draining": not state.is_draining,
        "queue_not_saturated": any(
            engine.num_active_requests < engine.limits.max_num_waiting for engine in live
        ),
    }
    details: dict[str, Any] = {"phase": state.phase}
    loading = state.loading_step()
    if loading is not None and state.phase == "loading":
        details["loading"] = loading  # e.g. {"step": "warming up", "progress": 0.8, "seconds": 12.3}
    return _probe(checks, details, state.retry_after_s())


async def health(request: Request) -> Response:
    state = get_state(request)
    slot = state.default_slot()
    engines = slot.engines if slot is not None else []
    info = slot.info if slot is not None else None
    components: dict[str, Any] = {
        "model": dataclasses.asdict(info) if info is not None else None,
        "models": state.models.describe(),
        "engine": None,
        "replicas": [],
        "http": {"is_draining": state.is_draining, "num_live_streams": state.num_live_streams},
        "energy": state.stats.energy_status(),  # why bitserve_energy_joules_total is absent, if it is
        # each configured dependency's circuit breaker: {"redis": {"state", "failures", "opened_seconds_ago"}}
        "breakers": state.breakers.describe(),
    }
    if state.load_error is not None:
        components["model"] = {"error": state.load_error}
    if slot is not None and engines:
        # the default version's engines together; each replica's own state under "replicas"
        components["engine"] = {
            "is_alive": slot.has_live_replica,
            "num_active_requests": sum(engine.num_active_requests for engine in engines),
            "seconds_since_progress": round(max(engine.seconds_since_progress for engine in engines), 3),
        }
        components["replicas"] = [describe_replica(replica) for replica in slot.replicas]
    build = dataclasses.asdict(state.build)
    if info is not None:
        build["kernel_backend"] = info.backend
        build["tensor_types"] = info.tensor_types
    if not request_principal(request).has_scope("metrics"):
        # NOTE: versions and the git sha help an attacker pick exploits: only the metrics scope sees them.
        return JSONResponse({"status": state.phase, "components": components})
    return JSONResponse({"status": state.phase, "components": components, "build": build})


async def metrics(request: Request) -> Response:
    body, content_type = get_state(request).stats.render()
    return Response(body, media_type=content_type)
