"""Ternary weights read in place from the mapped GGUF file: no anonymous copy, nothing repacked at load.

The cpu kernels' runtime layout (Layout.TERNARY_2BIT, kernels/cpu/ternary.py) is I2_S variant A's bytes
(bitnet.cpp's x86 packing) row by row, so such a tensor's rows are a view of the file mapping and its
per-tensor scale is read from the 4 bytes after them. TQ2_0 holds the same 2-bit fields with the planes'
shifts reversed (2s, not 6 - 2s) and an f16 d after every 256 columns (66-byte blocks, so a row is not
one run of codes): with one live d it is transcoded byte for byte into new rows (`tq2_0_rows`, the speed
of a copy), with several it is unpacked. Every other ternary format is unpacked and repacked at load
because its bytes are not in that layout: TQ1_0 stores base-3 digits (5 per byte), TL1 / TL2 store
lookup indices of weight pairs / triples in tiles, and I2_S variants B (64-value blocks) and C (4-row
interleave) place their fields differently; llamacpp-tq mode reads even I2_S in ggml's lane order, so it
repacks too.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from numba import njit, prange

from bitserve.errors import InvalidModelFile
from bitserve.kernels.packed import Layout, PackedWeight
from bitserve.kernels.reference.dequant import (
    BLOCK_GEOMETRY,
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


def kernel_rows(weight: PackedWeight) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows uint8 [M, K / 4] in the kernels' layout, the f32 scale) of a weight that has them without an
    unpack: I2_S variant A in place, TQ2_0 with one live d transcoded byte for byte. None otherwise."""
    if is_in_kernel_layout(weight):
        return i2s_rows(weight)
    if weight.layout is Layout.TQ2_0:
        return tq2_0_rows(weight)
    return None


def tq2_0_rows(weight: PackedWeight) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A TQ2_0 weight whose blocks holding a nonzero value share one d (a BitNet model's, as the unpack
    path's collapse finds it) -> (I2_S variant A rows uint8 [M, K / 4], a new array; d as f32), at the
    speed of a copy: each 256-value block's 64 code bytes are its two 128-value I2_S groups with every
    byte's four 2-bit fields in reverse order (TQ2_0 puts element 32l + m of a group at shift 2l, I2_S at
    6 - 2l), and both store code - 1. None when the live d differ or a block with d = 0 holds nonzero
    codes (the unpack path handles those); InvalidModelFile for code 3, as the reference decoder."""
    num_rows, num_cols = weight.shape
    block, type_size = BLOCK_GEOMETRY[Layout.TQ2_0]
    if num_cols % block:
        return None
    expect_nbytes(weight, num_rows * num_cols // block * type_size)
    blocks = weight.data.numpy().reshape(num_rows, num_cols // block, type_size)
    rows = np.empty((num_rows, num_cols // 4), dtype=np.uint8)
    row_d = np.empty(num_rows, dtype=np.int32)  # each row's first live d (f16 bits), -1 if none
    row_bad = np.zeros(num_rows, dtype=np.int32)  # blocks against that d, or dead blocks with codes
    num_code_three = _transcode_tq2_0(blocks, rows, row_d, row_bad, _REVERSED_FIELDS)
    if num_code_three:
        raise InvalidModelFile("TQ2_0 code 3 is not ternary (ggml would read it as +2)")
    live = row_d[row_d >= 0]
    if row_bad.any() or (live.size and (live != live[0]).any()):
        return None
    d_bits = np.array([live[0] if live.size else 0], dtype=np.uint16)
    return torch.from_numpy(rows), torch.tensor(float(d_bits.view(np.float16)[0]), dtype=torch.float32)


# byte -> the byte with its four 2-bit fields in reverse order (field l moves to field 3 - l)
_REVERSED_FIELDS = np.array(
    [sum(((b >> (2 * f)) & 3) << (2 * (3 - f)) for f in range(4)) for b in range(256)], dtype=np.uint8
)
_ZERO_CODES = 0x55  # four fields of code 1: value 0


@njit(parallel=True, nogil=True, cache=True)
def _transcode_tq2_0(
    blocks: np.ndarray, rows: np.ndarray, row_d: np.ndarray, row_bad: np.ndarray, table: np.ndarray
) -> int:
    """TQ2_0 blocks uint8 [M, nb, 66] -> I2_S-A rows uint8 [M, nb * 64]; per row its first live d's f16
    bits (row_d, -1 if none) and the blocks that disagree with it or hold codes under d = 0 (row_bad).
    Returns the number of rows holding a code 3."""
    num_rows, num_blocks = blocks.shape[0], blocks.shape[1]
    num_code_three = 0
    for r in prange(num_rows):
        first_d, bad, three = -1, 0, 0
        for b in range(num_blocks):
            has_codes = False
            for j in range(64):
                byte = blocks[r, b, j]
                rows[r, b * 64 + j] = table[byte]
                has_codes |= byte != _ZERO_CODES
                three |= byte & (byte >> 1) & 0x55
            d_bits = np.int32(blocks[r, b, 64]) | (np.int32(blocks[r, b, 65]) << 8)
            if has_codes:
                if d_bits & 0x7FFF == 0:
                    bad += 1
                elif first_d < 0:
                    first_d = d_bits
                elif d_bits != first_d:
                    bad += 1
        row_d[r] = first_d
        row_bad[r] = bad
        num_code_three += 1 if three else 0
    return num_code_three


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
