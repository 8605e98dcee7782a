"""bitserve_version_*: each resident version's own request counts and latencies, so a canary and the
stable version beside it (the same alias and device, which every other series shares) can be compared
in PromQL as /v1/models compares them. Read on each scrape from the versions' counters (lifecycle/
canary.py builds the rows); only resident versions appear, so the series stay few. Beside
metrics/prometheus.py, which is at its size ceiling; app.py registers the collector."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily
from prometheus_client.registry import Collector

LABELS = ["model", "version", "role"]


@dataclass(frozen=True, slots=True)
class VersionCounters:
    """One resident version's counters since it loaded."""

    alias: str
    version: str
    role: str  # "stable" (what the alias serves), "canary", or "previous" (draining / on probation)
    weight: float  # its share of the alias's requests (stable: what the canary leaves)
    num_finished: int
    num_failed: int
    ttft_sum_s: float
    ttft_count: int
    itl_sum_s: float
    itl_count: int


class VersionCollector(Collector):
    """bitserve_version_requests_total / _request_failures_total, bitserve_version_time_to_first_token_
    seconds and bitserve_version_inter_token_latency_seconds (summaries: _sum and _count), and
    bitserve_version_traffic_weight, each by {model, version, role}."""

    def __init__(self, read: Callable[[], list[VersionCounters]]) -> None:
        self._read = read

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily | SummaryMetricFamily]:
        prefix = "bitserve_version"
        finished = CounterMetricFamily(f"{prefix}_requests", "Requests finished by a version.", labels=LABELS)
        failed = CounterMetricFamily(
            f"{prefix}_request_failures", "Requests a version failed (engine errors).", labels=LABELS
        )
        ttft = SummaryMetricFamily(
            f"{prefix}_time_to_first_token_seconds", "A version's time to first token.", labels=LABELS
        )
        itl = SummaryMetricFamily(
            f"{prefix}_inter_token_latency_seconds", "A version's inter-token latency.", labels=LABELS
        )
        weight = GaugeMetricFamily(
            f"{prefix}_traffic_weight", "A version's share of its alias's requests.", labels=LABELS
        )
        for row in self._read():
            labels = [row.alias, row.version, row.role]
            finished.add_metric(labels, row.num_finished)
            failed.add_metric(labels, row.num_failed)
            ttft.add_metric(labels, row.ttft_count, row.ttft_sum_s)
            itl.add_metric(labels, row.itl_count, row.itl_sum_s)
            weight.add_metric(labels, row.weight)
        yield from (finished, failed, ttft, itl, weight)
