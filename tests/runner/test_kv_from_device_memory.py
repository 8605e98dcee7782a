"""The CUDA replica's default KV cache from its device's memory (runner/cuda_memory.py): the arithmetic
of the rule, on numbers of an H200; the profile step itself runs on the device (tests/gpu)."""

from __future__ import annotations

import pytest

from bitserve.config import CUDA_KV_REPLICA_SHARE, EngineConfig
from bitserve.errors import ModelLoadError
from bitserve.runner.cuda_memory import kv_bytes_from_memory

GIB = 2**30
TOTAL = 140 * GIB  # an H200 as torch.cuda.mem_get_info reports it
WEIGHTS = 2 * GIB
RESERVE = 1 * GIB
EVERYTHING = 10**15  # a most_useful cap that never binds


def kv_for(free: int, most_useful: int = EVERYTHING) -> int:
    """The rule on the H200's numbers, this replica's weights and reserve, at utilization 0.9."""
    return kv_bytes_from_memory(
        total=TOTAL,
        free=free,
        weight_bytes=WEIGHTS,
        reserve=RESERVE,
        utilization=0.9,
        most_useful=most_useful,
    )


def test_a_lone_replica_takes_its_share_of_the_usable_memory() -> None:
    free = TOTAL - WEIGHTS - GIB // 2  # the weights and the CUDA context are on the card
    kv = kv_for(free)
    assert kv == int(CUDA_KV_REPLICA_SHARE * (int(0.9 * TOTAL) - WEIGHTS - RESERVE))
    assert 60 * GIB < kv < 63 * GIB


def test_a_swap_beside_the_serving_version_gets_what_is_left() -> None:
    """The serving version holds its weights, KV and reserve; the next one loads beside it and gets
    the rest of the usable share, about what the first one has, never more than the card allows."""
    first = kv_for(TOTAL - WEIGHTS)
    in_use = 2 * WEIGHTS + first + RESERVE  # both versions' weights, the first's KV and activations
    second = kv_for(TOTAL - in_use)
    assert second == int(0.9 * TOTAL) - in_use - RESERVE
    assert in_use + second + RESERVE <= 0.9 * TOTAL
    assert second > 0.9 * first


def test_the_cap_of_full_context_sequences_binds_a_small_model() -> None:
    useful = 256 * 8192 * 23_040  # SmolLM2-135M: 256 sequences of 8,192 tokens, 23 KB of f16 KV a token
    kv = kv_for(TOTAL - WEIGHTS, useful)
    assert kv == useful


def test_a_full_device_is_a_clear_load_error() -> None:
    with pytest.raises(ModelLoadError, match="no device memory left for a KV cache") as caught:
        kv_for(5 * GIB)
    assert "--gpu-memory-utilization" in (caught.value.hint or "")


@pytest.mark.parametrize("value", [0.0, -0.1, 1.5])
def test_utilization_outside_its_range_is_refused(value: float) -> None:
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=value)
