"""ServerConfig: the HTTP edge's frozen configuration (bind address, request limits, timeouts, admission,
drain, the model lifecycle's probation and canary, transport and compression), with every default. Apart
from bitserve/config.py, which re-exports it, so that neither file outgrows the size ceiling; each field's
`metadata["help"]` is the text the CLI shows (server/settings.py builds the flags from the fields).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field


def _help(text: str) -> dict[str, str]:
    return {"help": text}


# Admission defaults scale with the replica (frontend/admission.py): a running batch and one more waiting,
# and the prompt tokens its KV cache holds; the floors are the limits of a small CPU replica.
ADMISSION_BATCHES = 2
MIN_NUM_WAITING = 256
MIN_NUM_QUEUED_TOKENS = 262_144

LOG_FORMATS = ("json", "text")
HTTP_PARSERS = ("auto", "httptools", "h11")
EVENT_LOOPS = ("asyncio", "uvloop")
ENGINE_PROCESS_MODES = ("auto", "on", "off")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """The HTTP edge: bind address, request limits, timeouts, admission and drain. Invalid values raise
    ValueError."""

    host: str = field(default="127.0.0.1", metadata=_help("address to bind (0.0.0.0 for all interfaces)"))
    port: int = field(default=8000, metadata=_help("TCP port to listen on"))
    served_model_name: str | None = field(
        default=None,
        metadata=_help("model id clients send and /v1/models lists (default: catalog name or file stem)"),
    )
    max_body_bytes: int = field(
        default=4 * 1024 * 1024, metadata=_help("largest request body; larger gets 413")
    )
    body_read_timeout_s: float = field(
        default=30.0,
        metadata=_help("seconds to receive a whole request body; slower gets 408 and the connection closed"),
    )
    header_read_timeout_s: float = field(
        default=10.0,
        metadata=_help(
            "seconds to receive a request's headers once a connection is open or busy (slowloris)"
        ),
    )
    max_header_bytes: int = field(
        default=16 * 1024,
        metadata=_help("largest request line plus headers; larger gets 431 (or 400 while still arriving)"),
    )
    # NOTE: longer than the idle timeout of the proxies in front (AWS ALB 60 s, nginx upstream
    # keepalive 60 s): a server that closes an idle connection first races the proxy's or client's
    # next request on it, which then fails with a connection reset (measured: a few per thousand
    # requests with uvicorn's 5 s and a busy client pool).
    keep_alive_timeout_s: int = field(
        default=75,
        metadata=_help(
            "seconds an idle keep-alive connection stays open (keep above your proxy's idle timeout)"
        ),
    )
    max_num_waiting: int | None = field(
        default=None,
        metadata=_help(
            "unfinished requests a replica admits at once; more get 429 with Retry-After (default: "
            f"{ADMISSION_BATCHES} x the replica's max_num_seqs, at least {MIN_NUM_WAITING})"
        ),
    )
    max_num_queued_tokens: int | None = field(
        default=None,
        metadata=_help(
            "prompt tokens of unfinished requests a replica admits at once; more get 429 (default: the "
            f"replica's KV cache tokens, at least {MIN_NUM_QUEUED_TOKENS:,})"
        ),
    )
    high_priority_reserve: float = field(
        default=0.2,
        metadata=_help(
            "share of the admission limits kept for priority high: normal and low get 429 past the rest"
        ),
    )
    low_priority_share: float = field(
        default=0.6,
        metadata=_help("share of the admission limits priority low may fill; low is shed first"),
    )
    drain_timeout_s: float = field(
        default=30.0,
        metadata=_help("on SIGTERM, seconds in-flight requests get to finish before streams are ended"),
    )
    sse_keepalive_s: float = field(
        default=15.0, metadata=_help("seconds between ': ping' comments on an idle stream")
    )
    ws_max_message_bytes: int = field(
        default=1024 * 1024,
        metadata=_help("largest WebSocket message on /v1/ws; a larger one closes the socket (code 1009)"),
    )
    ws_max_requests: int = field(
        default=8, metadata=_help("requests in flight at once on one /v1/ws socket; more get a 429 error")
    )
    slow_request_s: float = field(
        default=10.0, metadata=_help("a request slower than this end to end is logged with its timings")
    )
    liveness_stall_s: float = field(
        default=120.0,
        metadata=_help("/health/live fails when work is pending and the engine made no step for this long"),
    )
    model_roots: str | None = field(
        default=None,
        metadata=_help(
            "folders of GGUF files the admin API may load (':'-separated; --model-root is repeatable); "
            "catalog names are always allowed"
        ),
    )
    max_models_memory_bytes: int | None = field(
        default=None,
        metadata=_help(
            "memory budget for resident models (file + KV cache each); "
            "idle models are unloaded LRU to make room"
        ),
    )
    swap_drain_timeout_s: float = field(
        default=300.0,
        metadata=_help("after a swap or unload, seconds the old version's in-flight requests get to finish"),
    )
    swap_probation_s: float = field(
        default=30.0,
        metadata=_help(
            "after a swap, seconds the new version is watched and rolled back on failure (0: off)"
        ),
    )
    probation_max_error_rate: float = field(
        default=0.5,
        metadata=_help("during probation, roll back when this share of the new version's requests fail"),
    )
    probation_min_requests: int = field(
        default=4,
        metadata=_help("finished requests needed before probation judges the error rate or latency"),
    )
    probation_max_itl_s: float | None = field(
        default=None,
        metadata=_help(
            "during probation, roll back when the mean inter-token latency exceeds this (off when unset)"
        ),
    )
    canary_window_s: float = field(
        default=300.0,
        metadata=_help("seconds a canary (a swap with `canary`) is compared with the stable version"),
    )
    # NOTE: off by default. Both versions of a CPU canary share the cores and the GIL, so the smaller
    # one's latency measures the contention, not the version: identical-shape models at a 10% share
    # measured 235.8 ms canary ITL against 62.9 ms stable (tests/server/test_canary_rollout.py's setup).
    canary_max_latency_ratio: float | None = field(
        default=None,
        metadata=_help(
            "roll a canary back when its mean TTFT or ITL exceeds this times the stable one's (off: unset)"
        ),
    )
    # NOTE: off by default. A hit skips the engine, so a load test or benchmark that repeats a greedy
    # prompt (`bitserve bench --prompt`) would measure the cache, and a client that repeats a greedy
    # request to check the engine's determinism would check the cache instead. Operators whose
    # traffic repeats (evals, CI, FAQ-style prompts) turn it on; see README "Response cache".
    response_cache: bool = field(
        default=False,
        metadata=_help(
            "answer repeated deterministic requests (temperature 0, or a seed) from a cache; "
            "never across model versions"
        ),
    )
    response_cache_bytes: int = field(
        default=256 * 1024 * 1024,
        metadata=_help("memory budget of the response cache (least recently used answers are evicted)"),
    )
    response_cache_dir: str | None = field(
        default=None,
        metadata=_help("folder for the response cache's disk tier (compressed; survives restarts)"),
    )
    response_cache_disk_bytes: int = field(
        default=2 * 1024 * 1024 * 1024,
        metadata=_help("disk budget of the response cache's disk tier (oldest answers are removed)"),
    )
    response_cache_ttl_s: float = field(
        default=3600.0, metadata=_help("seconds a cached answer is served before it is generated again")
    )
    warmup: bool = field(default=True, metadata=_help("run one short generation before reporting ready"))
    kernel_cache_seed: str = field(
        default="",
        metadata=_help(
            "a prebuilt numba kernel cache (a read-only folder: the image's) copied into NUMBA_CACHE_DIR "
            "at start, so the first generation compiles nothing"
        ),
    )
    access_log: bool = field(default=True, metadata=_help("log one line per HTTP request"))
    log_format: str = field(default="json", metadata=_help("log format: json (one object per line) or text"))
    # NOTE: httptools parses in C: the served 2B row's p99 on an H100 averaged 0.957 s against h11's 1.060
    # over 3 alternating pairs (lower in 2); uvloop made every run worse (1.28-1.57 s): its socket writes
    # hold the GIL the engine thread needs, where asyncio's release it (benchmarks/RESULTS.md)
    http_parser: str = field(
        default="auto",
        metadata=_help("HTTP/1.1 parser: auto (httptools when installed, else h11), httptools or h11"),
    )
    event_loop: str = field(
        default="asyncio",
        metadata=_help("event loop: asyncio, or uvloop when installed (slower beside a GPU engine thread)"),
    )
    # NOTE: off by default: hypercorn frames HTTP/2 in pure Python on the event loop that streams every
    # token (benchmarks/RESULTS.md, "HTTP/2 and compression"; server/http2_serving.py)
    http2: bool = field(default=False, metadata=_help("also serve h2c / h2 (ALPN) on the port (hypercorn)"))
    ssl_certfile: str | None = field(default=None, metadata=_help("PEM certificate chain: serve HTTPS"))
    ssl_keyfile: str | None = field(default=None, metadata=_help("PEM key (default: in --ssl-certfile)"))
    compression: bool = field(default=True, metadata=_help("gzip / br bodies by Accept-Encoding (never SSE)"))
    compression_min_bytes: int = field(default=1024, metadata=_help("smallest body that is compressed"))
    # NOTE: a CUDA replica's engine steps in ~1-4 ms of Python around a graph replay; in the server's own
    # process it takes turns on one GIL with the event loop that parses requests and streams every token,
    # and the served 2B row's waves spent half their time there (benchmarks/RESULTS.md, 2026-11-27 06:00).
    # A CPU replica stays a thread by default: on 2 vCPUs a process served SmolLM2 at 16 streams 12-16%
    # faster but held 40% more memory in two processes (927 against 660 MB; RESULTS.md, 2026-11-29).
    engine_process: str = field(
        default="auto",
        metadata=_help(
            "run each replica's engine in a process of its own: auto (CUDA replicas), on (every replica) "
            "or off (a thread of the server's process)"
        ),
    )
    otel_endpoint: str | None = field(
        default=None,
        metadata=_help(
            "OTLP/HTTP collector for OpenTelemetry traces, e.g. http://otel-collector:4318 "
            "(default: $OTEL_EXPORTER_OTLP_ENDPOINT; tracing is off when neither is set)"
        ),
    )
    log_level: str = field(
        default="INFO", metadata=_help("log level of the server (DEBUG, INFO, WARNING, ...)")
    )
    breaker_failure_threshold: int = field(default=5, metadata=_help("failures in a row that open a breaker"))
    breaker_cooldown_s: float = field(default=10.0, metadata=_help("seconds an open breaker waits to probe"))

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.ws_max_message_bytes < 1024:
            raise ValueError(f"ws_max_message_bytes must be >= 1024, got {self.ws_max_message_bytes}")
        if self.max_header_bytes < 1024:
            raise ValueError(f"max_header_bytes must be >= 1024, got {self.max_header_bytes}")
        for name in (
            "body_read_timeout_s",
            "header_read_timeout_s",
            "sse_keepalive_s",
            "liveness_stall_s",
            "slow_request_s",
            "response_cache_ttl_s",
            "breaker_cooldown_s",
            "canary_window_s",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.canary_max_latency_ratio is not None and not self.canary_max_latency_ratio >= 1.0:
            raise ValueError(f"canary_max_latency_ratio must be >= 1, got {self.canary_max_latency_ratio}")
        if not 0.0 <= self.probation_max_error_rate <= 1.0:
            raise ValueError(
                f"probation_max_error_rate must be in [0, 1], got {self.probation_max_error_rate}"
            )
        for name in ("drain_timeout_s", "swap_drain_timeout_s", "swap_probation_s", "compression_min_bytes"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in (
            "max_models_memory_bytes",
            "probation_max_itl_s",
            "max_num_waiting",
            "max_num_queued_tokens",
        ):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 when set, got {getattr(self, name)}")
        for name in (
            "keep_alive_timeout_s",
            "probation_min_requests",
            "ws_max_requests",
            "response_cache_bytes",
            "response_cache_disk_bytes",
            "breaker_failure_threshold",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.ssl_keyfile is not None and self.ssl_certfile is None:
            raise ValueError("ssl_keyfile needs ssl_certfile")
        if not 0.0 <= self.high_priority_reserve < 1.0:
            raise ValueError(f"high_priority_reserve must be in [0, 1), got {self.high_priority_reserve}")
        if not 0.0 < self.low_priority_share <= 1.0 - self.high_priority_reserve:
            raise ValueError(
                f"low_priority_share must be in (0, 1 - high_priority_reserve], got {self.low_priority_share}"
            )
        if self.response_cache_dir is not None and not self.response_cache:
            raise ValueError("response_cache_dir needs response_cache on (--response-cache)")
        self._check_choices()

    def _check_choices(self) -> None:
        """ValueError for an engine-process mode, HTTP parser, event loop or log format bitserve does not
        know, or one that is not installed."""
        if self.engine_process not in ENGINE_PROCESS_MODES:
            choices = ", ".join(ENGINE_PROCESS_MODES)
            raise ValueError(f"engine_process must be one of {choices}, got {self.engine_process!r}")
        for name, choices in (("http_parser", HTTP_PARSERS), ("event_loop", EVENT_LOOPS)):
            value = getattr(self, name)
            if value not in choices:
                raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
            if value in ("httptools", "uvloop") and importlib.util.find_spec(value) is None:
                raise ValueError(f"{name} {value} is not installed (pip install {value})")
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"log_format must be one of {', '.join(LOG_FORMATS)}, got {self.log_format!r}")
