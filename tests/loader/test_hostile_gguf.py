"""Crafted hostile GGUF files: each must raise one clear InvalidModelFile, quickly, with little allocation."""

from __future__ import annotations

import struct
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bitserve.errors import InvalidModelFile, UnsupportedModel
from bitserve.loader.gguf_reader import read_gguf
from bitserve.loader.gguf_types import GGMLType, GGUFValueType
from bitserve.loader.gguf_writer import GGUFBuilder

VT = GGUFValueType
F32, Q8_0 = int(GGMLType.F32), int(GGMLType.Q8_0)
EMBD, ATTN = "token_embd.weight", "blk.0.attn_q.weight"
LONG_NAME = "x" * 301  # also leaves padding between the tensor infos and the data


def base(arch: str = "llama", *, tensors: bool = True) -> GGUFBuilder:
    """A small valid file; long fields keep each truncation past the header's count bound."""
    b = GGUFBuilder()
    b.add_architecture(arch)
    b.add_string("general.name", LONG_NAME)
    b.add_uint32("llama.block_count", 2)
    b.add_array("tokenizer.ggml.tokens", ["a" * 20, "b" * 20, "c" * 20])
    b.add_array("tokenizer.ggml.scores", np.zeros(3, np.float32))
    if tensors:
        b.add_tensor(EMBD, (8, 2), F32, np.arange(16, dtype=np.float32))
        b.add_tensor(ATTN, (32, 2), Q8_0, bytes(range(68)))
    return b


def base_bytes() -> bytes:
    return base().to_bytes()


def at(label: str, delta: int = 0) -> int:
    return base().layout()[label] + delta


def cut(label: str, delta: int = 0) -> Callable[[], bytes]:
    return lambda: base_bytes()[: at(label, delta)]


def cut_at(position: int) -> Callable[[], bytes]:
    return lambda: base_bytes()[:position]


def patch(label: str, fmt: str, value: int, delta: int = 0) -> Callable[[], bytes]:
    def make() -> bytes:
        data = bytearray(base_bytes())
        struct.pack_into(fmt, data, at(label, delta), value)
        return bytes(data)

    return make


def with_kv(key: bytes, type_id: int, value: bytes, arch: str = "llama") -> Callable[[], bytes]:
    def make() -> bytes:
        b = base(arch)
        b.add_raw_kv(key, type_id, value)
        return b.to_bytes()

    return make


def with_tensor(
    name: str,
    shape: tuple[int, ...],
    type_id: int,
    data: bytes,
    *,
    arch: str = "llama",
    offset: int | None = None,
    extent: int | None = None,
) -> Callable[[], bytes]:
    def make() -> bytes:
        b = base(arch)
        b.add_tensor(name, shape, type_id, data, offset=offset, extent=extent)
        return b.to_bytes()

    return make


def builder(
    fn: Callable[[GGUFBuilder], None], *, arch: str = "llama", tensors: bool = True, **to_bytes: int
) -> Callable[[], bytes]:
    def make() -> bytes:
        b = base(arch, tensors=tensors)
        fn(b)
        return b.to_bytes(**to_bytes)

    return make


def nested_arrays(depth: int) -> bytes:
    """`depth` levels of one-element arrays of arrays, ending in an empty u8 array."""
    return struct.pack("<IQ", VT.ARRAY, 1) * (depth - 1) + struct.pack("<IQ", VT.UINT8, 0)


def _alignment(value_type: GGUFValueType, value: object) -> Callable[[GGUFBuilder], None]:
    return lambda b: b.add_kv("general.alignment", value_type, value)


def _type39(b: GGUFBuilder, extent: int) -> None:
    """A [64, 4] type-39 tensor that is not last: TL2 needs 128 bytes, MXFP4 160."""
    b.add_tensor("experts", (64, 4), 39, bytes(extent))
    b.add_tensor("after", (64,), F32, bytes(256))


P = pytest.param
CASES = [
    # --- container header ---
    P(lambda: b"", "empty file", id="empty"),
    P(cut_at(2), "truncated while reading magic", id="mid-magic"),
    P(lambda: base().to_bytes(magic=b"GGML"), "bad magic", id="bad-magic"),
    P(lambda: b"\x00" * 64, "bad magic", id="zeros"),
    P(cut_at(4), "truncated while reading version", id="after-magic"),
    P(cut_at(6), "truncated while reading version", id="mid-version"),
    P(lambda: base().to_bytes(version=1), "GGUF version 1", id="version-1"),
    P(lambda: base().to_bytes(version=0), "unsupported GGUF version 0", id="version-0"),
    P(lambda: base().to_bytes(version=4), "unsupported GGUF version 4", id="version-4"),
    P(patch("version", ">I", 3), "big-endian", id="big-endian"),
    P(cut_at(12), "truncated while reading tensor count", id="mid-tensor-count"),
    P(cut_at(20), "truncated while reading key-value count", id="mid-kv-count"),
    P(cut_at(24), "need at least", id="after-header"),
    P(
        lambda: base().to_bytes(num_tensors=2**62),
        "tensor count 4611686018427387904 exceeds",
        id="huge-n-tensors",
    ),
    P(lambda: base().to_bytes(num_kv=2**62), "key-value count 4611686018427387904 exceeds", id="huge-n-kv"),
    P(lambda: base().to_bytes(num_tensors=100_000), "need at least", id="n-tensors-past-eof"),
    P(lambda: base().to_bytes(num_tensors=-1), "negative tensor count", id="negative-n-tensors"),
    P(lambda: base().to_bytes(num_kv=-5), "negative key-value count", id="negative-n-kv"),
    # --- key-value section ---
    P(cut("kv.llama.block_count", 4), "truncated while reading key 2 length", id="mid-key-length"),
    P(cut("kv.llama.block_count", 12), "key 2 length 17 exceeds the 4 bytes left", id="mid-key"),
    P(
        cut("kv.llama.block_count.type", 2),
        "truncated while reading value type of key 'llama.block_count'",
        id="mid-value-type",
    ),
    P(
        cut("kv.llama.block_count.value", 2),
        "truncated while reading value of key 'llama.block_count'",
        id="mid-value",
    ),
    P(
        cut("kv.general.name.value", 200),
        "string value of key 'general.name' length 301 exceeds",
        id="mid-string-value",
    ),
    P(
        cut("kv.tokenizer.ggml.tokens.value", 6),
        "truncated while reading array of key",
        id="mid-array-header",
    ),
    P(
        cut("kv.tokenizer.ggml.tokens.value", 12 + 28 + 18),
        "string 1 of key 'tokenizer.ggml.tokens'",
        id="mid-string-array",
    ),
    P(cut("kv.tokenizer.ggml.scores.value", 12 + 6), "count 3 needs at least 12 bytes", id="mid-f32-array"),
    P(
        patch("kv.general.name.value", "<Q", 2**63),
        "length 9223372036854775808 exceeds",
        id="huge-string-len",
    ),
    P(patch("kv.llama.block_count", "<Q", 2**64 - 1), "key 2 length 18446744073709551615", id="huge-key-len"),
    P(with_kv(b"k" * 70_000, VT.UINT8, b"\x01"), "exceeds the limit of 65536", id="key-over-cap"),
    P(
        patch("kv.tokenizer.ggml.tokens.value", "<Q", 2**62, 4),
        "count 4611686018427387904 needs",
        id="huge-array-count",
    ),
    P(with_kv(b"bomb", VT.ARRAY, nested_arrays(10_000)), "nested deeper than 2", id="nested-array-bomb"),
    P(
        with_kv(b"wide", VT.ARRAY, struct.pack("<IQ", VT.ARRAY, 2**60)),
        "count 1152921504606846976 needs",
        id="nested-array-huge-count",
    ),
    P(with_kv(b"odd", 13, b"\x00" * 8), "unknown value type 13 for key 'odd'", id="unknown-value-type"),
    P(with_kv(b"odd", 0xFFFFFFFF, b""), "unknown value type 4294967295", id="negative-value-type"),
    P(
        with_kv(b"odd", VT.ARRAY, struct.pack("<IQ", 99, 1)),
        "unknown value type 99 for array elements",
        id="unknown-array-type",
    ),
    P(with_kv(b"flag", VT.BOOL, b"\x02"), "bool value of key 'flag' is 2", id="bool-not-0-1"),
    P(
        with_kv(b"flags", VT.ARRAY, struct.pack("<IQ", VT.BOOL, 3) + b"\x01\x00\x07"),
        "bool element 2",
        id="bool-array-not-0-1",
    ),
    P(
        with_kv(b"llama.block_count", VT.UINT32, b"\x03\x00\x00\x00"),
        "duplicate key 'llama.block_count'",
        id="duplicate-key",
    ),
    P(with_kv(b"bad\xff\xfekey", VT.UINT8, b"\x01"), "not valid UTF-8", id="invalid-utf8-key"),
    P(with_kv(b"", VT.UINT8, b"\x01"), "is empty", id="empty-key"),
    P(builder(_alignment(VT.UINT32, 0)), "general.alignment 0 is not a power of two", id="alignment-0"),
    P(builder(_alignment(VT.UINT32, 48)), "general.alignment 48 is not a power of two", id="alignment-48"),
    P(
        builder(_alignment(VT.INT32, 32)),
        "general.alignment must be UINT32 but is INT32",
        id="alignment-int32",
    ),
    P(builder(_alignment(VT.STRING, "32")), "must be UINT32 but is STRING", id="alignment-string"),
    # --- tensor infos ---
    P(cut(f"tensor.{ATTN}", 4), "truncated while reading name of tensor 1 length", id="mid-tensor-name-len"),
    P(cut(f"tensor.{ATTN}", 12), "name of tensor 1 length 19 exceeds the 4 bytes left", id="mid-tensor-name"),
    P(cut(f"tensor.{ATTN}.n_dims", 2), f"truncated while reading n_dims of tensor '{ATTN}'", id="mid-ndims"),
    P(cut(f"tensor.{ATTN}.ne", 12), f"truncated while reading ne of tensor '{ATTN}'", id="mid-ne"),
    P(cut(f"tensor.{ATTN}.type", 3), f"truncated while reading type of tensor '{ATTN}'", id="mid-type"),
    P(
        cut(f"tensor.{ATTN}.offset", 5),
        f"truncated while reading data offset of tensor '{ATTN}'",
        id="mid-offset",
    ),
    P(cut("data", -1), "before the data section", id="in-padding-before-data"),
    P(cut("data"), "past the end of the data section (0 bytes)", id="no-data"),
    P(
        cut(f"data.{ATTN}", 30),
        f"tensor '{ATTN}' (68 bytes at data offset 64) extends past the end",
        id="mid-data",
    ),
    P(
        patch(f"tensor.{EMBD}", "<Q", 2**63),
        "name of tensor 0 length 9223372036854775808",
        id="huge-name-len",
    ),
    P(
        builder(lambda b: b.add_tensor(b"\xc3\x28name", (4,), F32, bytes(16))),
        "not valid UTF-8",
        id="invalid-utf8-name",
    ),
    P(with_tensor(EMBD, (4,), F32, bytes(16)), f"duplicate tensor name '{EMBD}'", id="duplicate-tensor"),
    P(with_tensor("t", (1, 1, 1, 1, 1), F32, bytes(4)), "has n_dims 5", id="ndims-5"),
    P(patch(f"tensor.{EMBD}.n_dims", "<I", 2**32 - 1), "has n_dims 4294967295", id="ndims-huge"),
    P(with_tensor("t", (4, -1), F32, b""), "negative ne[1] = -1", id="negative-ne"),
    P(with_tensor("t", (2**40, 2**40), F32, b""), "overflows int64", id="ne-product-overflow"),
    P(with_tensor("t", (2**62,), F32, b""), "extends past the end", id="huge-tensor"),
    P(with_tensor("t", (4,), 99, bytes(16)), "unknown tensor type id 99", id="unknown-type-99"),
    P(with_tensor("t", (4,), -1, bytes(16)), "unknown tensor type id -1", id="negative-type"),
    P(with_tensor("t", (4,), 4, bytes(16)), "Q4_2", id="removed-type-4"),
    P(with_tensor("t", (64, 2), 37, bytes(64)), "I8_S", id="type-37-i8s"),
    P(with_tensor("t", (64, 2), 40, bytes(72)), "NVFP4", id="upstream-nvfp4"),
    P(builder(lambda b: _type39(b, 160)), "unsupported tensor type MXFP4", id="upstream-mxfp4"),
    P(builder(lambda b: _type39(b, 96)), "fits neither TL2", id="type39-fits-neither"),
    P(with_tensor("t", (33, 2), Q8_0, bytes(68)), "multiple of 32", id="q8_0-block-mismatch"),
    P(with_tensor("t", (128, 2), 35, bytes(66)), "multiple of 256", id="tq2_0-block-mismatch"),
    P(with_tensor("t", (512,), 36, bytes(160), arch="bitnet-b1.58"), "must be 2-D", id="i2s-1d"),
    P(
        with_tensor("t", (256, 8), 36, bytes(512), arch="bitnet-b1.58"),
        "extends past the end",
        id="i2s-missing-scale-slot",
    ),
    P(
        with_tensor("t", (4,), F32, bytes(16), offset=16),
        "not a multiple of the alignment 32",
        id="misaligned-offset",
    ),
    P(
        with_tensor("t", (4,), F32, b"", offset=2**40),
        "past the end of the data section",
        id="offset-past-eof",
    ),
    P(with_tensor("t", (16,), F32, bytes(64), offset=64), "overlaps tensor", id="overlapping"),
    P(with_tensor("t", (1024,), F32, bytes(64)), "extends past the end", id="tensor-past-eof"),
]


def expect_invalid(path: Path, fragment: str) -> InvalidModelFile:
    """Parse `path`: it must raise InvalidModelFile naming `fragment`, allocating little on the way."""
    size = path.stat().st_size
    tracemalloc.start()
    try:
        with pytest.raises(InvalidModelFile) as info:
            read_gguf(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    text = str(info.value)
    assert text.startswith(f"{path}: ")  # the path names the test: match the fragment after it
    assert fragment in text[len(str(path)) :]
    assert peak < max(1 << 20, 8 * size), f"parse allocated {peak} bytes for a {size}-byte file"
    return info.value


@pytest.mark.parametrize(("make", "fragment"), CASES)
def test_hostile_file(tmp_path: Path, make: Callable[[], bytes], fragment: str) -> None:
    path = tmp_path / "hostile.gguf"
    path.write_bytes(make())
    error = expect_invalid(path, fragment)
    assert error.hint


def test_corpus_is_large_and_the_base_file_is_valid(tmp_path: Path) -> None:
    assert len(CASES) >= 30
    path = tmp_path / "base.gguf"
    path.write_bytes(base_bytes())
    with read_gguf(path) as g:
        assert list(g.tensors) == [EMBD, ATTN]
        assert g.metadata["general.name"] == LONG_NAME
        assert g.data_offset > at("tensor_infos_end")  # the in-padding truncation case is meaningful


def test_every_truncation_is_rejected(tmp_path: Path) -> None:
    """Each prefix that cuts into a field or tensor fails; only the trailing zero padding may go."""
    data = base_bytes()
    end_of_last_tensor = at(f"data.{ATTN}", 68)
    path = tmp_path / "t.gguf"
    for length in range(len(data) + 1):
        path.write_bytes(data[:length])
        if length < end_of_last_tensor:
            with pytest.raises(InvalidModelFile):
                read_gguf(path)
        else:
            with read_gguf(path) as g:
                assert g.tensor_data(ATTN).tobytes() == bytes(range(68))


@pytest.mark.parametrize(
    ("make", "is_unsupported"),
    [
        (lambda: base().to_bytes(version=1), True),
        (with_tensor("t", (64, 2), 37, bytes(64)), True),
        (with_tensor("t", (4,), 99, bytes(16)), True),
        (builder(lambda b: _type39(b, 160)), True),
        (patch("version", ">I", 3), False),
        (with_tensor("t", (33, 2), Q8_0, bytes(68)), False),
    ],
)
def test_unsupported_versus_malformed(
    tmp_path: Path, make: Callable[[], bytes], is_unsupported: bool
) -> None:
    path = tmp_path / "f.gguf"
    path.write_bytes(make())
    with pytest.raises(InvalidModelFile) as info:
        read_gguf(path)
    assert isinstance(info.value, UnsupportedModel) is is_unsupported


def test_error_names_the_offset(tmp_path: Path) -> None:
    path = tmp_path / "f.gguf"
    path.write_bytes(patch("kv.general.name.value", "<Q", 2**63)())
    error = expect_invalid(path, "exceeds")
    assert error.offset == at("kv.general.name.value")
    assert f"offset {error.offset}" in str(error) and error.expected


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    mutations=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=8),
    truncate=st.one_of(st.none(), st.integers(0, 10_000)),
)
def test_fuzzed_mutations_parse_or_fail_cleanly(
    fuzz_dir: Path, mutations: list[tuple[int, int]], truncate: int | None
) -> None:
    data = bytearray(base_bytes())
    for position, value in mutations:
        data[position % len(data)] = value
    if truncate is not None:
        del data[truncate % (len(data) + 1) :]
    path = fuzz_dir / "fuzz.gguf"
    path.write_bytes(bytes(data))
    try:
        g = read_gguf(path)
    except InvalidModelFile:
        return
    with g:
        for name in g.tensors:
            assert g.tensor_data(name).nbytes == g.tensors[name].nbytes
