"""A small GGUF writer of bitserve's own, for tests, fixtures and benchmarks.

It writes what gguf-py cannot: bitnet.cpp types 36-39, hidden TL scale slots, and deliberately broken files
(raw fields, explicit offsets, overridden counts). It checks nothing; `layout()` gives every field's offset.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bitserve.loader.gguf_types import SCALAR_FORMATS, GGUFValueType, pad_to

_NUMPY_TO_VALUE_TYPE = {
    np.dtype(np.uint8): GGUFValueType.UINT8,
    np.dtype(np.int8): GGUFValueType.INT8,
    np.dtype(np.uint16): GGUFValueType.UINT16,
    np.dtype(np.int16): GGUFValueType.INT16,
    np.dtype(np.uint32): GGUFValueType.UINT32,
    np.dtype(np.int32): GGUFValueType.INT32,
    np.dtype(np.float32): GGUFValueType.FLOAT32,
    np.dtype(np.bool_): GGUFValueType.BOOL,
    np.dtype(np.uint64): GGUFValueType.UINT64,
    np.dtype(np.int64): GGUFValueType.INT64,
    np.dtype(np.float64): GGUFValueType.FLOAT64,
}


@dataclass(frozen=True, slots=True)
class GGUFArray:
    """An array value with an explicit element type; use it for the elements of nested arrays."""

    element_type: GGUFValueType
    values: Sequence[Any] | np.ndarray


def encode_string(value: str | bytes) -> bytes:
    data = value.encode("utf-8") if isinstance(value, str) else bytes(value)
    return struct.pack("<Q", len(data)) + data


def _infer_element_type(values: Sequence[Any] | np.ndarray) -> GGUFValueType:
    if isinstance(values, np.ndarray):
        return _NUMPY_TO_VALUE_TYPE[values.dtype.newbyteorder("=")]
    if values and all(isinstance(v, (str, bytes)) for v in values):
        return GGUFValueType.STRING
    if values and all(isinstance(v, GGUFArray) for v in values):
        return GGUFValueType.ARRAY
    raise ValueError("pass array_type for arrays of numbers, bools or empty arrays")


def encode_value(value_type: GGUFValueType, value: Any, array_type: GGUFValueType | None = None) -> bytes:
    """The value's bytes, without its leading type tag."""
    if value_type is GGUFValueType.STRING:
        return encode_string(value)
    if value_type is GGUFValueType.ARRAY:
        if isinstance(value, GGUFArray):
            array_type, value = value.element_type, value.values
        elem_type = array_type if array_type is not None else _infer_element_type(value)
        head = struct.pack("<IQ", elem_type, len(value))
        if elem_type in SCALAR_FORMATS:
            fmt = SCALAR_FORMATS[elem_type][0]
            return head + np.asarray(value, dtype=np.dtype(fmt[1:]).newbyteorder("<")).tobytes()
        if elem_type is GGUFValueType.STRING:
            return head + b"".join(encode_string(v) for v in value)
        return head + b"".join(encode_value(GGUFValueType.ARRAY, v) for v in value)
    return struct.pack(SCALAR_FORMATS[value_type][0], value)


@dataclass(slots=True)
class _Tensor:
    name: bytes
    shape: tuple[int, ...]
    type_id: int
    data: bytes
    extent: int
    offset: int | None


class GGUFBuilder:
    """Collects keys and tensors and assembles a GGUF file in gguf-py's byte layout.

    Tensors are placed in order, each at the previous end padded to the alignment, unless `offset` is
    given; `extent` reserves bytes after the data (e.g. a TL hidden scale slot).
    """

    def __init__(self, alignment: int = 32, *, add_alignment_key: bool | None = None) -> None:
        self.alignment = alignment
        self._kvs: list[tuple[bytes, bytes]] = []  # (key bytes, type tag + value bytes)
        self._tensors: list[_Tensor] = []
        if add_alignment_key if add_alignment_key is not None else alignment != 32:
            self.add_uint32("general.alignment", alignment)

    # ---- metadata ----
    def add_kv(
        self, key: str, value_type: GGUFValueType, value: Any, array_type: GGUFValueType | None = None
    ) -> None:
        self.add_raw_kv(key.encode("utf-8"), int(value_type), encode_value(value_type, value, array_type))

    def add_raw_kv(self, key: bytes, value_type_id: int, value_bytes: bytes) -> None:
        """A record with any key bytes, any type number and any value bytes (for broken files)."""
        self._kvs.append((key, struct.pack("<I", value_type_id & 0xFFFFFFFF) + value_bytes))

    def add_string(self, key: str, value: str) -> None:
        self.add_kv(key, GGUFValueType.STRING, value)

    def add_uint32(self, key: str, value: int) -> None:
        self.add_kv(key, GGUFValueType.UINT32, value)

    def add_int32(self, key: str, value: int) -> None:
        self.add_kv(key, GGUFValueType.INT32, value)

    def add_uint64(self, key: str, value: int) -> None:
        self.add_kv(key, GGUFValueType.UINT64, value)

    def add_float32(self, key: str, value: float) -> None:
        self.add_kv(key, GGUFValueType.FLOAT32, value)

    def add_float64(self, key: str, value: float) -> None:
        self.add_kv(key, GGUFValueType.FLOAT64, value)

    def add_bool(self, key: str, value: bool) -> None:
        self.add_kv(key, GGUFValueType.BOOL, value)

    def add_array(
        self, key: str, values: Sequence[Any] | np.ndarray, element_type: GGUFValueType | None = None
    ) -> None:
        self.add_kv(key, GGUFValueType.ARRAY, values, element_type)

    def add_architecture(self, arch: str) -> None:
        self.add_string("general.architecture", arch)

    # ---- tensors ----
    def add_tensor(
        self,
        name: str | bytes,
        shape_ggml: tuple[int, ...],
        type_id: int,
        data: bytes | np.ndarray,
        *,
        extent: int | None = None,
        offset: int | None = None,
    ) -> None:
        """`shape_ggml` is in ggml order (ne[0] first). Nothing is checked: sizes and ids are written as
        given."""
        raw = data.tobytes() if isinstance(data, np.ndarray) else bytes(data)
        reserved = len(raw) if extent is None else extent
        if reserved < len(raw):
            raise ValueError(f"extent {reserved} is smaller than the {len(raw)} data bytes")
        name_bytes = name.encode("utf-8") if isinstance(name, str) else bytes(name)
        self._tensors.append(_Tensor(name_bytes, tuple(shape_ggml), type_id, raw, reserved, offset))

    # ---- assembly ----
    def _placements(self) -> tuple[list[int], int]:
        offsets, running = [], 0
        for t in self._tensors:
            off = running if t.offset is None else t.offset
            offsets.append(off)
            if t.extent or t.offset is None:
                running = max(running, pad_to(off + t.extent, self.alignment))
        return offsets, running

    def _assemble(
        self, version: int, num_tensors: int | None, num_kv: int | None, magic: bytes
    ) -> tuple[bytes, dict[str, int]]:
        out = bytearray()
        layout: dict[str, int] = {"magic": 0, "version": 4, "num_tensors": 8, "num_kv": 16}
        out += magic + struct.pack("<I", version)
        out += struct.pack("<q", len(self._tensors) if num_tensors is None else num_tensors)
        out += struct.pack("<q", len(self._kvs) if num_kv is None else num_kv)
        for key, payload in self._kvs:
            label = "kv." + key.decode("utf-8", "backslashreplace")
            layout.setdefault(label, len(out))
            out += encode_string(key)
            layout.setdefault(label + ".type", len(out))
            layout.setdefault(label + ".value", len(out) + 4)
            out += payload
        offsets, data_len = self._placements()
        for t, off in zip(self._tensors, offsets, strict=True):
            label = "tensor." + t.name.decode("utf-8", "backslashreplace")
            layout.setdefault(label, len(out))
            out += encode_string(t.name)
            layout.setdefault(label + ".n_dims", len(out))
            out += struct.pack("<I", len(t.shape))
            layout.setdefault(label + ".ne", len(out))
            out += b"".join(struct.pack("<q" if d < 0 else "<Q", d) for d in t.shape)
            layout.setdefault(label + ".type", len(out))
            out += struct.pack("<i" if t.type_id < 0 else "<I", t.type_id)
            layout.setdefault(label + ".offset", len(out))
            out += struct.pack("<Q", off)
        layout["tensor_infos_end"] = len(out)
        out += bytes(pad_to(len(out), self.alignment) - len(out))
        data_start = layout["data"] = len(out)
        data = bytearray(data_len)
        for t, off in zip(self._tensors, offsets, strict=True):
            layout.setdefault("data." + t.name.decode("utf-8", "backslashreplace"), data_start + off)
            if t.data:
                data[off : off + len(t.data)] = t.data
        out += data
        layout["end"] = len(out)
        return bytes(out), layout

    def to_bytes(
        self,
        *,
        version: int = 3,
        num_tensors: int | None = None,
        num_kv: int | None = None,
        magic: bytes = b"GGUF",
    ) -> bytes:
        """The file; the counts in the header can be overridden to lie about the records that follow."""
        return self._assemble(version, num_tensors, num_kv, magic)[0]

    def layout(self) -> dict[str, int]:
        """File offset of each field: magic, version, num_tensors, num_kv, kv.<key>[.type|.value],
        tensor.<name>[.n_dims|.ne|.type|.offset], tensor_infos_end, data, data.<name>, end."""
        return self._assemble(3, None, None, b"GGUF")[1]

    def write(self, path: str | os.PathLike[str], **kwargs: Any) -> Path:
        target = Path(path)
        target.write_bytes(self.to_bytes(**kwargs))
        return target
