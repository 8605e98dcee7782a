"""The byte-level pieces every reference decoder (kernels/reference/dequant.py, bitnet_formats.py) is
built from: table lookups that decode a byte (or code group) into its fields at once, f16 fields, the f32
tensor scale of bitnet.cpp's scale slot, and the range and byte-count checks that refuse a damaged tensor.
"""

from __future__ import annotations

import numpy as np
import torch

from bitserve.errors import InvalidModelFile
from bitserve.kernels.packed import PackedWeight

SCALE_SLOT_BYTES = (
    32  # bitnet.cpp formats end with a 32-byte slot whose first 4 bytes are the f32 tensor scale
)


def f16_to_f32(fields: torch.Tensor) -> torch.Tensor:
    """uint8 [N, 2] little-endian f16 fields -> float32 [N, 1] (exact)."""
    return fields.contiguous().view(torch.float16).float()


def lookup_fields(index: torch.Tensor, fields: np.ndarray) -> torch.Tensor:
    """uint8 / int32 [...] -> int8 [..., F]: row `index` of the table `fields` (int8 [T, F], F <= 8).

    One gather of 4- or 8-byte table items decodes a whole byte (or code group) at once; on CPU it is several
    times faster than the equivalent shift / mask / stack passes.
    """
    num_fields = fields.shape[1]
    width = 4 if num_fields <= 4 else 8
    padded = np.zeros((fields.shape[0], width), dtype=np.int8)
    padded[:, :num_fields] = fields
    table = torch.from_numpy(padded.view(np.int32 if width == 4 else np.int64).reshape(-1)).to(index.device)
    items = table.index_select(0, index.reshape(-1).to(torch.int32))
    return items.view(torch.int8).view(*index.shape, width)[..., :num_fields]


def byte_bits(shifts: tuple[int, ...], mask: int) -> np.ndarray:
    """int16 [256, len(shifts)]: (byte >> shift) & mask for every byte value."""
    return (np.arange(256, dtype=np.int16)[:, None] >> np.array(shifts, dtype=np.int16)) & mask


def pair_fields() -> np.ndarray:
    """TL pair table: byte -> [a, b] of the high-nibble pair, then of the low one; idx = 3a + b + 4.

    A nibble > 8 gives a >= 2, which the callers' range check catches.
    """
    idx = byte_bits((4, 0), 15)  # [256, (hi, lo)]
    return np.stack((idx // 3 - 1, idx % 3 - 1), axis=-1).reshape(256, 4).astype(np.int8)


def check_range(values: torch.Tensor, message: str) -> None:
    """Every decoding table (pair_fields, the decoders' own) marks an out-of-range code with a value >= 2."""
    if values.numel() and int(values.max()) > 1:
        raise InvalidModelFile(message)


def tail_scale(data: torch.Tensor, offset: int, what: str) -> torch.Tensor:
    """The f32 tensor scale stored at byte `offset`, as a 0-dim float32 tensor."""
    scale = data[offset : offset + 4].clone().view(torch.float32).reshape(())
    if not torch.isfinite(scale):
        raise InvalidModelFile(f"{what} tensor scale is {scale.item()} (not finite): wrong offsets or size")
    return scale


def expect_nbytes(weight: PackedWeight, expected: int) -> None:
    """ValueError for data that is not uint8 [nbytes]; InvalidModelFile unless it holds `expected`
    bytes (the reference decoders and kernels/cpu/mapped.py's in-place I2_S)."""
    if weight.data.dim() != 1 or weight.data.dtype != torch.uint8:
        raise ValueError(
            f"{weight.layout.name} data must be uint8 [nbytes], got {weight.data.dtype} "
            f"{tuple(weight.data.shape)}"
        )
    if weight.data.numel() != expected:
        raise InvalidModelFile(
            f"{weight.layout.name} tensor of shape {weight.shape} holds {weight.data.numel()} bytes",
            expected=f"{expected} bytes",
        )
