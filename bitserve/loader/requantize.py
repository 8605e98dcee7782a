"""Weights re-quantized at load: an F16 / BF16 / F32 LM head as Q8_0 (`--lm-head q8_0`).

A 2B-4T model's F16 head is 657 MB of the 1.18 GB a CPU decode step reads; as Q8_0 (34 bytes per 32
values) it is 349 MB, run by the cpu backend's int8 kernels (kernels/cpu/blockdot.py). The quantization is
ggml's quantize_row_q8_0 reference (gguf-py's too): per 32 values d = amax / 127 stored as F16,
q = roundf(x / d) computed as x * (1 / d) with the f32 d. Its quality cost is measured in
benchmarks/RESULTS.md (logit cosine and greedy agreement against the float head).
"""

from __future__ import annotations

import torch

from bitserve.errors import UnsupportedModel
from bitserve.kernels.packed import Layout, PackedWeight

QK8_0 = 32
ROWS_PER_CHUNK = 2048  # f32 rows converted at a time: a 128256 x 2560 head never exists in f32 at once
_FLOAT_DTYPES = {Layout.F32: torch.float32, Layout.F16: torch.float16, Layout.BF16: torch.bfloat16}


def quantize_q8_0(weight: PackedWeight) -> PackedWeight:
    """A float file weight [M, K] (K a multiple of 32) -> the same weight as Q8_0 blocks, uint8
    [M * K / 32 * 34]."""
    dtype = _FLOAT_DTYPES.get(weight.layout)
    num_rows, num_cols = weight.shape
    if dtype is None or num_cols % QK8_0:
        raise UnsupportedModel(
            f"cannot re-quantize a {weight.layout.name} weight of shape {weight.shape} to Q8_0",
            hint="Q8_0 needs a float weight whose rows are a multiple of 32 values",
        )
    values = weight.data.view(dtype).reshape(num_rows, num_cols)
    num_blocks = num_cols // QK8_0
    out = torch.empty(num_rows, num_blocks, QK8_0 + 2, dtype=torch.uint8)
    for start in range(0, num_rows, ROWS_PER_CHUNK):
        rows = values[start : start + ROWS_PER_CHUNK].float().reshape(-1, num_blocks, QK8_0)
        scale, codes = _quantize_blocks(rows)
        chunk = out[start : start + ROWS_PER_CHUNK]
        chunk[:, :, :2] = scale.to(torch.float16).unsqueeze(-1).view(torch.uint8)
        chunk[:, :, 2:] = codes.view(torch.uint8)
    return PackedWeight(out.reshape(-1), weight.shape, Layout.Q8_0, "Q8_0")


def _quantize_blocks(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """f32 [rows, nb, 32] -> (d f32 [rows, nb], q int8 [rows, nb, 32]) as ggml's reference rounds them."""
    d = blocks.abs().amax(dim=-1) / 127.0
    inverse = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    scaled = blocks * inverse.unsqueeze(-1)
    codes = torch.sign(scaled) * torch.floor(scaled.abs() + 0.5)  # roundf: half away from zero
    return d, codes.to(torch.int8)
