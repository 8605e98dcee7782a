"""The byte-level half of the GGUF parser: a bounds-checked cursor over the mmap and the metadata value
readers (scalars, strings, nested arrays), each count checked against the bytes left before allocating.
`gguf_reader.py` builds the file's structure on top of these.
"""

from __future__ import annotations

import logging
import mmap
import struct
from typing import Any

import numpy as np

from bitserve.errors import InvalidModelFile
from bitserve.loader.gguf_types import SCALAR_FORMATS, GGUFValueType

logger = logging.getLogger(__name__)

# An array may hold arrays (gguf-py writes them), whose elements may not be arrays again.
MAX_ARRAY_DEPTH = 2
HINT_TRUNCATED = "the file is truncated or corrupt; re-download it or re-run the converter"

U32 = struct.Struct("<I")
I32 = struct.Struct("<i")
U64 = struct.Struct("<Q")
I64 = struct.Struct("<q")
_NUMPY_DTYPES: dict[GGUFValueType, np.dtype] = {
    vt: np.dtype(fmt) for vt, (fmt, _) in SCALAR_FORMATS.items() if vt is not GGUFValueType.BOOL
}
_SCALAR_STRUCTS = {vt: struct.Struct(fmt) for vt, (fmt, _) in SCALAR_FORMATS.items()}
# Smallest encoding of one array element, used to bound counts before allocating.
_MIN_ELEMENT_BYTES: dict[GGUFValueType, int] = {
    **{vt: width for vt, (_, width) in SCALAR_FORMATS.items()},
    GGUFValueType.STRING: 8,  # the length of an empty string
    GGUFValueType.ARRAY: 4 + 8,  # element type and count of an empty array
}


class Cursor:
    """Reads little-endian fields from the mmap; `need` fails before anything past `end` is touched."""

    __slots__ = ("buf", "pos", "end", "file_size", "path")

    def __init__(self, buf: mmap.mmap, pos: int, end: int, file_size: int, path: str) -> None:
        self.buf, self.pos, self.end, self.file_size, self.path = buf, pos, end, file_size, path

    @property
    def left(self) -> int:
        return self.end - self.pos

    def fail(
        self,
        message: str,
        *,
        offset: int | None = None,
        expected: str | None = None,
        hint: str = HINT_TRUNCATED,
    ) -> InvalidModelFile:
        return InvalidModelFile(
            message,
            path=self.path,
            offset=self.pos if offset is None else offset,
            expected=expected,
            hint=hint,
        )

    def short(
        self, message: str, *, offset: int | None = None, expected: str | None = None
    ) -> InvalidModelFile:
        """The error for "not enough bytes left": a truncated file, or metadata past max_metadata_bytes."""
        if self.end < self.file_size:
            return self.fail(
                f"metadata runs past the max_metadata_bytes limit of {self.end} bytes ({message})",
                offset=offset,
                expected=f"metadata within {self.end} bytes",
                hint="raise max_metadata_bytes if the file is trusted",
            )
        return self.fail(message, offset=offset, expected=expected)

    def need(self, num_bytes: int, what: str) -> None:
        if num_bytes > self.end - self.pos:
            raise self.short(
                f"truncated while reading {what}: needs {num_bytes} bytes, {self.left} left",
                expected=f"at least {num_bytes} more bytes",
            )

    def unpack(self, st: struct.Struct, what: str) -> Any:
        self.need(st.size, what)
        (value,) = st.unpack_from(self.buf, self.pos)
        self.pos += st.size
        return value

    def raw_string(self, what: str, max_bytes: int) -> bytes:
        start = self.pos
        length = self.unpack(U64, f"{what} length")
        if length > self.left:
            raise self.short(
                f"{what} length {length} exceeds the {self.left} bytes left",
                offset=start,
                expected=f"a length <= {self.left}",
            )
        if length > max_bytes:
            raise self.fail(
                f"{what} length {length} exceeds the limit of {max_bytes} bytes",
                offset=start,
                expected=f"a length <= {max_bytes}",
                hint="the file is corrupt or hostile",
            )
        data = self.buf[self.pos : self.pos + length]
        self.pos += length
        return data

    def name(self, what: str, max_bytes: int) -> str:
        """A key or tensor name: non-empty, strict UTF-8."""
        start = self.pos
        data = self.raw_string(what, max_bytes)
        if not data:
            raise self.fail(
                f"{what} is empty", offset=start, expected="a non-empty name", hint="the file is corrupt"
            )
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.fail(
                f"{what} is not valid UTF-8 ({exc.reason} at byte {exc.start}): {data[:64]!r}",
                offset=start,
                expected="a UTF-8 name",
                hint="the file is corrupt",
            ) from None

    def count(self, what: str, min_element_bytes: int, max_count: int | None = None) -> int:
        """A u64 element count, bounded by the bytes left before anything is allocated."""
        start = self.pos
        num = self.unpack(U64, f"{what} count")
        if max_count is not None and num > max_count:
            raise self.fail(
                f"{what} count {num} exceeds the limit of {max_count}",
                offset=start,
                expected=f"a count <= {max_count}",
                hint="the file is corrupt or hostile",
            )
        if num * min_element_bytes > self.left:
            raise self.short(
                f"{what} count {num} needs at least {num * min_element_bytes} bytes, {self.left} left",
                offset=start,
                expected=f"a count <= {self.left // min_element_bytes}",
            )
        return num


def decode_value_string(data: bytes, what: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        logger.warning("%s holds a string that is not valid UTF-8; kept with surrogate escapes", what)
        # Keep the bytes recoverable (str.encode("utf-8", "surrogateescape")) rather than fail a tokenizer.
        return data.decode("utf-8", "surrogateescape")


def read_value_type(cur: Cursor, what: str) -> GGUFValueType:
    start = cur.pos
    type_id = cur.unpack(U32, f"value type of {what}")
    try:
        return GGUFValueType(type_id)
    except ValueError:
        raise cur.fail(
            f"unknown value type {type_id} for {what}",
            offset=start,
            expected="a GGUF value type 0..12",
            hint="the file is corrupt",
        ) from None


def read_scalar(cur: Cursor, vtype: GGUFValueType, what: str) -> Any:
    if vtype is GGUFValueType.STRING:
        return decode_value_string(cur.raw_string(f"string value of {what}", cur.left), what)
    if vtype is GGUFValueType.BOOL:
        start = cur.pos
        byte = cur.unpack(_SCALAR_STRUCTS[GGUFValueType.UINT8], f"bool value of {what}")
        if byte > 1:
            raise cur.fail(
                f"bool value of {what} is {byte}", offset=start, expected="0 or 1", hint="the file is corrupt"
            )
        return bool(byte)
    return cur.unpack(_SCALAR_STRUCTS[vtype], f"value of {what}")


def read_string_array(cur: Cursor, num: int, what: str) -> list[str]:
    """Tight loop: tokenizer arrays hold 49k..262k strings."""
    buf, pos, end = cur.buf, cur.pos, cur.end
    unpack = U64.unpack_from
    out: list[str] = []
    append = out.append
    num_invalid = 0
    for index in range(num):
        if end - pos < 8:
            cur.pos = pos
            cur.need(8, f"length of string {index} of {what}")
        (length,) = unpack(buf, pos)
        pos += 8
        if length > end - pos:
            cur.pos = pos - 8
            raise cur.short(
                f"string {index} of {what}: string length {length} exceeds the {end - pos} bytes left",
                expected=f"a length <= {end - pos}",
            )
        data = buf[pos : pos + length]
        pos += length
        try:
            append(data.decode("utf-8"))
        except UnicodeDecodeError:
            num_invalid += 1
            append(data.decode("utf-8", "surrogateescape"))
    cur.pos = pos
    if num_invalid:
        logger.warning(
            "%s holds %d strings that are not valid UTF-8; kept with surrogate escapes", what, num_invalid
        )
    return out


def read_array(cur: Cursor, what: str, depth: int) -> Any:
    """Element type, count, elements. Numbers come back as a copied little-endian numpy array."""
    start = cur.pos
    elem_type = read_value_type(cur, f"array elements of {what}")
    if elem_type is GGUFValueType.ARRAY and depth + 1 >= MAX_ARRAY_DEPTH:
        raise cur.fail(
            f"{what} holds arrays nested deeper than {MAX_ARRAY_DEPTH} levels",
            offset=start,
            expected=f"at most {MAX_ARRAY_DEPTH} levels of arrays",
            hint="the file is corrupt or hostile",
        )
    num = cur.count(f"array of {what}", _MIN_ELEMENT_BYTES[elem_type])
    if elem_type is GGUFValueType.STRING:
        return read_string_array(cur, num, what)
    if elem_type is GGUFValueType.ARRAY:
        return [read_array(cur, f"{what}[{index}]", depth + 1) for index in range(num)]
    if elem_type is GGUFValueType.BOOL:
        raw = np.frombuffer(cur.buf, dtype=np.uint8, count=num, offset=cur.pos)
        if num and int(raw.max()) > 1:
            bad = int(np.argmax(raw > 1))
            raise cur.fail(
                f"bool element {bad} of {what} is {int(raw[bad])}",
                offset=cur.pos + bad,
                expected="0 or 1",
                hint="the file is corrupt",
            )
        cur.pos += num
        return raw.astype(np.bool_)
    dtype = _NUMPY_DTYPES[elem_type]
    values = np.frombuffer(cur.buf, dtype=dtype, count=num, offset=cur.pos).copy()
    cur.pos += num * dtype.itemsize
    return values
