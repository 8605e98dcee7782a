"""PrometheusStatsSink: stats in, exposition text out, parsed back with prometheus_client's own parser."""

from __future__ import annotations

from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from bitserve.core.step_outputs import StepStats
from bitserve.metrics.prometheus import (
    TTFT_BUCKETS_S,
    MemoryLimitCollector,
    PrometheusStatsSink,
    read_memory_limit_bytes,
)
from bitserve.metrics.stats import RequestStats, StatsSink


def samples(sink: PrometheusStatsSink) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of render()'s output, keyed by (sample name, labels)."""
    body, content_type = sink.render()
    assert content_type.startswith("text/plain")
    values = {}
    for family in text_string_to_metric_families(body.decode("utf-8")):
        for sample in family.samples:
            values[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return values


FORMAT = "Q4_1"  # the quant_format label of the replicas here


def value(values: dict, name: str, **labels: str) -> float:
    if "model" in labels:  # a per-replica series
        labels.setdefault("quant_format", FORMAT)
    return values[(name, frozenset(labels.items()))]


def step(**overrides: float) -> StepStats:
    fields = dict(
        num_running=2,
        num_waiting=3,
        num_preempted_total=0,
        kv_usage=0.25,
        num_batched_tokens=40,
        num_prefill_tokens=38,
        num_decode_tokens=2,
        num_prefix_hit_tokens=16,
        num_prefix_query_tokens=48,
        step_time_s=0.02,
    )
    fields.update(overrides)
    return StepStats(**fields)  # type: ignore[arg-type]


def test_sink_satisfies_the_protocol() -> None:
    sink: StatsSink = PrometheusStatsSink()
    assert callable(sink.record_step) and callable(sink.record_request)


def test_request_stats_become_histograms_and_counters() -> None:
    sink = PrometheusStatsSink()
    sink.record_request(
        RequestStats(
            "m1", "cpu", FORMAT, "length", 10, 5, e2e_s=1.5, ttft_s=0.3, mean_itl_s=0.02, queue_s=0.1
        )
    )
    sink.record_request(
        RequestStats("m1", "cpu", FORMAT, "stop", 7, 3, e2e_s=0.9, ttft_s=0.4, mean_itl_s=None)
    )
    sink.record_request(
        RequestStats("m2", "cuda:0", FORMAT, "abort", 4, 0, e2e_s=0.2, ttft_s=None, mean_itl_s=None)
    )
    values = samples(sink)
    assert value(values, "bitserve_requests_total", model="m1", device="cpu", finish_reason="length") == 1
    assert value(values, "bitserve_requests_total", model="m1", device="cpu", finish_reason="stop") == 1
    assert value(values, "bitserve_requests_total", model="m2", device="cuda:0", finish_reason="abort") == 1
    assert value(values, "bitserve_prompt_tokens_total", model="m1", device="cpu") == 17
    assert value(values, "bitserve_generation_tokens_total", model="m1", device="cpu") == 8
    assert value(values, "bitserve_generation_tokens_total", model="m2", device="cuda:0") == 0
    assert value(values, "bitserve_request_duration_seconds_count", model="m1", device="cpu") == 2
    assert abs(value(values, "bitserve_request_duration_seconds_sum", model="m1", device="cpu") - 2.4) < 1e-9
    # TTFT: 0.3 and 0.4 fall in the 0.5 bucket, not in 0.25; m2 had no first token, so no sample
    assert (
        value(values, "bitserve_time_to_first_token_seconds_bucket", model="m1", device="cpu", le="0.25") == 0
    )
    assert (
        value(values, "bitserve_time_to_first_token_seconds_bucket", model="m1", device="cpu", le="0.5") == 2
    )
    assert (
        value(values, "bitserve_time_to_first_token_seconds_bucket", model="m1", device="cpu", le="60.0") == 2
    )
    no_ttft = frozenset({("model", "m2"), ("device", "cuda:0"), ("quant_format", FORMAT)})
    assert ("bitserve_time_to_first_token_seconds_count", no_ttft) not in values
    assert value(values, "bitserve_inter_token_latency_seconds_count", model="m1", device="cpu") == 1
    assert value(values, "bitserve_request_queue_seconds_count", model="m1", device="cpu") == 1
    assert max(TTFT_BUCKETS_S) == 60.0


def test_step_stats_gauges_prefix_cache_and_preemption_deltas() -> None:
    sink = PrometheusStatsSink()
    sink.record_step("m", "cpu", FORMAT, step())
    sink.record_step(
        "m",
        "cpu",
        FORMAT,
        step(
            num_running=1,
            num_waiting=0,
            kv_usage=0.5,
            num_preempted_total=2,
            num_prefix_hit_tokens=0,
            num_prefix_query_tokens=8,
            num_batched_tokens=1,
        ),
    )
    sink.record_step(
        "m", "cpu", FORMAT, step(num_preempted_total=5, num_prefix_hit_tokens=0, num_prefix_query_tokens=0)
    )
    values = samples(sink)
    # gauges hold the last step's values
    assert value(values, "bitserve_num_requests_running", model="m", device="cpu") == 2
    assert value(values, "bitserve_num_requests_waiting", model="m", device="cpu") == 3
    assert value(values, "bitserve_kv_cache_usage_ratio", model="m", device="cpu") == 0.25
    assert value(values, "bitserve_prefix_cache_queries_total", model="m", device="cpu") == 48 + 8
    assert value(values, "bitserve_prefix_cache_hits_total", model="m", device="cpu") == 16
    assert value(values, "bitserve_preemptions_total", model="m", device="cpu") == 5  # deltas 0, 2, 3
    assert value(values, "bitserve_batched_tokens_per_step_count", model="m", device="cpu") == 3
    assert value(values, "bitserve_batched_tokens_per_step_bucket", model="m", device="cpu", le="1.0") == 1
    assert value(values, "bitserve_step_duration_seconds_count", model="m", device="cpu") == 3
    assert value(values, "bitserve_batch_formation_seconds_count", model="m", device="cpu") == 3
    # device memory: only where the runner reports it (CUDA), dropped with the replica
    assert not [key for key in values if key[0] == "bitserve_device_memory_bytes"]
    sink.record_step("m", "cuda:0", FORMAT, step(device_memory_bytes=123456789))
    assert value(samples(sink), "bitserve_device_memory_bytes", model="m", device="cuda:0") == 123456789
    sink.forget_model("m", "cuda:0")
    assert not [key for key in samples(sink) if key[0] == "bitserve_device_memory_bytes"]
    # a fresh engine restarts its cumulative count: the whole new count is new preemptions
    sink.record_step("m", "cpu", FORMAT, step(num_preempted_total=1))
    assert value(samples(sink), "bitserve_preemptions_total", model="m", device="cpu") == 6


def test_rejections_aborts_and_http_errors_by_label() -> None:
    sink = PrometheusStatsSink()
    sink.record_rejected("queue_full")
    sink.record_rejected("queue_full")
    sink.record_aborted("client_disconnect")
    sink.record_http_error(429, "rate_limit_exceeded")
    sink.record_http_error(500, "internal_error")
    sink.record_http_error(500, "internal_error")
    values = samples(sink)
    assert value(values, "bitserve_requests_rejected_total", reason="queue_full") == 2
    assert value(values, "bitserve_requests_aborted_total", reason="client_disconnect") == 1
    assert value(values, "bitserve_http_errors_total", status="429", reason="rate_limit_exceeded") == 1
    assert value(values, "bitserve_http_errors_total", status="500", reason="internal_error") == 2


def test_http_error_reasons_are_bounded() -> None:
    sink = PrometheusStatsSink()
    for index in range(100):
        sink.record_http_error(400, f"reason-{index}")
    values = samples(sink)
    reasons = {dict(labels)["reason"] for name, labels in values if name == "bitserve_http_errors_total"}
    assert len(reasons) == 65 and "other" in reasons
    assert value(values, "bitserve_http_errors_total", status="400", reason="other") == 36


def test_registries_are_independent_and_forget_model_drops_gauges() -> None:
    first, second = PrometheusStatsSink(), PrometheusStatsSink()
    first.record_step("a", "cpu", FORMAT, step())
    first.record_step("a", "cuda:1", FORMAT, step())
    first.record_step("b", "cpu", FORMAT, step(num_running=7))
    assert not any(name == "bitserve_num_requests_running" for name, _ in samples(second))
    assert value(samples(first), "bitserve_num_requests_running", model="a", device="cuda:1") == 2
    first.forget_model("a", "cuda:1")  # a swap moved "a" off that device
    values = samples(first)
    assert (
        "bitserve_num_requests_running",
        frozenset({("model", "a"), ("device", "cuda:1"), ("quant_format", FORMAT)}),
    ) not in values
    assert value(values, "bitserve_num_requests_running", model="a", device="cpu") == 2
    first.record_step("a", "cuda:1", FORMAT, step())
    first.forget_model("a")
    values = samples(first)
    for device in ("cpu", "cuda:1"):  # every replica's gauges go
        assert (
            "bitserve_num_requests_running",
            frozenset({("model", "a"), ("device", device), ("quant_format", FORMAT)}),
        ) not in values
    assert value(values, "bitserve_num_requests_running", model="b", device="cpu") == 7
    # counters of a forgotten model stay (they are totals, and Prometheus expects them monotonic)
    assert value(values, "bitserve_prefix_cache_hits_total", model="a", device="cpu") == 16


def test_speculative_drafts_and_accepted_tokens_are_counters() -> None:
    sink = PrometheusStatsSink()
    sink.record_step("m", "cpu", FORMAT, step())  # speculation off: no series
    assert not [key for key in samples(sink) if key[0].startswith("bitserve_spec_decode")]
    sink.record_step("m", "cpu", FORMAT, step(num_draft_tokens=8, num_accepted_tokens=5))
    sink.record_step("m", "cpu", FORMAT, step(num_draft_tokens=4, num_accepted_tokens=0))
    values = samples(sink)
    assert value(values, "bitserve_spec_decode_draft_tokens_total", model="m", device="cpu") == 12
    assert value(values, "bitserve_spec_decode_accepted_tokens_total", model="m", device="cpu") == 5


def test_a_swap_to_another_format_drops_the_old_gauges() -> None:
    sink = PrometheusStatsSink()
    sink.record_step("m", "cpu", "Q4_1", step(num_running=4))
    sink.record_step("m", "cpu", "I2_S", step(num_running=1))
    values = samples(sink)
    assert value(values, "bitserve_num_requests_running", model="m", device="cpu", quant_format="I2_S") == 1
    assert (
        "bitserve_num_requests_running",
        frozenset({("model", "m"), ("device", "cpu"), ("quant_format", "Q4_1")}),
    ) not in values
    assert value(values, "vllm:num_requests_running", model_name="m") == 1


def test_vllm_alias_gauges_follow_the_replicas() -> None:
    sink = PrometheusStatsSink()
    sink.record_step("m", "cpu", FORMAT, step(num_running=2, num_waiting=3, kv_usage=0.25))
    sink.record_step("m", "cuda:0", FORMAT, step(num_running=5, num_waiting=1, kv_usage=0.75))
    values = samples(sink)
    assert value(values, "vllm:num_requests_running", model_name="m") == 7  # summed over replicas
    assert value(values, "vllm:num_requests_waiting", model_name="m") == 4
    assert value(values, "vllm:gpu_cache_usage_perc", model_name="m") == 0.75  # the fullest replica
    sink.forget_model("m", "cuda:0")
    assert value(samples(sink), "vllm:num_requests_running", model_name="m") == 2
    sink.forget_model("m")
    assert not any(name.startswith("vllm:") for name, _ in samples(sink))


def test_process_memory_and_cgroup_limit(tmp_path: Path) -> None:
    v2, v1 = tmp_path / "memory.max", tmp_path / "memory.limit_in_bytes"
    assert read_memory_limit_bytes((v2, v1)) is None  # neither readable
    v1.write_text("9223372036854771712\n")  # cgroup v1's "unlimited"
    assert read_memory_limit_bytes((v2, v1)) is None
    v2.write_text("max\n")
    assert read_memory_limit_bytes((v2, v1)) is None
    v2.write_text("2147483648\n")
    assert read_memory_limit_bytes((v2, v1)) == 2**31
    families = list(MemoryLimitCollector((v2, v1)).collect())
    assert [(f.name, f.samples[0].value) for f in families] == [("bitserve_memory_limit_bytes", 2**31)]
    (unlimited,) = MemoryLimitCollector((tmp_path / "absent",)).collect()
    assert unlimited.name == "bitserve_memory_limit_bytes" and unlimited.samples == []
    assert value(samples(PrometheusStatsSink()), "process_resident_memory_bytes") > 0
