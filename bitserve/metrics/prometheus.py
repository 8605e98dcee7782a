"""PrometheusStatsSink: the production StatsSink, rendered on GET /metrics. The only module in bitserve
that imports prometheus_client; each sink owns its CollectorRegistry, so apps and tests never collide.
Its histograms' bucket bounds (metrics/buckets.py) and the cgroup memory-limit reader
(metrics/memory_limit.py) are plain modules beside it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector

from bitserve.core.step_outputs import StepStats
from bitserve.metrics.buckets import (
    BATCHED_TOKENS_BUCKETS,
    E2E_BUCKETS_S,
    ITL_BUCKETS_S,
    LOAD_BUCKETS_S,
    QUEUE_BUCKETS_S,
    STEP_BUCKETS_S,
    TTFT_BUCKETS_S,
)
from bitserve.metrics.energy import EnergyCollector
from bitserve.metrics.gc_pauses import GCPauseCollector
from bitserve.metrics.memory_limit import CGROUP_MEMORY_LIMIT_FILES, read_memory_limit_bytes
from bitserve.metrics.stats import (
    SWAP_ACTIONS,
    BatchStats,
    CacheTierStats,
    LifecycleEvent,
    RequestStats,
    ResponseCacheStats,
    SlotLabels,
)

logger = logging.getLogger(__name__)

FamilyT = TypeVar("FamilyT", CounterMetricFamily, GaugeMetricFamily)

# HTTP error reasons come from the server's error table (a bounded set); past this many distinct
# values, new ones are folded into "other" so a bug upstream cannot explode the series count.
MAX_NUM_HTTP_ERROR_REASONS = 64
# The labels of every per-replica series. NOTE: quant_format is the projections' GGUF type, a small fixed
# vocabulary, and a replica has one, so it adds no series; the version (a new value on every swap) is not a
# label here but on bitserve_model_info, joined in PromQL where a panel needs it.
REPLICA_LABELS = ["model", "device", "quant_format"]


class MemoryLimitCollector(Collector):
    """bitserve_memory_limit_bytes, read on each scrape: beside process_resident_memory_bytes it lets an
    alert say "memory near the limit" without kube-state-metrics."""

    def __init__(self, files: tuple[Path, ...] = CGROUP_MEMORY_LIMIT_FILES) -> None:
        self._files = files

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("bitserve_memory_limit_bytes", "The container's cgroup memory limit.")
        limit = read_memory_limit_bytes(self._files)
        if limit is not None:  # no limit: the family is described, with no sample
            family.add_metric([], limit)
        yield family


class ResponseCacheCollector(Collector):
    """bitserve_response_cache_*: read from the cache's own counters on each scrape (the cache keeps
    them for /v1/stats too, so there is one count). `tier` is memory or disk."""

    def __init__(self, read: Callable[[], ResponseCacheStats]) -> None:
        self._read = read

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        stats = self._read()
        tiers: list[tuple[str, CacheTierStats]] = [("memory", stats.memory)]
        if stats.disk is not None:
            tiers.append(("disk", stats.disk))
        prefix = "bitserve_response_cache"
        hits = CounterMetricFamily(
            f"{prefix}_hits", "Requests answered from the response cache.", labels=["tier"]
        )
        evictions = CounterMetricFamily(
            f"{prefix}_evictions", "Cached answers removed to stay within the byte budget.", labels=["tier"]
        )
        size = GaugeMetricFamily(f"{prefix}_bytes", "Bytes the response cache holds.", labels=["tier"])
        entries = GaugeMetricFamily(f"{prefix}_entries", "Answers the response cache holds.", labels=["tier"])
        for tier, tier_stats in tiers:
            hits.add_metric([tier], tier_stats.hits)
            evictions.add_metric([tier], tier_stats.evictions)
            size.add_metric([tier], tier_stats.bytes)
            entries.add_metric([tier], tier_stats.entries)
        yield hits
        yield CounterMetricFamily(
            f"{prefix}_misses", "Deterministic requests the response cache did not hold.", value=stats.misses
        )
        yield evictions
        yield size
        yield entries


class BatchCollector(Collector):
    """bitserve_batch*: the Batch API's batches by status and open requests by state (database-wide),
    and the requests this process's worker ended or retried (counters)."""

    def __init__(self, read: Callable[[], BatchStats]) -> None:
        self._read = read

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        stats = self._read()
        yield _family(
            GaugeMetricFamily,
            "bitserve_batches",
            "Batches in the Batch API's database, by status.",
            "status",
            dict(sorted(stats.by_status.items())),
        )
        yield _family(
            GaugeMetricFamily,
            "bitserve_batch_requests_open",
            "Requests of open batches not yet ended: pending (waiting, or backing off) or running.",
            "state",
            {"pending": stats.num_pending, "running": stats.num_running},
        )
        yield _family(
            CounterMetricFamily,
            "bitserve_batch_requests",
            "Batch requests this process ended (completed, failed: in the error file) or retried.",
            "outcome",
            {"completed": stats.num_completed, "failed": stats.num_failed, "retried": stats.num_retried},
        )


def _family(
    kind: type[FamilyT], name: str, documentation: str, label: str, values: dict[str, int]
) -> FamilyT:
    """A metric family with one sample per `values` entry, labelled `label`=its key."""
    family = kind(name, documentation, labels=[label])
    for label_value, value in values.items():
        family.add_metric([label_value], value)
    return family


class PrometheusStatsSink:
    """StatsSink that keeps Prometheus metrics in its own registry.

    Called on the event loop (AsyncEngine callbacks, HTTP handlers); prometheus_client's metric
    objects are thread-safe, and the small preemption bookkeeping here is only touched there too.
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        # (model, device, quant_format) -> last StepStats.num_preempted_total of that replica
        self._last_preempted_total: dict[tuple[str, str, str], int] = {}
        # model -> device -> quant_format of the replicas whose gauges exist (forget_model)
        self._devices: dict[str, dict[str, str]] = {}
        self._http_error_reasons: set[str] = set()
        self._build_request_metrics()
        self._build_step_metrics()
        self._build_spec_decode_metrics()
        self._build_edge_metrics()
        self._build_lifecycle_metrics()
        self._build_process_and_alias_metrics()
        self._served: set[tuple[str, str, str, str]] = set()  # label sets of bitserve_model_info now at 1

    # ----------------------------------------------------------------- metric definitions

    def _build_request_metrics(self) -> None:
        # `device`: the replica that served the request (an alias may have one per device)
        reg, model = self.registry, REPLICA_LABELS
        self.ttft = Histogram(
            "bitserve_time_to_first_token_seconds",
            "Time from arrival to the first output token.",
            model,
            buckets=TTFT_BUCKETS_S,
            registry=reg,
        )
        self.itl = Histogram(
            "bitserve_inter_token_latency_seconds",
            "Mean gap between output tokens, one sample per request.",
            model,
            buckets=ITL_BUCKETS_S,
            registry=reg,
        )
        self.e2e = Histogram(
            "bitserve_request_duration_seconds",
            "End-to-end request latency, arrival to finish.",
            model,
            buckets=E2E_BUCKETS_S,
            registry=reg,
        )
        self.queue = Histogram(
            "bitserve_request_queue_seconds",
            "Time a request waited before its first schedule.",
            model,
            buckets=QUEUE_BUCKETS_S,
            registry=reg,
        )
        self.prompt_tokens = Counter(
            "bitserve_prompt_tokens_total", "Prompt tokens of finished requests.", model, registry=reg
        )
        self.generation_tokens = Counter(
            "bitserve_generation_tokens_total", "Output tokens of finished requests.", model, registry=reg
        )
        self.requests = Counter(
            "bitserve_requests_total",
            "Finished requests by finish reason.",
            [*REPLICA_LABELS, "finish_reason"],
            registry=reg,
        )

    def _build_spec_decode_metrics(self) -> None:
        """Speculative decoding (--speculative ngram): drafts verified, and of them accepted."""
        reg, model, prefix = self.registry, REPLICA_LABELS, "bitserve_spec_decode"
        self.spec_drafts = Counter(
            f"{prefix}_draft_tokens_total", "Draft tokens verified.", model, registry=reg
        )
        self.spec_accepted = Counter(
            f"{prefix}_accepted_tokens_total", "Drafts accepted.", model, registry=reg
        )

    def _build_step_metrics(self) -> None:
        reg, model = self.registry, REPLICA_LABELS  # one series per replica
        self.num_running = Gauge(
            "bitserve_num_requests_running", "Requests in the running batch.", model, registry=reg
        )
        self.num_waiting = Gauge(
            "bitserve_num_requests_waiting", "Requests waiting to be scheduled.", model, registry=reg
        )
        self.kv_usage = Gauge(
            "bitserve_kv_cache_usage_ratio",
            "Fraction of usable KV-cache blocks in use (0..1).",
            model,
            registry=reg,
        )
        self.prefix_queries = Counter(
            "bitserve_prefix_cache_queries_total",
            "Prompt tokens looked up in the prefix cache.",
            model,
            registry=reg,
        )
        self.prefix_hits = Counter(
            "bitserve_prefix_cache_hits_total",
            "Prompt tokens served from the prefix cache.",
            model,
            registry=reg,
        )
        self.preemptions = Counter(
            "bitserve_preemptions_total",
            "Requests preempted (KV blocks reclaimed, recomputed later).",
            model,
            registry=reg,
        )
        self.batched_tokens = Histogram(
            "bitserve_batched_tokens_per_step",
            "Tokens (prefill + decode) computed in one step.",
            model,
            buckets=BATCHED_TOKENS_BUCKETS,
            registry=reg,
        )
        self.step_time = Histogram(
            "bitserve_step_duration_seconds",
            "Wall time of one engine step.",
            model,
            buckets=STEP_BUCKETS_S,
            registry=reg,
        )
        self.batch_formation = Histogram(
            "bitserve_batch_formation_seconds",
            "Time one engine step spent forming its batch (the scheduler's admission and KV allocation).",
            model,
            buckets=STEP_BUCKETS_S,
            registry=reg,
        )
        self.device_memory = Gauge(
            "bitserve_device_memory_bytes",
            "Bytes the replica's device allocator holds (CUDA; on CPU see process_resident_memory_bytes).",
            model,
            registry=reg,
        )

    def _build_edge_metrics(self) -> None:
        reg = self.registry
        self.rejected = Counter(
            "bitserve_requests_rejected_total",
            "Requests refused at admission, by reason.",
            ["reason"],
            registry=reg,
        )
        self.aborted = Counter(
            "bitserve_requests_aborted_total",
            "Requests aborted before finishing, by reason.",
            ["reason"],
            registry=reg,
        )
        self.http_errors = Counter(
            "bitserve_http_errors_total",
            "HTTP error responses, by status and error type.",
            ["status", "reason"],
            registry=reg,
        )
        self.limiter_errors = Counter(
            "bitserve_rate_limiter_errors_total",
            "Failures of the shared (Redis) rate limiter, by what the server did: open (served "
            "unlimited) or closed (refused with 503).",
            ["on_error"],
            registry=reg,
        )

    def _build_lifecycle_metrics(self) -> None:
        reg = self.registry
        self.swaps = Counter(
            "bitserve_model_swaps_total",
            "Swaps, rollbacks and canaries of an alias, by action and result.",
            ["action", "result"],
            registry=reg,
        )
        self.lifecycle = Counter(
            "bitserve_model_lifecycle_events_total",
            "Model loads, unloads and evictions, by result.",
            ["action", "result"],
            registry=reg,
        )
        self.load_duration = Histogram(
            "bitserve_model_load_duration_seconds",
            "Seconds to load and validate a model version.",
            ["model"],
            buckets=LOAD_BUCKETS_S,
            registry=reg,
        )
        self.model_info = Gauge(
            "bitserve_model_info",
            "1 for each alias and the version it serves now.",
            ["model", "version", "file", "architecture"],
            registry=reg,
        )

    def _build_process_and_alias_metrics(self) -> None:
        reg = self.registry
        ProcessCollector(registry=reg)  # process_resident_memory_bytes, process_cpu_seconds_total, ...
        reg.register(MemoryLimitCollector())
        reg.register(GCPauseCollector())
        self.energy = EnergyCollector()
        reg.register(self.energy)
        # The names ecosystem tools read (vLLM's; the Gateway API Inference Extension routes on them):
        # per model, summed over its replicas (the KV ratio: the fullest replica's).
        alias = ["model_name"]
        self.vllm_running = Gauge(
            "vllm:num_requests_running", "Alias of bitserve_num_requests_running.", alias, registry=reg
        )
        self.vllm_waiting = Gauge(
            "vllm:num_requests_waiting", "Alias of bitserve_num_requests_waiting.", alias, registry=reg
        )
        self.vllm_kv_usage = Gauge(
            "vllm:gpu_cache_usage_perc",
            "Alias of bitserve_kv_cache_usage_ratio (0..1, the fullest replica's).",
            alias,
            registry=reg,
        )
        self._replica_load: dict[tuple[str, str, str], tuple[int, int, float]] = {}

    def _update_aliases(self, model: str) -> None:
        loads = [load for (name, _, _), load in self._replica_load.items() if name == model]
        if not loads:
            for gauge in (self.vllm_running, self.vllm_waiting, self.vllm_kv_usage):
                gauge.remove(model)
            return
        self.vllm_running.labels(model).set(sum(load[0] for load in loads))
        self.vllm_waiting.labels(model).set(sum(load[1] for load in loads))
        self.vllm_kv_usage.labels(model).set(max(load[2] for load in loads))

    # ----------------------------------------------------------------- StatsSink

    def record_step(self, model: str, device: str, quant_format: str, stats: StepStats) -> None:
        """One engine step of `model`'s replica on `device`: gauges take the latest values, counters the
        step's increments."""
        if self._devices.get(model, {}).get(device, quant_format) != quant_format:
            self.forget_model(model, device)  # swapped to a version of another format: drop the old gauges
        self._devices.setdefault(model, {})[device] = quant_format
        labels = (model, device, quant_format)
        self.num_running.labels(*labels).set(stats.num_running)
        self.num_waiting.labels(*labels).set(stats.num_waiting)
        self.kv_usage.labels(*labels).set(stats.kv_usage)
        self._replica_load[labels] = (stats.num_running, stats.num_waiting, stats.kv_usage)
        self._update_aliases(model)
        if stats.num_prefix_query_tokens > 0:
            self.prefix_queries.labels(*labels).inc(stats.num_prefix_query_tokens)
        if stats.num_prefix_hit_tokens > 0:
            self.prefix_hits.labels(*labels).inc(stats.num_prefix_hit_tokens)
        if stats.num_draft_tokens > 0:  # the series appear with a replica's first drafts (speculative on)
            self.spec_drafts.labels(*labels).inc(stats.num_draft_tokens)
            self.spec_accepted.labels(*labels).inc(stats.num_accepted_tokens)
        # num_preempted_total is cumulative per engine; a drop means a fresh engine (swap, restart),
        # whose whole count is new.
        last = self._last_preempted_total.get(labels, 0)
        delta = (
            stats.num_preempted_total - last
            if stats.num_preempted_total >= last
            else stats.num_preempted_total
        )
        self._last_preempted_total[labels] = stats.num_preempted_total
        self.preemptions.labels(*labels)  # the series exists (at 0) from a replica's first step
        if delta > 0:
            self.preemptions.labels(*labels).inc(delta)
        if stats.num_batched_tokens > 0:
            self.batched_tokens.labels(*labels).observe(stats.num_batched_tokens)
        if stats.step_time_s > 0:
            self.step_time.labels(*labels).observe(stats.step_time_s)
            self.batch_formation.labels(*labels).observe(stats.schedule_time_s)
        if stats.device_memory_bytes is not None:
            self.device_memory.labels(*labels).set(stats.device_memory_bytes)

    def record_request(self, stats: RequestStats) -> None:
        """One finished client request; latencies that are unknown (None) are not observed."""
        labels = (stats.model, stats.device, stats.quant_format)
        self.requests.labels(*labels, stats.finish_reason).inc()
        self.prompt_tokens.labels(*labels).inc(stats.num_prompt_tokens)
        self.generation_tokens.labels(*labels).inc(stats.num_output_tokens)
        self.e2e.labels(*labels).observe(stats.e2e_s)
        if stats.ttft_s is not None:
            self.ttft.labels(*labels).observe(stats.ttft_s)
        if stats.mean_itl_s is not None:
            self.itl.labels(*labels).observe(stats.mean_itl_s)
        if stats.queue_s is not None:
            self.queue.labels(*labels).observe(stats.queue_s)

    def record_rejected(self, reason: str) -> None:
        self.rejected.labels(reason).inc()

    def record_aborted(self, reason: str) -> None:
        self.aborted.labels(reason).inc()

    def record_lifecycle(self, event: LifecycleEvent) -> None:
        counter = self.swaps if event.action in SWAP_ACTIONS else self.lifecycle
        counter.labels(event.action, event.result).inc()
        if event.duration_s is not None and event.result == "success":
            self.load_duration.labels(event.alias).observe(event.duration_s)

    def set_served_models(self, models: list[SlotLabels]) -> None:
        """The info gauge holds exactly `models` (series of versions no longer served are removed)."""
        now = {(m.alias, m.version, m.file_name, m.architecture) for m in models}
        for labels in self._served - now:
            self.model_info.remove(*labels)
        for labels in now:
            self.model_info.labels(*labels).set(1)
        self._served = now

    # ----------------------------------------------------------------- server edge

    def record_http_error(self, status: int, reason: str) -> None:
        """One HTTP error response. `reason` should be the error type from the server's error table."""
        if reason not in self._http_error_reasons:
            if len(self._http_error_reasons) >= MAX_NUM_HTTP_ERROR_REASONS:
                logger.warning(
                    "more than %d HTTP error reasons; %r is counted as 'other'",
                    MAX_NUM_HTTP_ERROR_REASONS,
                    reason,
                )
                reason = "other"
            self._http_error_reasons.add(reason)
        self.http_errors.labels(str(int(status)), reason).inc()

    def forget_model(self, model: str, device: str | None = None) -> None:
        """Drop `model`'s gauge series on `device`, or on every device (after an unload), so a gone
        model or replica does not report stale load."""
        devices = self._devices.get(model, {})
        for gone in [device] if device is not None else list(devices):
            quant_format = devices.pop(gone, None)
            if quant_format is not None:
                for gauge in (self.num_running, self.num_waiting, self.kv_usage, self.device_memory):
                    gauge.remove(model, gone, quant_format)  # a series never set: nothing to remove
            self._last_preempted_total.pop((model, gone, quant_format), None)
            self._replica_load.pop((model, gone, quant_format), None)
        self._update_aliases(model)
        if not devices:
            self._devices.pop(model, None)

    def watch_response_cache(self, read: Callable[[], ResponseCacheStats]) -> None:
        """Export the response cache's counters (app.py calls this when --response-cache is on)."""
        self.registry.register(ResponseCacheCollector(read))

    def watch_batches(self, read: Callable[[], BatchStats]) -> None:
        """Export the Batch API's counts (app.py calls this when the Batch API is configured)."""
        self.registry.register(BatchCollector(read))

    def render(self) -> tuple[bytes, str]:
        """The body and content type for GET /metrics (Prometheus text exposition format)."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def energy_status(self) -> dict[str, str]:
        """Per energy source, "ok: ..." or why bitserve_energy_joules_total has no samples for it."""
        return self.energy.status()

    def record_limiter_error(self, on_error: str) -> None:
        """The rate limiter's backend failed; `on_error` is "open" or "closed"."""
        self.limiter_errors.labels(on_error).inc()
