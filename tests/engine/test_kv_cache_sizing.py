"""The default KV pool (issue 10): sized from the model's KV bytes per token and the serving limits,
capped, never smaller than one max_model_len sequence; explicit settings still win."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from bitserve.config import (
    KV_CACHE_DEFAULT_MAX_BYTES,
    KV_CACHE_TOKENS_PER_SEQ,
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    kv_cache_budget_estimate,
    kv_cache_default_tokens,
)
from bitserve.engine.instance import plan_kv_cache, serving_limits
from bitserve.kernels.cpu.step_layers import pooled_layers
from bitserve.loader.gguf_reader import read_gguf
from bitserve.loader.model_spec import spec_from_metadata
from bitserve.runner.kv_cache import CacheLayout, allocate_kv_caches

CPU = torch.device("cpu")
# SmolLM2-135M: 30 layers x (K, V) x 3 KV heads x 64 dims x 4 bytes (f32, the CPU default)
SMOLLM2_KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4


def test_default_tokens_follow_the_batch_limit_then_the_cap_then_the_context_floor() -> None:
    small_kv = 1024  # bytes a token: the cap is far away
    assert kv_cache_default_tokens(32, 4096, small_kv) == 32 * KV_CACHE_TOKENS_PER_SEQ
    # 128 sequences of SmolLM2 KV would be 1.5 GB: the cap decides
    capped = kv_cache_default_tokens(128, 4096, SMOLLM2_KV_BYTES_PER_TOKEN)
    assert capped == KV_CACHE_DEFAULT_MAX_BYTES // SMOLLM2_KV_BYTES_PER_TOKEN > 4096
    # a 2B-4T-shaped model (30 layers, 5 KV heads of 128, f32): one 4096-token context is 600 MiB, over
    # the cap, and still fits, or every request without max_tokens would be refused
    assert kv_cache_default_tokens(128, 4096, 30 * 2 * 5 * 128 * 4) == 4096
    assert kv_cache_default_tokens(1, 8192, small_kv) == 8192  # one sequence: the context floor
    with pytest.raises(ValueError):
        kv_cache_default_tokens(1, 16, 0)


@pytest.fixture(scope="module")
def smollm2(smollm2_path: Path):  # noqa: ANN201
    with read_gguf(smollm2_path) as gguf:
        spec = spec_from_metadata(gguf.metadata, tensor_names=set(gguf.tensors), path=str(smollm2_path))
        yield spec, gguf


def test_smollm2_default_pool_and_overrides(smollm2) -> None:  # noqa: ANN001
    spec, gguf = smollm2
    config = EngineConfig()
    limits = serving_limits(config, spec, gguf, CPU)
    layout = plan_kv_cache(config, spec, limits, CPU)
    assert layout.bytes_per_token == SMOLLM2_KV_BYTES_PER_TOKEN
    wanted = kv_cache_default_tokens(limits.max_num_seqs, limits.max_model_len, layout.bytes_per_token)
    assert wanted <= layout.num_usable_tokens < wanted + layout.block_size  # whole blocks
    assert layout.num_usable_tokens >= limits.max_model_len
    assert kv_cache_budget_estimate(config) == KV_CACHE_DEFAULT_MAX_BYTES

    # fewer sequences: a smaller pool, still at least one full context
    few = dataclasses.replace(config, scheduler=SchedulerConfig(max_num_seqs=4))
    few_limits = serving_limits(few, spec, gguf, CPU)
    assert plan_kv_cache(few, spec, few_limits, CPU).num_usable_tokens == few_limits.max_model_len == 4096

    # --kv-cache-memory-bytes and --num-blocks still win
    set_bytes = dataclasses.replace(config, kv_cache_memory_bytes=128 << 20)
    assert plan_kv_cache(set_bytes, spec, limits, CPU).total_bytes <= 128 << 20
    assert kv_cache_budget_estimate(set_bytes) == 128 << 20
    set_blocks = dataclasses.replace(config, cache=CacheConfig(num_blocks=9))
    assert plan_kv_cache(set_blocks, spec, limits, CPU).num_blocks == 9
    with pytest.raises(ValueError, match="kv_cache_memory_bytes"):
        EngineConfig(kv_cache_memory_bytes=0)


def _mapping_of(address: int) -> dict[str, str]:
    """The /proc/self/smaps entry (its fields) of the mapping that holds `address`."""
    entry: dict[str, str] = {}
    found = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: start-end perms ...
            if found:
                break
            start, end = (int(part, 16) for part in head.split("-"))
            found = start <= address < end
        elif found:
            name, _, value = line.partition(":")
            entry[name] = value.strip()
    return entry


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="Linux /proc only")
def test_kv_pages_are_resident_only_once_written_and_never_huge() -> None:
    layout = CacheLayout(4000, 16, 1, 3, 64, torch.float32)  # one layer: 2 x 4000 x 12 KiB = 94 MiB
    (cache,) = allocate_kv_caches(layout)
    assert cache.shape == (2, 4000, 16, 3, 64) and not cache.any()
    before = _rss_kib(_mapping_of(cache.data_ptr()))
    cache[:, 1] = 1.0  # one block: its K and V pages (12 KiB each)
    mapping = _mapping_of(cache.data_ptr())
    assert "nh" in mapping["VmFlags"].split()  # no transparent huge pages
    # a few 4 KiB pages, not 2 x 2 MiB (the mapping may share its VMA with another cache: compare)
    assert _rss_kib(mapping) - before <= 64, mapping


def _rss_kib(mapping: dict[str, str]) -> int:
    return int(mapping["Rss"].split()[0])


def test_layers_share_one_pool_the_lean_step_reads_in_one_view() -> None:
    """pooled_layers: the per-layer caches allocate_kv_caches makes are one [L, ...] array without a copy
    (the cpu ternary decode step takes it in one argument); separate tensors are not a pool."""
    layout = CacheLayout(8, 16, 3, 2, 64, torch.float32)
    caches = allocate_kv_caches(layout)
    pool = pooled_layers(caches)
    assert pool is not None and pool.shape == (3, 2, 8, 16, 2, 64)
    caches[2][1, 5, 3] = 7.0  # a write through a layer's view is the pool's
    assert pool[2, 1, 5, 3].eq(7.0).all() and pool.count_nonzero() == 2 * 64
    assert pooled_layers([cache.clone() for cache in caches]) is None
