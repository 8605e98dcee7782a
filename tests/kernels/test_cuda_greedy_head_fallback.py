"""The CUDA decoder's greedy head is an optional speed-up: where the device has no memory left for its
int8 copy, the model still loads and greedy steps run the full head (kernels/cuda/decoder._greedy_head).
CPU only: the copy is built on CPU tensors here, and an allocation failure is raised by a stand-in."""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("triton", reason="the CUDA decoder imports the Triton kernels")

from bitserve.kernels.cuda import decoder as cuda_decoder  # noqa: E402


def _f16_head(rows: int = 1024, hidden: int = 256) -> torch.Tensor:
    return (torch.randn(rows, hidden, generator=torch.Generator().manual_seed(0)) * 0.05).half()


def test_a_head_it_takes_gets_its_int8_copy() -> None:
    head = cuda_decoder._greedy_head(_f16_head())
    assert head is not None and head.quantized.dtype == torch.int8 and head.quantized.shape == (1024, 256)


def test_no_memory_for_the_copy_loads_without_it(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def out_of_memory(weight: torch.Tensor) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 328.00 MiB")

    monkeypatch.setattr(cuda_decoder, "GreedyHead", out_of_memory)
    with caplog.at_level(logging.WARNING, logger=cuda_decoder.__name__):
        assert cuda_decoder._greedy_head(_f16_head()) is None
    assert "no device memory for the greedy head" in caplog.text
    assert "cuda_greedy_head" in caplog.text


def test_widths_it_does_not_take_make_no_copy() -> None:
    assert cuda_decoder._greedy_head(_f16_head(hidden=576)) is None  # SmolLM2's width: not a multiple of 128
