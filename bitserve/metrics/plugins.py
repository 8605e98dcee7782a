"""bitserve_plugin_events_total{plugin, outcome}: what each server plugin did to requests (server/plugins/
chain.py counts them): "refused" (a pre-inference hook answered 4xx), "error" and "timeout" (the hook
failed the request with a 500). Read on each scrape from the chain's own counts; registered by app.py
beside the other collectors (metrics/prometheus.py is at its size ceiling)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector


class PluginCollector(Collector):
    def __init__(self, read: Callable[[], dict[tuple[str, str], int]]) -> None:
        self._read = read

    def collect(self) -> Iterator[CounterMetricFamily]:
        events = CounterMetricFamily(
            "bitserve_plugin_events",
            "Requests a server plugin refused (4xx) or failed (error, timeout: 500), by plugin.",
            labels=["plugin", "outcome"],
        )
        for (plugin, outcome), count in sorted(self._read().items()):
            events.add_metric([plugin, outcome], count)
        yield events
