"""Canary rollouts: a swap that stages the new version beside the serving one and sends it a weighted
share of the alias's traffic, compares the two versions' error rate, time to first token and
inter-token latency over the same period, then promotes it (the swap's atomic flip) or rolls it back.

Routing (`Canary.routes_here`): a tester's `X-Canary: always` / `never` header decides first; a request
with a sticky key (the body's `user`, else an `X-Session-Id` header) goes where the key's hash says, so
a conversation stays on one version; any other request is split by a deterministic weighted counter
(exactly `weight` of them, no sampling noise). Event-loop only, like the rest of the lifecycle.
"""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import astuple, dataclass, field
from typing import Any

from bitserve.config import ServerConfig
from bitserve.errors import InvalidRequest
from bitserve.lifecycle.slot import ModelSlot
from bitserve.metrics.versions import VersionCounters

CANARY_HEADER = "x-canary"  # "always": route to the canary; "never": to the stable version
SESSION_HEADER = "x-session-id"  # a sticky key for clients without a `user`
FORCED_ROUTES = {"always": True, "never": False}
MAX_STICKY_KEY_CHARS = 256


@dataclass(frozen=True, slots=True)
class RoutingHints:
    """What a request says about where it may go: its sticky key and a tester's forced route."""

    sticky_key: str | None = None
    forced: str | None = None  # CANARY_HEADER's value


NO_HINTS = RoutingHints()


def routing_hints(user: str | None, session: str | None, forced: str | None) -> RoutingHints:
    key = user or session
    route = forced.strip().lower() if forced else None
    if route is not None and route not in FORCED_ROUTES:
        raise InvalidRequest(f"{CANARY_HEADER} must be always or never", param=CANARY_HEADER)
    return RoutingHints(key[:MAX_STICKY_KEY_CHARS] if key else None, route)


def key_share(alias: str, key: str) -> float:
    """A sticky key's fixed place in [0, 1): the same key always lands on the same side of a weight."""
    digest = hashlib.sha256(f"{alias}\0{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


@dataclass(frozen=True, slots=True)
class CanaryPolicy:
    window_s: float  # how long the canary is compared before it is promoted
    min_requests: int  # finished canary requests before any verdict
    max_error_rate: float  # the canary's error rate may exceed the stable one's only up to this
    max_latency_ratio: float | None  # canary TTFT / ITL over the stable version's, at most (None: off)

    @classmethod
    def from_config(cls, config: ServerConfig, window_s: float | None = None) -> CanaryPolicy:
        return cls(
            config.canary_window_s if window_s is None else window_s,
            config.probation_min_requests,
            config.probation_max_error_rate,
            config.canary_max_latency_ratio,
        )


@dataclass(frozen=True, slots=True)
class VersionSample:
    """A version's counters at one moment (ModelSlot's and its engines'), or a difference of two."""

    finished: int = 0
    failed: int = 0
    ttft_sum_s: float = 0.0
    ttft_count: int = 0
    itl_sum_s: float = 0.0
    itl_count: int = 0

    @classmethod
    def of(cls, slot: ModelSlot) -> VersionSample:
        engines = slot.engines
        itl_sum_s, itl_count = slot.itl_totals
        return cls(
            slot.num_finished,
            slot.num_failed,
            sum(engine.ttft_sum_s for engine in engines),
            sum(engine.ttft_count for engine in engines),
            itl_sum_s,
            itl_count,
        )

    def since(self, base: VersionSample) -> VersionSample:
        return VersionSample(*(now - then for now, then in zip(astuple(self), astuple(base), strict=True)))

    @property
    def error_rate(self) -> float:
        return self.failed / self.finished if self.finished else 0.0

    @property
    def mean_ttft_s(self) -> float | None:
        return self.ttft_sum_s / self.ttft_count if self.ttft_count else None

    @property
    def mean_itl_s(self) -> float | None:
        return self.itl_sum_s / self.itl_count if self.itl_count else None

    def counters(self, alias: str, version: str, role: str, weight: float) -> VersionCounters:
        return VersionCounters(alias, version, role, weight, *astuple(self))  # the same fields, in order

    def describe(self) -> dict[str, Any]:
        ttft, itl = self.mean_ttft_s, self.mean_itl_s
        return {
            "num_finished": self.finished,
            "num_failed": self.failed,
            "error_rate": round(self.error_rate, 4),
            "mean_ttft_s": None if ttft is None else round(ttft, 6),
            "mean_itl_s": None if itl is None else round(itl, 6),
        }


@dataclass(eq=False)
class Canary:
    """The version staged beside an alias's stable one, its share and the counters at its start."""

    slot: ModelSlot
    weight: float  # share of the alias's requests, in (0, 1)
    policy: CanaryPolicy
    stable_base: VersionSample
    canary_base: VersionSample
    started_at: float = field(default_factory=time.monotonic)
    num_routed: int = 0  # unforced, unsticky requests split so far, and how many went to the canary
    num_to_canary: int = 0

    def routes_here(self, alias: str, hints: RoutingHints) -> bool:
        """Whether this request goes to the canary (see the module docstring for the order)."""
        if hints.forced is not None:
            return FORCED_ROUTES[hints.forced]
        if hints.sticky_key is not None:
            return key_share(alias, hints.sticky_key) < self.weight
        # the weighted counter: after n requests, exactly floor(n * weight) went to the canary
        self.num_routed += 1
        goes = math.floor(self.num_routed * self.weight) > self.num_to_canary
        self.num_to_canary += int(goes)
        return goes

    def samples(self, stable: ModelSlot) -> tuple[VersionSample, VersionSample]:
        """(stable, canary) since the canary started."""
        return VersionSample.of(stable).since(self.stable_base), VersionSample.of(self.slot).since(
            self.canary_base
        )

    def describe(self, stable: ModelSlot) -> dict[str, Any]:
        stable_sample, canary_sample = self.samples(stable)
        return {
            "version": self.slot.version,
            "weight": self.weight,
            "seconds": round(time.monotonic() - self.started_at, 1),
            "window_s": self.policy.window_s,
            "stable": stable_sample.describe(),
            "canary": canary_sample.describe(),
            "slot": self.slot.describe(),
        }


def _slower(canary: float | None, stable: float | None, ratio: float | None) -> bool:
    if ratio is None or canary is None or stable is None:
        return False
    return stable > 0 and canary > stable * ratio


def canary_verdict(canary: Canary, stable: ModelSlot, now: float) -> tuple[str, str]:
    """("rollback" | "promote" | "wait", why). A dead canary rolls back at once; error rate and
    latency are judged once the canary has finished `min_requests`; it is promoted when the window has
    passed with none of them over its bound."""
    if not canary.slot.has_live_replica:
        return "rollback", "its engine died"
    stable_sample, sample = canary.samples(stable)
    policy = canary.policy
    if sample.finished >= policy.min_requests:
        allowed = min(1.0, stable_sample.error_rate + policy.max_error_rate)
        if sample.failed and sample.error_rate > allowed:
            return "rollback", (
                f"{sample.failed} of {sample.finished} canary requests failed "
                f"({sample.error_rate:.0%} against the stable version's {stable_sample.error_rate:.0%})"
            )
        for what, mine, theirs in (
            ("time to first token", sample.mean_ttft_s, stable_sample.mean_ttft_s),
            ("inter-token latency", sample.mean_itl_s, stable_sample.mean_itl_s),
        ):
            if _slower(mine, theirs, policy.max_latency_ratio):
                assert mine is not None and theirs is not None
                return "rollback", (
                    f"mean {what} {mine * 1000:.1f} ms is over {policy.max_latency_ratio:g}x the stable "
                    f"version's {theirs * 1000:.1f} ms"
                )
    if now - canary.started_at < policy.window_s:
        return "wait", "within the window"
    if sample.finished < policy.min_requests:
        return "wait", f"{sample.finished} of {policy.min_requests} canary requests finished"
    return "promote", f"{sample.finished} canary requests within every bound for {policy.window_s:g} s"
