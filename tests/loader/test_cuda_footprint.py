"""The device-memory estimate of `--device auto` (loader/cuda_footprint.py, engine/devices.py): weights as
CudaBackend lays them out, from the file's tensor table, so a Q4 model is not placed on a GPU by its file
size."""

from __future__ import annotations

from pathlib import Path

from bitserve.config import EngineConfig, ModelConfig, kv_cache_budget_estimate
from bitserve.engine.devices import estimated_device_bytes
from bitserve.loader.cuda_footprint import cuda_weight_bytes
from bitserve.loader.gguf_reader import TensorInfo, read_gguf
from bitserve.loader.gguf_types import GGMLType

K, M = 576, 1536
VALUES = K * M


def _tensor(name: str, ggml_type: GGMLType, shape: tuple[int, ...], nbytes: int = 0) -> TensorInfo:
    return TensorInfo(name, shape, int(ggml_type), ggml_type, 0, 0, nbytes)


def test_each_layout_counts_what_the_cuda_backend_keeps() -> None:
    q4 = _tensor("blk.0.ffn_up.weight", GGMLType.Q4_1, (K, M))
    q8 = _tensor("blk.0.ffn_up.weight", GGMLType.Q8_0, (K, M))
    i2s = _tensor("blk.0.ffn_up.weight", GGMLType.I2_S, (K, M))
    f16 = _tensor("blk.0.ffn_up.weight", GGMLType.F16, (K, M), nbytes=2 * VALUES)
    norm = _tensor("blk.0.attn_norm.weight", GGMLType.F32, (K,), nbytes=4 * K)
    assert cuda_weight_bytes([q4]) == int(VALUES * 0.75) + 4 * VALUES  # packed blocks + the f32 copy
    assert cuda_weight_bytes([q8]) == int(VALUES * 1.125) + 4 * VALUES
    assert cuda_weight_bytes([i2s]) == VALUES // 4 + 4 * M  # 2-bit planes + a row scale
    assert cuda_weight_bytes([f16]) == 4 * VALUES  # a float projection runs as f32
    assert cuda_weight_bytes([norm]) == 4 * K


def test_the_token_table_and_the_head() -> None:
    table_q8 = _tensor("token_embd.weight", GGMLType.Q8_0, (K, M))
    table_f16 = _tensor("token_embd.weight", GGMLType.F16, (K, M), nbytes=2 * VALUES)
    head_f16 = _tensor("output.weight", GGMLType.F16, (K, M), nbytes=2 * VALUES)
    # tied Q8_0 table (SmolLM2): an f32 lookup table, and the head's block weight beside it
    assert cuda_weight_bytes([table_q8]) == 4 * VALUES + int(VALUES * 1.125) + 4 * VALUES
    # tied F16 table (2B-4T): one half-precision copy serves both; SmolLM2's width (576) is not one the
    # greedy head takes (a multiple of 128), so no int8 copy of the head
    assert cuda_weight_bytes([table_f16]) == 2 * VALUES
    assert cuda_weight_bytes([table_f16, head_f16]) == 4 * VALUES
    # at a width it takes (ggml shape (256, M): M rows of 256), the greedy head's int8 copy, row scales and
    # the scratch of its two passes at up to 2 rows a launch (an f32 logit and an int32 slot per row)
    wide, values = 256, 256 * M
    greedy_head = values + 4 * M + 2 * (4 + 4) * M
    table = _tensor("token_embd.weight", GGMLType.F16, (wide, M), nbytes=2 * values)
    assert cuda_weight_bytes([table]) == 2 * values + greedy_head
    # a Q6_K head (the K-quant mixes') is a block weight in the Q6_K form (1.25 bytes a value) with its
    # f32 copy, and no greedy copy; an F32 head is a float matrix and gets it
    head_q6k = _tensor("output.weight", GGMLType.Q6_K, (wide, M))
    assert cuda_weight_bytes([table, head_q6k]) == 2 * values + int(1.25 * values) + 4 * values
    head_f32 = _tensor("output.weight", GGMLType.F32, (wide, M), nbytes=4 * values)
    assert cuda_weight_bytes([table, head_f32]) == 2 * values + 4 * values + greedy_head


def test_a_q4_file_is_estimated_at_several_times_its_size(smollm2_path: Path) -> None:
    """SmolLM2-135M Q4_1 (98 MB): ~0.76 GB of weights on the device (1.15 GB measured allocated after load
    on an H100 with the graphs' pools, RESULTS.md), not its file size."""
    config = EngineConfig(model=ModelConfig(model=str(smollm2_path)))
    weights = estimated_device_bytes(smollm2_path, config) - kv_cache_budget_estimate(config)
    with read_gguf(smollm2_path) as gguf:
        assert weights == cuda_weight_bytes(gguf.tensors.values())
    assert 7 * smollm2_path.stat().st_size < weights < 9 * smollm2_path.stat().st_size


def test_a_ternary_file_is_estimated_at_about_its_size(b158_file: Path) -> None:
    config = EngineConfig(model=ModelConfig(model=str(b158_file)))
    weights = estimated_device_bytes(b158_file, config) - kv_cache_budget_estimate(config)
    assert weights < 1.5 * b158_file.stat().st_size


def test_a_file_that_does_not_parse_counts_at_its_size(tmp_path: Path) -> None:
    path = tmp_path / "not.gguf"
    path.write_bytes(b"not a gguf file at all")
    config = EngineConfig(model=ModelConfig(model=str(path)))
    assert estimated_device_bytes(path, config) == path.stat().st_size + kv_cache_budget_estimate(config)
