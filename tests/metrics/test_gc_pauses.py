"""bitserve_gc_pause_seconds: a full collection shows up once in generation 2's histogram, with its time,
however many sinks (registries) the process built."""

from __future__ import annotations

import gc

from prometheus_client.parser import text_string_to_metric_families

from bitserve.metrics.prometheus import PrometheusStatsSink


def _pauses(sink: PrometheusStatsSink) -> dict[tuple[str, str, str], float]:
    body, _ = sink.render()
    values = {}
    for family in text_string_to_metric_families(body.decode("utf-8")):
        if family.name == "bitserve_gc_pause_seconds":
            for sample in family.samples:
                key = (sample.name, sample.labels["generation"], sample.labels.get("le", ""))
                values[key] = sample.value
    return values


def test_a_full_collection_is_counted_once_with_its_time() -> None:
    first, second = PrometheusStatsSink(), PrometheusStatsSink()  # two registries, one hook
    gc.disable()  # no automatic collection between the reads: only the one below
    try:
        before = _pauses(first)
        gc.collect()
        after, other = _pauses(first), _pauses(second)
    finally:
        gc.enable()
    count, total = ("bitserve_gc_pause_seconds_count", "2", ""), ("bitserve_gc_pause_seconds_sum", "2", "")
    assert after[count] == before[count] + 1 == other[count]
    assert after[total] > before[total]
    assert after[("bitserve_gc_pause_seconds_bucket", "2", "+Inf")] == after[count]
    finite = [(float(le), value) for (_, gen, le), value in after.items() if gen == "2" and le[:1].isdigit()]
    cumulative = [value for _, value in sorted(finite)]
    assert len(cumulative) == 11 and cumulative == sorted(cumulative)
