"""Frozen configuration dataclasses: the single home of every default.

Scheduling and cache defaults live in `core/scheduling_config.py` (core must not import this module's torch-
adjacent neighbours); they are re-exported here so callers have one place to look. Each field's
`metadata["help"]` is the text the CLI shows.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

from bitserve.core.scheduling_config import SPECULATIVE_CHOICES, CacheConfig, SchedulerConfig
from bitserve.loader.catalog import DEFAULT_MODEL

__all__ = [
    "SPECULATIVE_CHOICES",
    "CacheConfig",
    "EngineConfig",
    "ModelConfig",
    "SchedulerConfig",
    "ServerConfig",
]


def _help(text: str) -> dict[str, str]:
    return {"help": text}


LM_HEAD_CHOICES = ("auto", "q8_0")  # --lm-head: keep the file's head, or quantize a float one to Q8_0
CPU_ISA_CHOICES = ("auto", "vnni", "avx2", "generic")  # kernels/cpu/isa.py's variants
BLOCK_ACTIVATION_CHOICES = ("auto", "q8", "ggml", "f32")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model: str = field(default=DEFAULT_MODEL, metadata=_help("catalog name or path of a GGUF file"))
    backend: str = field(default="auto", metadata=_help("kernel backend: auto, cpu, cuda or reference"))
    device: str = field(
        default="cpu",
        metadata=_help(
            "where the model runs: auto, cpu, cuda or cuda:N; serve also takes a comma-separated list, one "
            "replica each (resolved to cpu or cuda:N before a load: ModelInstance.load sees only those)"
        ),
    )
    linear_mode: str = field(
        default="bitnet",
        metadata=_help(
            "ternary linear semantics: bitnet (per-token int8, bitnet.cpp), float, llamacpp-tq, "
            "bitnetcpp (bitnet plus bitnet.cpp's F16 attention / RoPE rounding)"
        ),
    )
    lm_head: str = field(
        default="auto",
        metadata=_help(
            "LM head storage: auto (as the file stores it) or q8_0 (an F16/BF16/F32 head quantized to Q8_0 "
            "at load: ~half the bytes read per token and ~250 MB less RSS on 2B-4T; cpu backend; quality "
            "cost in benchmarks/RESULTS.md)"
        ),
    )
    i2s_variant: str = field(
        default="A", metadata=_help("I2_S packing: A (x86 128-block), B (ARM 64-block), C (4-row interleave)")
    )
    tl_config: str | None = field(
        default=None, metadata=_help("TL1/TL2 tile config: a kernel_config.ini path or preset:<name>")
    )
    tokenizer_pre: str | None = field(
        default=None, metadata=_help("override the BPE pre-tokenizer (e.g. default, llama-bpe)")
    )
    hidden_act: str | None = field(
        default=None,
        metadata=_help(
            "override the FFN's gated activation (silu, relu2, gelu, ...): over the file's key, or what "
            "bitserve decided from the file's facts (bitserve inspect shows it and why)"
        ),
    )
    cuda_graphs: bool = field(
        default=True, metadata=_help("on a CUDA device, replay decode steps as CUDA graphs (off: eager)")
    )
    kv_cache_dtype: str = field(
        default="auto",
        metadata=_help(
            "KV cache dtype: auto (float32 on cpu, float16 on cuda), float32, float16 or bfloat16"
        ),
    )
    num_threads: int | None = field(
        default=None, metadata=_help("torch intra-op threads (default: all cores)")
    )
    # default 0: with the int8 block kernels (q8 activations, up to 95 tokens) an f32 copy only serves
    # prefill-sized steps, where it measured 0.94-1.29x dequantize + sgemm (512-token SmolLM2 prefill) for
    # 540 MB of RSS (benchmarks/RESULTS.md); with f32 activations (from 8 tokens) it pays more
    max_dense_weight_bytes: int = field(
        default=0,
        metadata=_help(
            "f32 copies of Q4/Q8 block weights kept for batched steps too large for the packed kernels "
            "(96+ tokens with q8 activations, 8+ with f32); 4 bytes per weight; 0 (default) keeps only the "
            "packed blocks"
        ),
    )

    # kernel tuning (kernels/tuning.py: one KernelTuning built from these at load; defaults measured best)
    cpu_isa: str = field(
        default="auto",
        metadata=_help(
            "cpu backend ternary kernel variant: auto (the best this CPU runs), vnni, avx2 or generic"
        ),
    )
    block_activations: str = field(
        default="auto",
        metadata=_help(
            "cpu backend: how Q4_0/Q4_1/Q8_0 weights meet activations: auto (q8 on avx2/vnni, else f32), "
            "q8 (llama.cpp's int8 blocks), ggml (llama.cpp's own rounding per weight type: Q8_0 / Q8_1 / "
            "Q8_K, for crossval) or f32 (exact)"
        ),
    )
    cuda_pdl: bool = field(
        default=True,
        metadata=_help("cuda: programmatic dependent launch between the decode kernels (sm_90 and newer)"),
    )
    cuda_greedy_head: bool = field(
        default=True,
        metadata=_help(
            "cuda: greedy decode steps take the argmax from an int8 copy of a float LM head "
            "(vocab x hidden bytes of device memory)"
        ),
    )
    cuda_lookahead: bool = field(
        default=True,
        metadata=_help("cuda: launch the next plain greedy decode step before this one's tokens are read"),
    )
    cuda_lookahead_slot: bool = field(
        default=True,
        metadata=_help("cuda: the scheduler reserves each decode's next KV slot for the step launched ahead"),
    )
    cuda_gemv_tiles: str = field(
        default="",
        metadata=_help(
            "cuda, for tile sweeps: ternary GEMV tiles by shape, 'MxKxT=block_m,block_w,num_warps;...' "
            "(empty: the measured table)"
        ),
    )
    cuda_decode_tile: str = field(
        default="",
        metadata=_help(
            "cuda, for tile sweeps: the f16/bf16 decode-attention tile 'BLOCK_N,num_warps,num_stages' "
            "(empty: the measured choice)"
        ),
    )

    def __post_init__(self) -> None:
        if self.lm_head not in LM_HEAD_CHOICES:
            raise ValueError(f"lm_head must be one of {', '.join(LM_HEAD_CHOICES)}, got {self.lm_head!r}")
        if self.cpu_isa not in CPU_ISA_CHOICES:
            raise ValueError(f"cpu_isa must be one of {', '.join(CPU_ISA_CHOICES)}, got {self.cpu_isa!r}")
        if self.block_activations not in BLOCK_ACTIVATION_CHOICES:
            choices = ", ".join(BLOCK_ACTIVATION_CHOICES)
            raise ValueError(f"block_activations must be one of {choices}, got {self.block_activations!r}")


# ---------------------------------------------------------------- default KV pool size (issue 10)
# llama.cpp sizes its KV cache as n_ctx tokens shared by n_seq sequences; vLLM as whatever memory is left
# after the weights. A CPU server has no "rest of the GPU" to fill, so the default is llama.cpp's shape:
# room for max_num_seqs sequences of a typical chat turn (prompt + answer), never less than one
# max_model_len sequence (the scheduler refuses a request that could not fit the whole pool, and a request
# without max_tokens may run to the end of the context), and capped so a small model's pool does not
# dwarf its weights (the cap was the old flat default, so no measured throughput row loses KV room).
# The pool is a ceiling, not a cost: its pages are zeroed lazily and reused most-recently-freed first
# (core/block_pool.py), so resident memory follows the load a server has seen.
KV_CACHE_TOKENS_PER_SEQ = 256
KV_CACHE_DEFAULT_MAX_BYTES = 512 * 1024 * 1024
# A CUDA replica's default KV cache takes at most this share of its device's usable memory (after its
# weights and activation reserve): a swap loads the next version beside the serving one
# (runner/cuda_memory.py).
CUDA_KV_REPLICA_SHARE = 0.5
GPU_MEMORY_UTILIZATION_DEFAULT = 0.9  # vLLM's default share of the device


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """One replica's configuration."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kv_cache_memory_bytes: int | None = field(
        default=None,
        metadata=_help(
            f"memory for the paged KV cache (default on CPU: max_num_seqs x {KV_CACHE_TOKENS_PER_SEQ} tokens "
            f"of the model's KV, at most {KV_CACHE_DEFAULT_MAX_BYTES >> 20} MiB, at least one max_model_len "
            "sequence; on CUDA: from the device's free memory, see gpu_memory_utilization)"
        ),
    )
    gpu_memory_utilization: float = field(
        default=GPU_MEMORY_UTILIZATION_DEFAULT,
        metadata=_help(
            "share of a GPU's memory the server may use; a CUDA replica's default KV cache takes what "
            f"is left after weights and activations, at most a {CUDA_KV_REPLICA_SHARE:g} share of it so "
            "a swap can load the next version beside it"
        ),
    )

    def __post_init__(self) -> None:
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(f"kv_cache_memory_bytes must be >= 1 when set, got {self.kv_cache_memory_bytes}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")


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
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not self.drain_timeout_s >= 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if not 0.0 <= self.probation_max_error_rate <= 1.0:
            raise ValueError(
                f"probation_max_error_rate must be in [0, 1], got {self.probation_max_error_rate}"
            )
        for name in ("swap_drain_timeout_s", "swap_probation_s"):
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
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.high_priority_reserve < 1.0:
            raise ValueError(f"high_priority_reserve must be in [0, 1), got {self.high_priority_reserve}")
        if not 0.0 < self.low_priority_share <= 1.0 - self.high_priority_reserve:
            raise ValueError(
                f"low_priority_share must be in (0, 1 - high_priority_reserve], got {self.low_priority_share}"
            )
        for name in ("response_cache_bytes", "response_cache_disk_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.response_cache_ttl_s > 0:
            raise ValueError(f"response_cache_ttl_s must be > 0, got {self.response_cache_ttl_s}")
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


def kv_cache_default_tokens(max_num_seqs: int, max_model_len: int, kv_bytes_per_token: int) -> int:
    """Token slots of the default KV pool: max_num_seqs x KV_CACHE_TOKENS_PER_SEQ, at most
    KV_CACHE_DEFAULT_MAX_BYTES of KV, at least one max_model_len sequence."""
    if kv_bytes_per_token < 1:
        raise ValueError(f"kv_bytes_per_token must be >= 1, got {kv_bytes_per_token}")
    wanted = max_num_seqs * KV_CACHE_TOKENS_PER_SEQ
    capped = min(wanted, KV_CACHE_DEFAULT_MAX_BYTES // kv_bytes_per_token)
    return max(capped, max_model_len)


def kv_cache_budget_estimate(config: EngineConfig) -> int:
    """The KV bytes to expect before a model is loaded (device fit, the models memory budget): the set
    budget, else the default's cap (exceeded only by a model whose one full context needs more)."""
    if config.kv_cache_memory_bytes is not None:
        return config.kv_cache_memory_bytes
    return KV_CACHE_DEFAULT_MAX_BYTES
