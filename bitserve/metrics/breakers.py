"""bitserve_breaker_*: the circuit breakers of the server's dependencies (server/breakers.py), read on each
scrape from the breakers' own counts (/health shows the same state). Beside metrics/prometheus.py, which
is at its size ceiling; app.py registers the collector on the sink's registry. Imports no torch."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from bitserve.metrics.stats import BreakerStats

BREAKER_STATES = ("closed", "open", "half_open")


class BreakerCollector(Collector):
    """bitserve_breaker_state{breaker, state} (1 for the state it is in, 0 for the others: alert on
    `bitserve_breaker_state{state="open"} == 1`), bitserve_breaker_transitions_total{breaker, state}
    (times it entered each state), bitserve_breaker_rejected_total{breaker} (calls not made while open)
    and bitserve_breaker_dropped_total{breaker} (what was dropped instead: the OTLP exporter's spans)."""

    def __init__(self, read: Callable[[], list[BreakerStats]]) -> None:
        self._read = read

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        state = GaugeMetricFamily(
            "bitserve_breaker_state",
            "Circuit breaker state per dependency: 1 for the current state.",
            labels=["breaker", "state"],
        )
        transitions = CounterMetricFamily(
            "bitserve_breaker_transitions",
            "Times a dependency's circuit breaker entered each state.",
            labels=["breaker", "state"],
        )
        rejected = CounterMetricFamily(
            "bitserve_breaker_rejected",
            "Calls to a dependency not made because its circuit breaker was open.",
            labels=["breaker"],
        )
        dropped = CounterMetricFamily(
            "bitserve_breaker_dropped",
            "Items dropped while a dependency's circuit breaker was open (OTLP: spans).",
            labels=["breaker"],
        )
        for stats in self._read():
            for name in BREAKER_STATES:
                state.add_metric([stats.name, name], 1.0 if stats.state == name else 0.0)
                transitions.add_metric([stats.name, name], stats.transitions.get(name, 0))
            rejected.add_metric([stats.name], stats.num_rejected)
            dropped.add_metric([stats.name], stats.num_dropped)
        yield state
        yield transitions
        yield rejected
        yield dropped
