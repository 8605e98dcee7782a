"""TL1 / TL2: docs/formats.md §6.1 fixtures, producer -> decoder round trips, the §2.3 index formulas,
tile configs, errors."""

from __future__ import annotations

import logging
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from bitserve.errors import InvalidModelFile, InvalidRequest
from bitserve.kernels.packed import Layout, PackedWeight
from bitserve.kernels.reference.dequant import dense_rows, dequantize, unpack_ternary
from bitserve.loader.decode import DecodeOptions, make_packed_weight
from bitserve.loader.gguf_reader import TensorInfo
from bitserve.loader.gguf_types import GGMLType, pad_to, tensor_nbytes, tl2_data_bytes
from bitserve.loader.ternary_pack import pack_tl1, pack_tl2
from bitserve.loader.tl_config import (
    TileConfig,
    TLConfigTable,
    load_kernel_config_ini,
    preset,
    sidecar_path,
)

# A small kernel_config.ini in BitNet's format (codegen writes M/K/BM/BK/bmm; configparser lower-cases them).
TL1_INI = """\
[Kernels_0]
M = 320
K = 256
BM = 160
BK = 64
bmm = 32

[Kernels_1]
M = 256
K = 512
BM = 128
BK = 128
bmm = 64
"""
TL2_INI = """\
[Kernels_0]
m = 320
k = 3200
bm = 160
bk = 96
bmm = 32

[Kernels_1]
m = 256
k = 2560
bm = 128
bk = 96
bmm = 32
"""


def _ternary(rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
    return rng.integers(-1, 2, size=shape).astype(np.int8)


def _info(name: str, ggml_type: GGMLType, shape_mk: tuple[int, int], nbytes: int) -> TensorInfo:
    num_rows, num_cols = shape_mk
    return TensorInfo(
        name=name,
        shape=(num_cols, num_rows),
        type_id=int(ggml_type),
        ggml_type=ggml_type,
        offset=0,
        file_offset=0,
        nbytes=nbytes,
    )


def _load(kind: GGMLType, packed: bytes, shape_mk: tuple[int, int], table: TLConfigTable) -> PackedWeight:
    raw = np.frombuffer(packed, dtype=np.uint8)  # read-only, like an mmap view
    info = _info("blk.0.ffn_up.weight", kind, shape_mk, tensor_nbytes(kind, shape_mk[::-1]))
    return make_packed_weight(info, raw, options=DecodeOptions(tl_configs=table))


def _ini(tmp_path: Path, text: str) -> TLConfigTable:
    path = tmp_path / "model.kernel_config.ini"
    path.write_text(text)
    return load_kernel_config_ini(path)


# ------------------------------------------------------------------------------------------ fixtures (6.1)
def test_tl1_worked_byte_0x65() -> None:
    values = np.zeros((32, 8), dtype=np.int8)
    values[0, :4] = [1, -1, 0, 1]  # pairs (+1,-1) -> 6 and (0,+1) -> 5, the first pair in the high nibble
    packed = pack_tl1(values, 1.0, TileConfig(BM=32, BK=8, bm=32))
    assert packed[0] == 0x65
    # and the decoder reads the literal byte back: every other byte is 0x44 (two zero pairs)
    literal = bytes([0x65]) + bytes([0x44]) * (32 * 8 // 4 - 1) + struct.pack("<f", 1.0) + bytes(28)
    table = TLConfigTable({(32, 8): TileConfig(32, 8, 32)}, source="test")
    decoded = unpack_ternary(_load(GGMLType.TL1, literal, (32, 8), table)).values
    expected = np.zeros((32, 8), dtype=np.int8)
    expected[0, :4] = [1, -1, 0, 1]
    np.testing.assert_array_equal(decoded.numpy(), expected)


def test_tl2_size_fixture_m320_k3200() -> None:
    rng = np.random.default_rng(1)
    values = _ternary(rng, (320, 3200))
    packed = pack_tl2(values, 0.75, TileConfig(BM=160, BK=96, bm=32))
    assert tl2_data_bytes(320, 3200) == 216_746
    used = 320 * 3168 // 6 + 320 * 3168 // 24 + 320 * 32 // 4
    assert used == 213_760
    stored = pad_to(216_746, 32)
    assert len(packed) == stored + 32 == tensor_nbytes(GGMLType.TL2, (3200, 320))
    assert not any(packed[used:stored]), "the over-estimated tail must be zero"
    assert any(packed[used - 64 : used])
    assert struct.unpack_from("<f", packed, stored)[0] == 0.75
    assert not any(packed[stored + 4 :])


# ------------------------------------------------------------------------------------------ round trips
@pytest.mark.parametrize("shape", [(320, 256), (256, 512)])
def test_tl1_round_trip_with_sidecar_ini(tmp_path: Path, shape: tuple[int, int]) -> None:
    table = _ini(tmp_path, TL1_INI)
    rng = np.random.default_rng(shape[0] + shape[1])
    values = _ternary(rng, shape)
    scale = float(np.float32(0.0371))
    weight = _load(GGMLType.TL1, pack_tl1(values, scale, table[shape]), shape, table)
    assert weight.layout is Layout.TL1 and weight.shape == shape
    tile = table[shape]
    assert weight.params == {"BM": tile.BM, "BK": tile.BK, "bm": tile.bm}
    codes = unpack_ternary(weight)
    np.testing.assert_array_equal(codes.values.numpy(), values)
    assert codes.is_per_tensor and codes.scale.item() == scale
    assert torch.equal(dequantize(weight), torch.from_numpy(values).float() * np.float32(scale))


@pytest.mark.parametrize("shape", [(320, 3200), (256, 2560)])
def test_tl2_round_trip_with_pair_columns(tmp_path: Path, shape: tuple[int, int]) -> None:
    table = _ini(tmp_path, TL2_INI)
    assert shape[1] % table[shape].BK in (32, 64)  # K2 = 32 and 64: both codings are exercised
    rng = np.random.default_rng(shape[1])
    values = _ternary(rng, shape)
    weight = _load(GGMLType.TL2, pack_tl2(values, 1.5, table[shape]), shape, table)
    codes = unpack_ternary(weight)
    np.testing.assert_array_equal(codes.values.numpy(), values)
    assert codes.scale.item() == 1.5
    row_ids = torch.tensor([0, 255, 17, 17])
    assert torch.equal(dense_rows(weight, row_ids), dequantize(weight)[row_ids])


@pytest.mark.parametrize("kind", ["tl1", "tl2"])
def test_preset_shape_round_trip(kind: str) -> None:
    # bitnet_b1_58-large (1536, 1536): TL1 128/64/64, TL2 128/192/32 (K % BK == 0: no pair columns)
    table = preset("bitnet_b1_58-large", kind)
    shape = (1536, 1536)
    rng = np.random.default_rng(7)
    values = _ternary(rng, shape)
    pack = pack_tl1 if kind == "tl1" else pack_tl2
    ggml_type = GGMLType.TL1 if kind == "tl1" else GGMLType.TL2
    weight = _load(ggml_type, pack(values, 0.5, table[shape]), shape, table)
    np.testing.assert_array_equal(unpack_ternary(weight).values.numpy(), values)


def test_tl2_decoder_needs_the_right_tile_config() -> None:
    rng = np.random.default_rng(3)
    values = _ternary(rng, (256, 2560))
    packed = pack_tl2(values, 1.0, TileConfig(BM=128, BK=96, bm=32))
    wrong = TLConfigTable({(256, 2560): TileConfig(BM=256, BK=96, bm=32)}, source="wrong")
    decoded = unpack_ternary(_load(GGMLType.TL2, packed, (256, 2560), wrong)).values.numpy()
    assert not np.array_equal(decoded, values)


# ------------------------------------------------ the index formulas of docs/formats.md §2.3, element-wise
def _tl1_pair_code(values: np.ndarray, row: int, pair: int) -> int:
    return 3 * int(values[row, 2 * pair]) + int(values[row, 2 * pair + 1]) + 4


def test_tl1_bytes_follow_spec_index_formula() -> None:
    num_rows, num_cols, cfg = 256, 512, TileConfig(BM=128, BK=128, bm=64)
    rng = np.random.default_rng(11)
    values = _ternary(rng, (num_rows, num_cols))
    packed = pack_tl1(values, 1.0, cfg)
    by = 256 // cfg.bm
    dims = [num_rows // cfg.BM, num_cols // cfg.BK, cfg.BM // cfg.bm, cfg.BK // by, cfg.bm // 16, by // 4, 16]
    for t in rng.integers(0, num_rows * num_cols // 4, size=300):
        tm, tk, sm, sk, g16, kp, i16 = np.unravel_index(int(t), dims)
        row = tm * cfg.BM + sm * cfg.bm + 16 * g16 + i16
        pair = tk * cfg.BK // 2 + sk * by // 2 + 2 * kp
        expected = _tl1_pair_code(values, row, pair) << 4 | _tl1_pair_code(values, row, pair + 1)
        assert packed[t] == expected


def test_tl2_bytes_follow_spec_index_formula() -> None:
    num_rows, num_cols, cfg = 256, 2560, TileConfig(BM=128, BK=96, bm=32)
    k3 = num_cols - num_cols % cfg.BK
    rng = np.random.default_rng(12)
    values = _ternary(rng, (num_rows, num_cols))
    packed = pack_tl2(values, 1.0, cfg)
    perm = (0, 2, 1, 3)

    def triple(row: int, q3: int) -> int:
        a, b, c = (int(v) for v in values[row, 3 * q3 : 3 * q3 + 3])
        return 9 * a + 3 * b + c

    mag_dims = [num_rows // cfg.BM, k3 // cfg.BK, cfg.BM // 32, cfg.BK // 6, 32]
    for t in rng.integers(0, num_rows * k3 // 6, size=200):  # (i) magnitudes
        tm, tk, sm, sk, pos = np.unravel_index(int(t), mag_dims)
        row = tm * cfg.BM + sm * 32 + perm[pos // 8] * 8 + pos % 8
        q3 = tk * cfg.BK // 3 + 2 * sk
        assert packed[t] == abs(triple(row, q3)) << 4 | abs(triple(row, q3 + 1))
    sign_start = num_rows * k3 // 6
    sign_dims = [num_rows // cfg.BM, k3 // cfg.BK, cfg.BM // 32, cfg.BK // 24, 16]
    for w in rng.integers(0, num_rows * k3 // 48, size=100):  # (ii) sign words
        tm, tk, sm, s4, j = np.unravel_index(int(w), sign_dims)
        word = packed[sign_start + 2 * w] | packed[sign_start + 2 * w + 1] << 8
        for i in range(16):
            f = 16 * i + j
            q3 = tk * cfg.BK // 3 + 8 * s4 + f // 32
            row = tm * cfg.BM + sm * 32 + f % 32
            assert (word >> (15 - i)) & 1 == int(triple(row, q3) < 0)
    pair_start = sign_start + num_rows * k3 // 24
    pair_dims = [num_rows // cfg.BM, (num_cols - k3) // 32, cfg.BM // 32, 8, 32]
    for t in rng.integers(0, num_rows * (num_cols - k3) // 4, size=200):  # (iii) pairs
        tm, tk2, sm, sk, pos = np.unravel_index(int(t), pair_dims)
        row = tm * cfg.BM + sm * 32 + perm[pos // 8] * 8 + pos % 8
        pair = k3 // 2 + 16 * tk2 + 2 * sk
        assert packed[pair_start + t] == _tl1_pair_code(values, row, pair) << 4 | _tl1_pair_code(
            values, row, pair + 1
        )


# ------------------------------------------------------------------------------------------ error paths
def _valid(kind: GGMLType) -> tuple[bytearray, TLConfigTable, tuple[int, int]]:
    shape = (256, 2560) if kind is GGMLType.TL2 else (256, 512)
    cfg = TileConfig(128, 96, 32) if kind is GGMLType.TL2 else TileConfig(128, 128, 64)
    values = _ternary(np.random.default_rng(5), shape)
    packed = (pack_tl2 if kind is GGMLType.TL2 else pack_tl1)(values, 1.0, cfg)
    return bytearray(packed), TLConfigTable({shape: cfg}, source="test"), shape


def test_tl1_nibble_9_is_rejected() -> None:
    packed, table, shape = _valid(GGMLType.TL1)
    packed[100] = 0x94
    with pytest.raises(InvalidModelFile, match="TL1 nibble > 8"):
        unpack_ternary(_load(GGMLType.TL1, bytes(packed), shape, table))


def test_tl2_magnitude_14_is_rejected() -> None:
    packed, table, shape = _valid(GGMLType.TL2)
    packed[100] = 0xE3
    with pytest.raises(InvalidModelFile, match="TL2 magnitude > 13"):
        unpack_ternary(_load(GGMLType.TL2, bytes(packed), shape, table))


def test_tl2_pair_nibble_9_and_nonzero_padding_are_rejected() -> None:
    packed, table, (num_rows, num_cols) = _valid(GGMLType.TL2)
    k3 = num_cols - num_cols % 96
    bad_pair = bytearray(packed)
    bad_pair[num_rows * k3 // 6 + num_rows * k3 // 24 + 5] = 0x49
    with pytest.raises(InvalidModelFile, match="TL2 pair nibble > 8"):
        unpack_ternary(_load(GGMLType.TL2, bytes(bad_pair), (num_rows, num_cols), table))
    bad_tail = bytearray(packed)
    bad_tail[pad_to(tl2_data_bytes(num_rows, num_cols), 32) - 1] = 1
    with pytest.raises(InvalidModelFile, match="padding"):
        unpack_ternary(_load(GGMLType.TL2, bytes(bad_tail), (num_rows, num_cols), table))


def test_tl2_sign_on_zero_magnitude_warns(caplog: pytest.LogCaptureFixture) -> None:
    shape, cfg = (128, 96), TileConfig(128, 96, 32)
    packed = bytearray(pack_tl2(np.zeros(shape, dtype=np.int8), 1.0, cfg))
    packed[128 * 96 // 6] = 0x80  # a sign bit, every magnitude being 0
    weight = _load(GGMLType.TL2, bytes(packed), shape, TLConfigTable({shape: cfg}, source="test"))
    with caplog.at_level(logging.WARNING):
        values = unpack_ternary(weight).values
    assert "sign bits on zero magnitudes" in caplog.text
    assert not values.any()


@pytest.mark.parametrize("kind", [GGMLType.TL1, GGMLType.TL2])
def test_tl_tensor_without_config_names_the_sidecar(kind: GGMLType) -> None:
    packed, table, shape = _valid(kind)
    info = _info("blk.3.attn_q.weight", kind, shape, len(packed))
    raw = np.frombuffer(bytes(packed), dtype=np.uint8)
    for options in (DecodeOptions(), DecodeOptions(tl_configs=preset("bitnet_b1_58-3B", "tl2"))):
        with pytest.raises(InvalidModelFile) as excinfo:
            make_packed_weight(info, raw, options=options)
        text = str(excinfo.value)
        assert f"{kind.name} tensor blk.3.attn_q.weight has shape (M,K)={shape}" in text
        assert "kernel_config.ini" in text and "preset" in text


def test_tl_config_that_does_not_tile_the_shape_is_rejected() -> None:
    packed, _, shape = _valid(GGMLType.TL2)
    info = _info("w", GGMLType.TL2, shape, len(packed))
    bad = TLConfigTable({shape: TileConfig(BM=96, BK=96, bm=32)}, source="bad.ini")  # 256 % 96 != 0
    with pytest.raises(InvalidModelFile, match="does not fit"):
        make_packed_weight(
            info, np.frombuffer(bytes(packed), dtype=np.uint8), options=DecodeOptions(tl_configs=bad)
        )
    with pytest.raises(ValueError, match="bm == 32"):
        pack_tl2(np.zeros(shape, dtype=np.int8), 1.0, TileConfig(128, 96, 64))


# ------------------------------------------------------------------------------------------ tile configs
def test_kernel_config_ini_keys_first_section_wins_and_sidecar_path(tmp_path: Path) -> None:
    table = _ini(tmp_path, TL1_INI + "\n[Kernels_2]\nm = 320\nk = 256\nbm = 320\nbk = 128\nbmm = 64\n")
    assert table[(320, 256)] == TileConfig(BM=160, BK=64, bm=32)
    assert table[(256, 512)] == TileConfig(BM=128, BK=128, bm=64)
    assert len(table) == 2 and table.source.endswith("model.kernel_config.ini")
    assert sidecar_path(tmp_path / "ggml-model-tl2.gguf") == tmp_path / "ggml-model-tl2.kernel_config.ini"
    assert sidecar_path("models/m") == Path("models/m.kernel_config.ini")


def test_kernel_config_ini_errors(tmp_path: Path) -> None:
    with pytest.raises(InvalidModelFile, match="no key 'bmm'"):
        _ini(tmp_path, "[Kernels_0]\nm = 1\nk = 2\nbm = 3\nbk = 4\n")
    with pytest.raises(InvalidModelFile, match="not an integer"):
        _ini(tmp_path, "[Kernels_0]\nm = x\nk = 2\nbm = 3\nbk = 4\nbmm = 32\n")
    with pytest.raises(InvalidModelFile, match="cannot read"):
        load_kernel_config_ini(tmp_path / "missing.ini")


def test_presets_match_the_spec_table() -> None:
    assert preset("bitnet_b1_58-3B", "tl1")[(3200, 3200)] == TileConfig(320, 128, 64)
    assert preset("bitnet_b1_58-3B", "tl2")[(3200, 8640)] == TileConfig(160, 96, 32)
    assert preset("bitnet_b1_58-large", "tl2")[(1536, 1536)] == TileConfig(128, 192, 32)
    assert preset("Llama3-8B-1.58-100B-tokens", "tl1")[(4096, 14336)] == TileConfig(128, 64, 64)
    assert len(preset("Llama3-8B-1.58-100B-tokens", "tl2")) == 4


def test_unknown_preset_lists_the_presets() -> None:
    with pytest.raises(InvalidRequest) as excinfo:
        preset("bitnet-2b", "tl2")
    for name in ("bitnet_b1_58-large", "bitnet_b1_58-3B", "Llama3-8B-1.58-100B-tokens"):
        assert name in str(excinfo.value)
