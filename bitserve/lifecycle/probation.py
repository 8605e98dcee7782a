"""Probation after a swap: for a window, watch the new version's engines (every replica's) health, error
rate and inter-token latency; report the first threshold it crosses so the manager can flip back while the
old version is still resident.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from bitserve.config import ServerConfig
from bitserve.lifecycle.slot import ModelSlot

PROBATION_POLL_S = 0.05


@dataclass(frozen=True, slots=True)
class ProbationPolicy:
    window_s: float
    max_error_rate: float
    min_requests: int
    max_itl_s: float | None

    @classmethod
    def from_config(cls, config: ServerConfig) -> ProbationPolicy:
        return cls(
            config.swap_probation_s,
            config.probation_max_error_rate,
            config.probation_min_requests,
            config.probation_max_itl_s,
        )


def probation_failure(
    slot: ModelSlot,
    policy: ProbationPolicy,
    base_finished: int,
    base_failed: int,
    base_itl: tuple[float, int],
) -> str | None:
    """Why `slot` fails probation now, or None. Counts are taken relative to the flip. A replica that
    dies fails it although its siblings serve on: the old version is still resident on that device."""
    dead = slot.dead_devices
    if not slot.replicas or dead:
        return f"its engine died ({', '.join(dead)})" if dead else "its engine died"
    num_finished = slot.num_finished - base_finished
    num_failed = slot.num_failed - base_failed
    if num_finished >= policy.min_requests and num_failed > policy.max_error_rate * num_finished:
        return f"{num_failed} of {num_finished} requests failed (limit {policy.max_error_rate:.0%})"
    itl_sum_s, itl_count = slot.itl_totals
    itl_count -= base_itl[1]
    if policy.max_itl_s is not None and num_finished >= policy.min_requests and itl_count > 0:
        mean_itl = (itl_sum_s - base_itl[0]) / itl_count
        if mean_itl > policy.max_itl_s:
            return (
                f"mean inter-token latency {mean_itl * 1000:.0f} ms exceeds {policy.max_itl_s * 1000:.0f} ms"
            )
    return None


async def watch_probation(
    slot: ModelSlot, policy: ProbationPolicy, is_still_current: Callable[[], bool]
) -> str | None:
    """Poll until the window ends (None), the slot fails (the reason), or it stops being current (None)."""
    if policy.window_s <= 0:
        return None
    base_itl = slot.itl_totals
    base_finished, base_failed = slot.num_finished, slot.num_failed
    deadline = time.monotonic() + policy.window_s
    while time.monotonic() < deadline and is_still_current():
        reason = probation_failure(slot, policy, base_finished, base_failed, base_itl)
        if reason is not None:
            return reason
        await asyncio.sleep(PROBATION_POLL_S)
    return None
