"""Frozen configuration dataclasses: the single home of every default (ServerConfig's own module is
bitserve/server_config.py, re-exported here).

Scheduling and cache defaults live in `core/scheduling_config.py` (core must not import this module's torch-
adjacent neighbours); they are re-exported here so callers have one place to look. Each field's
`metadata["help"]` is the text the CLI shows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bitserve.core.scheduling_config import SPECULATIVE_CHOICES, CacheConfig, SchedulerConfig
from bitserve.loader.catalog import DEFAULT_MODEL
from bitserve.server_config import (  # noqa: F401 - re-exported: one place to import every config from
    ADMISSION_BATCHES,
    ENGINE_PROCESS_MODES,
    EVENT_LOOPS,
    HTTP_PARSERS,
    LOG_FORMATS,
    MIN_NUM_QUEUED_TOKENS,
    MIN_NUM_WAITING,
    ServerConfig,
)

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
