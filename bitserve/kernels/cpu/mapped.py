"""Ternary weights read in place from the mapped GGUF file: no anonymous copy, nothing repacked at load.

The cpu kernels' runtime layout (Layout.TERNARY_2BIT, kernels/cpu/ternary.py) is I2_S variant A's bytes
(bitnet.cpp's x86 packing) row by row, so such a tensor's rows are a view of the file mapping and its
per-tensor scale is read from the 4 bytes after them. Every other ternary format is unpacked and repacked
at load because its bytes are not in that layout: TQ2_0 holds the same 2-bit fields with the planes'
shifts reversed (2s, not 6 - 2s) and an f16 d after every 256 columns (66-byte blocks, so a row is not
one run of codes), TQ1_0 stores base-3 digits (5 per byte), TL1 / TL2 store lookup indices of weight
pairs / triples in tiles, and I2_S variants B (64-value blocks) and C (4-row interleave) place their
fields differently; llamacpp-tq mode reads even I2_S in ggml's lane order, so it repacks too.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from numba import njit, prange

from bitserve.errors import InvalidModelFile
from bitserve.kernels.packed import Layout, PackedWeight
from bitserve.kernels.reference.dequant import (
    SCALE_SLOT_BYTES,
    expect_nbytes,
    i2s_code_three_error,
    i2s_geometry_error,
    i2s_scale,
)

# a byte holds code 3 in some field iff a field has both bits set: bit 2f + 1 and bit 2f
_LOW_BITS = np.uint64(0x5555555555555555)


def is_in_kernel_layout(weight: PackedWeight) -> bool:
    """True for a file weight whose bytes are already the kernels' layout (I2_S variant A)."""
    return weight.layout is Layout.I2_S and weight.params.get("i2s_variant", "A") == "A"


def i2s_rows(weight: PackedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """An I2_S variant-A weight -> (rows uint8 [M, K / 4], a view of weight.data; its f32 scale).

    Checks what the reference decoder checks (byte count, no code 3, a finite scale), reading every
    byte once: InvalidModelFile otherwise.
    """
    num_rows, num_cols = weight.shape
    problem = i2s_geometry_error("A", num_rows, num_cols)
    if problem or weight.data.dim() != 1 or weight.data.dtype != torch.uint8:
        reason = problem or "data is not uint8 [nbytes]"
        raise InvalidModelFile(f"not an I2_S variant A tensor of shape {weight.shape}: {reason}")
    code_bytes = num_rows * num_cols // 4
    expect_nbytes(weight, code_bytes + SCALE_SLOT_BYTES)
    rows = weight.data[:code_bytes].view(num_rows, num_cols // 4)
    if count_code_three(rows.numpy().reshape(-1).view(np.uint64)):  # K % 128 == 0: whole 8-byte words
        raise i2s_code_three_error()
    return rows, i2s_scale(weight)


@njit(parallel=True, nogil=True, cache=True)
def count_code_three(words: np.ndarray) -> int:
    """Number of 8-byte words (uint64 [n]) holding a 2-bit field equal to 3."""
    total = 0
    for i in prange(words.size):
        w = words[i]
        if w & (w >> np.uint64(1)) & _LOW_BITS:
            total += 1
    return total


def shared_span(parts: Sequence[torch.Tensor]) -> tuple[torch.Tensor, np.ndarray] | None:
    """Rows of several weights (uint8 [M_i, row_bytes], C order) as one buffer without a copy, when they
    are views of one storage (tensors of one mapped file): (uint8 [n] view from the first part's start to
    the last part's end, byte offset of every row int64 [sum M_i]). None when they are not."""
    storage = parts[0].untyped_storage()
    if any(p.untyped_storage().data_ptr() != storage.data_ptr() or not p.is_contiguous() for p in parts):
        return None
    start = min(p.storage_offset() for p in parts)
    end = max(p.storage_offset() + p.numel() for p in parts)
    span = torch.as_strided(parts[0], (end - start,), (1,), start)
    offsets = [
        (p.storage_offset() - start) + np.arange(p.shape[0], dtype=np.int64) * p.shape[1] for p in parts
    ]
    return span, np.concatenate(offsets)
