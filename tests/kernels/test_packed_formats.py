"""I2_S, TQ1_0/TQ2_0 and the dense GGML types: docs/formats.md §6.1 fixtures, producer round trips,
bitwise parity with gguf-py."""

from __future__ import annotations

import struct
import warnings

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType

from bitserve.errors import InvalidModelFile, UnsupportedModel
from bitserve.kernels.packed import Layout, PackedWeight
from bitserve.kernels.reference.dequant import dense_rows, dequantize, unpack_ternary
from bitserve.loader.decode import DecodeOptions, make_packed_weight, matrix_shape
from bitserve.loader.gguf_reader import TensorInfo
from bitserve.loader.gguf_types import GGMLType, tensor_nbytes
from bitserve.loader.ternary_pack import quantize_i2s


def _load(
    ggml_type: GGMLType, data: bytes | np.ndarray, ggml_shape: tuple[int, ...], **options: str
) -> PackedWeight:
    raw = np.frombuffer(bytes(data), dtype=np.uint8)  # read-only, like the reader's mmap views
    info = TensorInfo(
        name="t",
        shape=ggml_shape,
        type_id=int(ggml_type),
        ggml_type=ggml_type,
        offset=0,
        file_offset=0,
        nbytes=tensor_nbytes(ggml_type, ggml_shape),
    )
    return make_packed_weight(info, raw, options=DecodeOptions(**options))


def _bits(values: torch.Tensor | np.ndarray) -> np.ndarray:
    """float32 -> its bit patterns, so comparisons are bitwise (-0.0 != 0.0, NaN payloads count)."""
    array = values.numpy() if isinstance(values, torch.Tensor) else values
    return np.ascontiguousarray(array, dtype=np.float32).view(np.int32)


def _assert_matches_gguf(weight: PackedWeight, data: np.ndarray, qtype: QType) -> None:
    with np.errstate(all="ignore"):
        expected = gguf.quants.dequantize(data, qtype).reshape(weight.shape)
    np.testing.assert_array_equal(_bits(dequantize(weight)), _bits(expected))


# ------------------------------------------------------------------------------------------------ I2_S
def _i2s_literal(first_bytes: list[int], num_values: int, scale: float) -> bytes:
    codes = bytes(first_bytes) + bytes([0x55]) * (num_values // 4 - len(first_bytes))  # 0x55: four zeros
    return codes + struct.pack("<f", scale) + bytes(28)


def test_i2s_variant_a_worked_byte_0x86() -> None:
    weights = np.zeros((1, 128), dtype=np.float32)
    weights[0, [0, 32, 96]] = [0.5, -0.5, 0.5]  # codes 2, 0, (w[64] = 0) 1, 2
    packed = quantize_i2s(weights, "A")
    assert packed[0] == 0x86 and len(packed) == 128 // 4 + 32
    assert struct.unpack_from("<f", packed, 32)[0] == 0.5
    codes = unpack_ternary(_load(GGMLType.I2_S, _i2s_literal([0x86], 128, 0.5), (128, 1)))
    expected = np.zeros((1, 128), dtype=np.int8)
    expected[0, [0, 32, 64, 96]] = [1, -1, 0, 1]
    np.testing.assert_array_equal(codes.values.numpy(), expected)
    assert codes.is_per_tensor and codes.scale.item() == 0.5


@pytest.mark.parametrize(
    ("variant", "shape"),
    [("A", (6, 256)), ("A", (7, 384)), ("B", (5, 64)), ("B", (8, 192)), ("C", (4, 7)), ("C", (12, 130))],
)
def test_i2s_round_trip(variant: str, shape: tuple[int, int]) -> None:
    rng = np.random.default_rng(shape[0] * 1000 + shape[1])
    values = rng.integers(-1, 2, size=shape).astype(np.int8)
    scale = np.float32(0.0123)
    packed = quantize_i2s(values * scale, variant)
    weight = _load(GGMLType.I2_S, packed, shape[::-1], i2s_variant=variant)
    assert weight.params == {"i2s_variant": variant} and weight.shape == shape
    codes = unpack_ternary(weight)
    np.testing.assert_array_equal(codes.values.numpy(), values)
    assert codes.scale.dtype == torch.float32 and codes.scale.item() == scale
    assert torch.equal(dequantize(weight), torch.from_numpy(values).float() * scale)
    row_ids = torch.tensor([shape[0] - 1, 0, 2])
    assert torch.equal(dense_rows(weight, row_ids), dequantize(weight)[row_ids])


def test_i2s_variants_are_distinct_layouts() -> None:
    values = np.random.default_rng(0).integers(-1, 2, size=(4, 128)).astype(np.float32)
    packed = quantize_i2s(values, "A")
    assert packed != quantize_i2s(values, "B")
    misread = unpack_ternary(_load(GGMLType.I2_S, packed, (128, 4), i2s_variant="B")).values.numpy()
    assert not np.array_equal(misread, values)


def test_i2s_code_3_is_rejected() -> None:
    weight = _load(GGMLType.I2_S, _i2s_literal([0x55, 0x57], 256, 1.0), (256, 1))
    with pytest.raises(InvalidModelFile, match="I2_S code 3: wrong packing or offsets"):
        unpack_ternary(weight)
    with pytest.raises(InvalidModelFile, match="I2_S code 3"):
        dense_rows(weight, torch.tensor([0]))


def test_i2s_shape_rules_per_variant() -> None:
    data = bytes(4 * 96 // 4 + 32)
    with pytest.raises(InvalidModelFile, match="K % 128"):
        _load(GGMLType.I2_S, data, (96, 4), i2s_variant="A")
    _load(GGMLType.I2_S, data, (96, 4), i2s_variant="C")
    with pytest.raises(ValueError, match="M % 4"):
        quantize_i2s(np.zeros((3, 128)), "C")


# ------------------------------------------------------------------------------------------ TQ1_0 / TQ2_0
def test_tq2_0_worked_byte_0x92() -> None:
    block = np.zeros((1, 256), dtype=np.float32)
    block[0, [0, 32, 96]] = [1.0, -1.0, 1.0]
    quantized = gguf.quants.quantize(block, QType.TQ2_0).reshape(-1)
    assert quantized[0] == 0x92 and bytes(quantized[64:66]) == b"\x00\x3c"
    literal = bytes([0x92]) + bytes([0x55]) * 63 + b"\x00\x3c"
    values = dequantize(_load(GGMLType.TQ2_0, literal, (256, 1)))
    expected = np.zeros((1, 256), dtype=np.float32)
    expected[0, [0, 32, 96]] = [1.0, -1.0, 1.0]
    np.testing.assert_array_equal(_bits(values), _bits(expected))


def _tq1_byte(trits: tuple[int, ...]) -> int:
    """docs/formats.md §2.4: v = sum d_i 3^(4-i) over 5 trits (qh: 4 and an implicit 0),
    q = ceil(v*256/243)."""
    padded = tuple(trits) + (0,) * (5 - len(trits))
    value = sum(d * 3 ** (4 - i) for i, d in enumerate(padded))
    return (value * 256 + 242) // 243


def test_tq1_0_worked_bytes_188_and_212() -> None:
    assert _tq1_byte((2, 0, 1, 2, 1)) == 188 and _tq1_byte((2, 1, 1, 1)) == 212
    zero_qs, zero_qh = _tq1_byte((1,) * 5), _tq1_byte((1,) * 4)
    literal = bytes([188] + [zero_qs] * 47 + [212] + [zero_qh] * 3) + b"\x00\x3c"
    values = unpack_ternary(_load(GGMLType.TQ1_0, literal, (256, 1)))
    expected = np.zeros((1, 256), dtype=np.int8)
    expected[0, [0, 32, 64, 96, 128]] = [1, -1, 0, 1, 0]  # qs[0]: elements 32n
    expected[0, [240, 244, 248, 252]] = [1, 0, 0, 0]  # qh[0]: elements 240 + 4n
    np.testing.assert_array_equal(values.values.numpy(), expected)
    assert values.scale.item() == 1.0


def _tq_matrix(rng: np.random.Generator, block_scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Ternary codes [M, K] and weights codes x per-block f16 scales [M, K/256] (0 -> all-zero block)."""
    num_rows, num_blocks = block_scales.shape
    codes = rng.integers(-1, 2, size=(num_rows, num_blocks * 256)).astype(np.int8)
    codes.reshape(num_rows, num_blocks, 256)[block_scales == 0] = 0  # the rest hold a +-1: d = max|x| = scale
    scales = np.repeat(block_scales.astype(np.float16).astype(np.float32), 256, axis=1)
    return codes, codes * scales


@pytest.mark.parametrize("qtype", [QType.TQ1_0, QType.TQ2_0], ids=lambda qtype: qtype.name)
def test_tq_shared_scale_is_scalar(qtype: QType) -> None:
    rng = np.random.default_rng(int(qtype))
    block_scales = np.full((8, 3), 0.0625)
    block_scales[2, 1] = 0.0  # an all-zero block (d = 0) does not break the shared scale
    codes, weights = _tq_matrix(rng, block_scales)
    data = gguf.quants.quantize(weights, qtype)
    weight = _load(GGMLType[qtype.name], data, (768, 8))
    unpacked = unpack_ternary(weight)
    np.testing.assert_array_equal(unpacked.values.numpy(), codes)
    assert unpacked.is_per_tensor and unpacked.scale.item() == 0.0625
    _assert_matches_gguf(weight, data, qtype)


@pytest.mark.parametrize("qtype", [QType.TQ1_0, QType.TQ2_0], ids=lambda qtype: qtype.name)
def test_tq_differing_scales_are_per_block(qtype: QType) -> None:
    rng = np.random.default_rng(int(qtype) + 1)
    block_scales = rng.uniform(0.01, 2.0, size=(6, 4))
    block_scales[0, 0] = block_scales[5, 3] = 0.0
    codes, weights = _tq_matrix(rng, block_scales)
    data = gguf.quants.quantize(weights, qtype)
    weight = _load(GGMLType[qtype.name], data, (1024, 6))
    unpacked = unpack_ternary(weight)
    np.testing.assert_array_equal(unpacked.values.numpy(), codes)
    assert unpacked.scale.shape == (6, 4)
    np.testing.assert_array_equal(unpacked.scale.numpy(), block_scales.astype(np.float16).astype(np.float32))
    _assert_matches_gguf(weight, data, qtype)
    expanded = unpacked.values.float() * unpacked.scale.repeat_interleave(256, dim=1)
    assert torch.equal(expanded, dequantize(weight))


def test_tq_block_with_zero_scale_unpacks_to_zeros() -> None:
    block = bytes([0x92] * 64) + b"\x00\x00"  # non-zero codes, d = 0
    unpacked = unpack_ternary(_load(GGMLType.TQ2_0, block, (256, 1)))
    assert not unpacked.values.any() and unpacked.scale.item() == 0.0


def test_tq2_0_code_3_is_not_ternary() -> None:
    block = bytes([0x57]) + bytes([0x55]) * 63 + b"\x00\x3c"
    weight = _load(GGMLType.TQ2_0, block, (256, 1))
    with pytest.raises(InvalidModelFile, match="TQ2_0 code 3"):
        unpack_ternary(weight)
    assert dequantize(weight)[0, 0].item() == 2.0  # dequantize reads it as ggml does


# ------------------------------------------------------------------------------------------ dense types
def _with_sane_f16(raw: np.ndarray, offsets: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random blocks whose f16 scale fields hold finite values of a realistic size."""
    for offset in offsets:
        scales = rng.normal(0.0, 0.02, size=raw.shape[0]).astype(np.float16)
        raw[:, offset : offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return raw


@pytest.mark.parametrize(
    "qtype",
    [QType.Q8_0, QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.F16, QType.BF16, QType.F32],
    ids=lambda qtype: qtype.name,
)
def test_quantized_by_gguf_matches_gguf_dequantize(qtype: QType) -> None:
    rng = np.random.default_rng(int(qtype))
    weights = rng.normal(0.0, 1.0, size=(48, 512)).astype(np.float32)
    weights[0, :4] = [0.0, -0.0, 1e-8, -65504.0]
    data = gguf.quants.quantize(weights, qtype)
    weight = _load(GGMLType[qtype.name], data.view(np.uint8), (512, 48))
    assert weight.layout is Layout[qtype.name] and weight.source_type == qtype.name
    _assert_matches_gguf(weight, data.view(np.uint8).reshape(48, -1), qtype)


@pytest.mark.parametrize(
    ("qtype", "scale_offsets"),
    [
        (QType.Q4_K, (0, 2)),
        (QType.Q6_K, (208,)),
        (QType.Q8_0, (0,)),
        (QType.Q4_0, (0,)),
        (QType.Q4_1, (0, 2)),
        (QType.Q5_0, (0,)),
        (QType.Q5_1, (0, 2)),
        (QType.Q2_K, (80, 82)),
        (QType.Q3_K, (108,)),
        (QType.Q5_K, (0, 2)),
    ],
    ids=["Q4_K", "Q6_K", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q5_K"],
)
def test_random_blocks_match_gguf_dequantize(qtype: QType, scale_offsets: tuple[int, ...]) -> None:
    rng = np.random.default_rng(100 + int(qtype))
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    num_rows, num_cols = 24, 4 * 256
    raw = rng.integers(0, 256, size=(num_rows * num_cols // block_size, type_size), dtype=np.uint8)
    raw = _with_sane_f16(raw, scale_offsets, rng).reshape(num_rows, -1)
    weight = _load(GGMLType[qtype.name], raw, (num_cols, num_rows))
    _assert_matches_gguf(weight, raw, qtype)
    row_ids = torch.tensor([23, 0, 5, 5])
    assert torch.equal(dense_rows(weight, row_ids), dequantize(weight)[row_ids])


def test_f16_and_bf16_special_values_bitwise() -> None:
    patterns = np.array([0x0000, 0x8000, 0x0001, 0x7BFF, 0x7C00, 0xFC00, 0x7E00, 0x3C00], dtype=np.uint16)
    for qtype in (QType.F16, QType.BF16):
        weight = _load(GGMLType[qtype.name], patterns.view(np.uint8), (8,))
        assert weight.shape == (1, 8)
        _assert_matches_gguf(weight, patterns.view(np.uint8).reshape(1, -1), qtype)


# ------------------------------------------------------------------------------------- make_packed_weight
def test_make_packed_weight_wraps_without_copying_or_warning() -> None:
    buffer = np.arange(4 * 64, dtype=np.float32)
    raw = np.frombuffer(buffer.tobytes(), dtype=np.uint8)  # read-only
    info = TensorInfo(
        name="x", shape=(64, 4), type_id=0, ggml_type=GGMLType.F32, offset=0, file_offset=0, nbytes=raw.size
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        weight = make_packed_weight(info, raw, options=DecodeOptions())
    assert weight.data.data_ptr() == raw.ctypes.data
    assert weight.shape == (4, 64) and weight.layout is Layout.F32 and weight.scales is None
    np.testing.assert_array_equal(dequantize(weight).numpy(), buffer.reshape(4, 64))


def test_matrix_shape_from_ggml_order() -> None:
    assert matrix_shape((2560, 6912)) == (6912, 2560)
    assert matrix_shape((576,)) == (1, 576)
    assert matrix_shape(()) == (1, 1)
    assert matrix_shape((64, 4, 3)) == (12, 64)


def test_make_packed_weight_rejects_bad_sizes_and_types() -> None:
    info = TensorInfo(
        name="x", shape=(32, 2), type_id=8, ggml_type=GGMLType.Q8_0, offset=0, file_offset=0, nbytes=68
    )
    with pytest.raises(InvalidModelFile, match="got 67 bytes"):
        make_packed_weight(info, np.zeros(67, dtype=np.uint8), options=DecodeOptions())
    q8_k = TensorInfo(  # ggml's activation type: it never stores weights, bitserve decodes none
        name="y", shape=(256, 1), type_id=15, ggml_type=GGMLType.Q8_K, offset=0, file_offset=0, nbytes=292
    )
    with pytest.raises(UnsupportedModel, match="Q8_K"):
        make_packed_weight(q8_k, np.zeros(292, dtype=np.uint8), options=DecodeOptions())
    with pytest.raises(ValueError, match="i2s_variant"):
        DecodeOptions(i2s_variant="D")


@pytest.mark.parametrize("layout", [Layout.Q2_0, Layout.Q1_0])
def test_low_bit_weight_is_ternary_only_with_one_scale_and_no_code_3(layout: Layout) -> None:
    """one_scale_ternary_codes: a BitNet weight in Q2_0 / Q1_0 (one d over its live blocks) comes back as
    its codes and that d, as its I2_S file's would; a second d, or a Q2_0 code 3 (+2 d), needs the block
    kernels (None). A block whose d is 0 decodes to zeros and does not count as a second scale."""
    from bitserve.kernels.reference.dequant import one_scale_ternary_codes
    from bitserve.loader.low_bit_quantize import QUANTIZERS

    rng = np.random.default_rng(5)
    low, block = (-1, 64) if layout is Layout.Q2_0 else (0, 128)
    codes = rng.integers(low, 2, size=(6, 2 * block)).astype(np.float32)
    if layout is Layout.Q1_0:
        codes = codes * 2 - 1  # +-1
    codes[:, ::block] = 1.0  # every block's amax is its scale
    quantize = QUANTIZERS[layout.name]

    def packed(w: np.ndarray) -> PackedWeight:
        return PackedWeight(torch.from_numpy(quantize(w).reshape(-1)), w.shape, layout, layout.name)

    one = one_scale_ternary_codes(packed(codes * np.float32(0.25)))
    assert one is not None and float(one.scale) == 0.25
    assert torch.equal(one.values, torch.from_numpy(codes).to(torch.int8))
    two = codes * np.float32(0.25)
    two[0, :block] *= 2
    assert one_scale_ternary_codes(packed(two)) is None
    dead = packed(codes * np.float32(0.25))
    dead.data.view(-1, 18)[0, :2] = 0  # block 0's d = 0: its values decode to 0
    zeroed = one_scale_ternary_codes(dead)
    assert zeroed is not None and not zeroed.values[0, :block].any() and float(zeroed.scale) == 0.25
    if layout is Layout.Q2_0:
        plus_two = packed(codes * np.float32(0.25))
        plus_two.data.view(-1, 18)[7, 2] |= 3  # value 0 of row 3's second block: code 3 (+2 d), same d
        assert one_scale_ternary_codes(plus_two) is None
