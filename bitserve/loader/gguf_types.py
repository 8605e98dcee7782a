"""GGML tensor types and GGUF value types: ids, names, and our own per-format size formulas.

Imports nothing from bitserve but errors. Type ids 36-39 mean different things in the bitnet.cpp
fork and in upstream ggml (docs/formats.md §1.2); `Dialect` picks the reading, `tensor_nbytes` sizes a
tensor under it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Dialect(enum.Enum):
    UPSTREAM = "upstream"
    BITNET_CPP = "bitnet.cpp"


class GGMLType(enum.IntEnum):
    """Storage types bitserve can read. Ids are the file's numbers under the dialect that names them."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    # bitnet.cpp fork numbering (only valid in the fork dialect)
    I2_S = 36
    I8_S = 37
    TL1 = 38
    TL2 = 39
    # mainline llama.cpp's 1- and 2-bit types (upstream ids; the fork's numbering stops at 39)
    Q1_0 = 41
    Q2_0 = 42
    # upstream numbering of 39 (only valid in the upstream dialect); stored under a distinct value
    # so the enum stays a bijection. Use `MXFP4_FILE_ID` for the number written in files.
    MXFP4 = 1039


MXFP4_FILE_ID = 39
# Upstream ids we recognise by name only, to say "unsupported type X" instead of "unknown id".
UPSTREAM_UNSUPPORTED_NAMES: dict[int, str] = {
    4: "Q4_2 (removed)",
    5: "Q4_3 (removed)",
    9: "Q8_1",
    16: "IQ2_XXS",
    17: "IQ2_XS",
    18: "IQ3_XXS",
    19: "IQ1_S",
    20: "IQ4_NL",
    21: "IQ3_S",
    22: "IQ2_S",
    23: "IQ4_XS",
    24: "I8",
    25: "I16",
    26: "I32",
    27: "I64",
    28: "F64",
    29: "IQ1_M",
    31: "Q4_0_4_4 (removed)",
    32: "Q4_0_4_8 (removed)",
    33: "Q4_0_8_8 (removed)",
    40: "NVFP4",
}


@dataclass(frozen=True, slots=True)
class BlockFormat:
    """Fixed block geometry: `block_size` values stored in `type_size` bytes."""

    block_size: int
    type_size: int


# Types whose size is n_values / block_size * type_size. I2_S / TL1 / TL2 are sized by formula.
BLOCK_FORMATS: dict[GGMLType, BlockFormat] = {
    GGMLType.F32: BlockFormat(1, 4),
    GGMLType.F16: BlockFormat(1, 2),
    GGMLType.BF16: BlockFormat(1, 2),
    GGMLType.Q4_0: BlockFormat(32, 18),
    GGMLType.Q4_1: BlockFormat(32, 20),
    GGMLType.Q5_0: BlockFormat(32, 22),
    GGMLType.Q5_1: BlockFormat(32, 24),
    GGMLType.Q8_0: BlockFormat(32, 34),
    GGMLType.Q2_K: BlockFormat(256, 84),
    GGMLType.Q3_K: BlockFormat(256, 110),
    GGMLType.Q4_K: BlockFormat(256, 144),
    GGMLType.Q5_K: BlockFormat(256, 176),
    GGMLType.Q6_K: BlockFormat(256, 210),
    GGMLType.Q8_K: BlockFormat(256, 292),
    GGMLType.TQ1_0: BlockFormat(256, 54),
    GGMLType.TQ2_0: BlockFormat(256, 66),
    GGMLType.MXFP4: BlockFormat(32, 17),
    GGMLType.Q1_0: BlockFormat(128, 18),
    GGMLType.Q2_0: BlockFormat(64, 18),
}

TERNARY_TYPES = frozenset({GGMLType.TQ1_0, GGMLType.TQ2_0, GGMLType.I2_S, GGMLType.TL1, GGMLType.TL2})
# bitnet.cpp's formats that carry one f32 tensor scale in a trailing 32-byte slot.
SCALE_SLOT_BYTES = 32


def resolve_type(type_id: int, dialect: Dialect) -> GGMLType:
    """Map a file's type number to a GGMLType under `dialect`; raise ValueError with a readable name."""
    if type_id == MXFP4_FILE_ID:
        return GGMLType.TL2 if dialect is Dialect.BITNET_CPP else GGMLType.MXFP4
    if type_id in (GGMLType.I2_S, GGMLType.I8_S, GGMLType.TL1):
        if dialect is Dialect.BITNET_CPP:
            return GGMLType(type_id)
        raise ValueError(f"type {type_id} is reserved in upstream GGUF (bitnet.cpp-only type)")
    try:
        return GGMLType(type_id)
    except ValueError:
        name = UPSTREAM_UNSUPPORTED_NAMES.get(type_id)
        if name is not None:
            raise ValueError(f"unsupported tensor type {name} (id {type_id})") from None
        raise ValueError(f"unknown tensor type id {type_id}") from None


def tl2_data_bytes(num_rows: int, num_cols: int) -> int:
    """S_TL2 from bitnet.cpp (docs/formats.md §2.3): a deliberate over-estimate of the used bytes."""
    return ((num_cols - 256) * num_rows // 3) * 5 // 8 + (256 * num_rows // 2) * 4 // 8


def pad_to(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def tensor_nbytes(ggml_type: GGMLType, shape: tuple[int, ...]) -> int:
    """Bytes a tensor occupies in the data section. `shape` is in ggml order (ne[0] innermost).

    Raises ValueError when the shape does not fit the format's block geometry.
    """
    num_values = 1
    for dim in shape:
        num_values *= dim
    if ggml_type is GGMLType.I8_S:
        raise ValueError("I8_S is an activation type and never valid in a file")
    if ggml_type in (GGMLType.I2_S, GGMLType.TL1, GGMLType.TL2):
        if len(shape) != 2:
            raise ValueError(f"{ggml_type.name} tensors must be 2-D matrices, got {len(shape)}-D")
        num_cols, num_rows = shape
        if ggml_type is GGMLType.TL2:
            return pad_to(tl2_data_bytes(num_rows, num_cols), 32) + SCALE_SLOT_BYTES
        if num_values % 4:
            raise ValueError(f"{ggml_type.name} needs a multiple of 4 values, got {num_values}")
        return num_values // 4 + SCALE_SLOT_BYTES
    fmt = BLOCK_FORMATS[ggml_type]
    if shape and shape[0] % fmt.block_size:
        raise ValueError(f"{ggml_type.name} needs ne[0] to be a multiple of {fmt.block_size}, got {shape[0]}")
    return num_values // fmt.block_size * fmt.type_size


class GGUFValueType(enum.IntEnum):
    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


# struct format and byte width of each scalar value type
SCALAR_FORMATS: dict[GGUFValueType, tuple[str, int]] = {
    GGUFValueType.UINT8: ("<B", 1),
    GGUFValueType.INT8: ("<b", 1),
    GGUFValueType.UINT16: ("<H", 2),
    GGUFValueType.INT16: ("<h", 2),
    GGUFValueType.UINT32: ("<I", 4),
    GGUFValueType.INT32: ("<i", 4),
    GGUFValueType.FLOAT32: ("<f", 4),
    GGUFValueType.BOOL: ("<?", 1),
    GGUFValueType.UINT64: ("<Q", 8),
    GGUFValueType.INT64: ("<q", 8),
    GGUFValueType.FLOAT64: ("<d", 8),
}
