"""Frozen configuration dataclasses: the single home of every default.

Scheduling and cache defaults live in `core/config.py` (core must not import this module's torch-
adjacent neighbours); they are re-exported here so callers have one place to look. Each field's
`metadata["help"]` is the text the CLI shows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bitserve.catalog import DEFAULT_MODEL
from bitserve.core.config import CacheConfig, SchedulerConfig

__all__ = ["CacheConfig", "EngineConfig", "ModelConfig", "SchedulerConfig"]


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model: str = field(default=DEFAULT_MODEL, metadata=_help("catalog name or path of a GGUF file"))
    backend: str = field(default="auto", metadata=_help("kernel backend: auto, cpu or reference"))
    linear_mode: str = field(
        default="bitnet",
        metadata=_help("ternary linear semantics: bitnet (per-token int8, bitnet.cpp), float, llamacpp-tq"),
    )
    i2s_variant: str = field(default="A", metadata=_help("I2_S packing: A (x86 128-block), B (ARM 64-block), C (4-row interleave)"))
    tl_config: str | None = field(default=None, metadata=_help("TL1/TL2 tile config: a kernel_config.ini path or preset:<name>"))
    tokenizer_pre: str | None = field(default=None, metadata=_help("override the BPE pre-tokenizer (e.g. default, llama-bpe)"))
    max_model_len: int | None = field(default=None, metadata=_help("cap the context length below the model's"))
    kv_cache_dtype: str = field(default="float32", metadata=_help("KV cache dtype: float32 or float16"))
    num_threads: int | None = field(default=None, metadata=_help("torch intra-op threads (default: all cores)"))


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """One replica's configuration."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kv_cache_memory_bytes: int = field(default=512 * 1024 * 1024, metadata=_help("memory for the paged KV cache"))
