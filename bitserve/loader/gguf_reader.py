"""bitserve's own GGUF parser: mmap-backed, every count and length checked against the bytes left first.

`read_gguf` returns a `GGUFFile` (metadata, tensor table, zero-copy tensor views); `validate.py` does the
structure checks and dialect detection (docs/formats.md §1.1-1.3). Choices where readers differ: n_dims 0
is a scalar (as in ggml), ne = 0 is legal, arrays may nest one level (as gguf-py writes), keys and tensor
names must be UTF-8 while string values that are not are kept with surrogate escapes (and logged).
"""

from __future__ import annotations

import logging
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

import numpy as np

from bitserve.errors import InvalidModelFile, UnsupportedModel
from bitserve.loader import validate
from bitserve.loader.gguf_cursor import (
    I32,
    I64,
    U32,
    U64,
    Cursor,
    read_array,
    read_scalar,
    read_value_type,
)
from bitserve.loader.gguf_types import Dialect, GGMLType, GGUFValueType, pad_to

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_KV_PAIRS = 1 << 16
MAX_TENSORS = 1 << 17
MAX_KEY_BYTES = 1 << 16
# ggml itself caps names at 63 bytes; we accept longer ones but bound them.
MAX_TENSOR_NAME_BYTES = 1 << 12
MAX_DIMS = 4
_MAX_INT64 = (1 << 63) - 1
_MIN_KV_BYTES = 8 + 1 + 4 + 1  # key length, 1-byte key, value type, 1-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 1 + 4 + 4 + 8  # name length, 1-byte name, n_dims (0), type, offset


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml order: ne[0] (innermost, K for a matrix) first; () for a 0-dim scalar
    type_id: int  # the number in the file
    ggml_type: GGMLType  # resolved under the file's dialect
    offset: int  # relative to the data section, as stored
    file_offset: int  # absolute offset in the file
    nbytes: int  # from our own size formula (tensor_nbytes)

    @property
    def num_elements(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count


@dataclass(slots=True)
class _Metadata:
    values: dict[str, Any]
    value_types: dict[str, GGUFValueType]
    array_types: dict[str, GGUFValueType]  # element type of each ARRAY key
    key_offsets: dict[str, int]  # file offset of each key's record, for messages


def _read_kv_pairs(cur: Cursor, num_kv: int) -> _Metadata:
    metadata: dict[str, Any] = {}
    value_types: dict[str, GGUFValueType] = {}
    array_types: dict[str, GGUFValueType] = {}
    key_offsets: dict[str, int] = {}
    for index in range(num_kv):
        start = cur.pos
        key = cur.name(f"key {index}", MAX_KEY_BYTES)
        if key in metadata:
            raise cur.fail(
                f"duplicate key {key!r}", offset=start, expected="unique keys", hint="the file is corrupt"
            )
        what = f"key {key!r}"
        vtype = read_value_type(cur, what)
        key_offsets[key] = start
        if vtype is GGUFValueType.ARRAY:
            elem_type_offset = cur.pos
            metadata[key] = read_array(cur, what, 0)
            # read_array has validated the element type stored there
            array_types[key] = GGUFValueType(U32.unpack_from(cur.buf, elem_type_offset)[0])
        else:
            metadata[key] = read_scalar(cur, vtype, what)
        value_types[key] = vtype
    return _Metadata(metadata, value_types, array_types, key_offsets)


def _read_tensor_info(cur: Cursor, index: int) -> validate.RawTensor:
    record_offset = cur.pos
    name = cur.name(f"name of tensor {index}", MAX_TENSOR_NAME_BYTES)
    what = f"tensor {name!r}"
    dims_offset = cur.pos
    n_dims = cur.unpack(U32, f"n_dims of {what}")
    if n_dims > MAX_DIMS:
        raise cur.fail(
            f"{what} has n_dims {n_dims}",
            offset=dims_offset,
            expected=f"n_dims <= {MAX_DIMS}",
            hint="the file is corrupt",
        )
    cur.need(8 * n_dims, f"ne of {what}")
    shape = tuple(I64.unpack_from(cur.buf, cur.pos + 8 * i)[0] for i in range(n_dims))
    num_elements = 1
    for i, dim in enumerate(shape):
        if dim < 0:
            raise cur.fail(
                f"{what} has negative ne[{i}] = {dim}",
                offset=cur.pos + 8 * i,
                expected="ne >= 0",
                hint="the file is corrupt",
            )
        num_elements *= dim
    if num_elements > _MAX_INT64:
        raise cur.fail(
            f"{what} element count of shape {list(shape)} overflows int64",
            offset=cur.pos,
            expected="a product of ne below 2**63",
            hint="the file is corrupt",
        )
    cur.pos += 8 * n_dims
    type_offset = cur.pos
    type_id = cur.unpack(I32, f"type of {what}")
    offset = cur.unpack(U64, f"data offset of {what}")
    return validate.RawTensor(name, shape, type_id, offset, record_offset, type_offset)


def _read_tensor_infos(cur: Cursor, num_tensors: int) -> list[validate.RawTensor]:
    if num_tensors * _MIN_TENSOR_INFO_BYTES > cur.left:
        raise cur.short(
            f"tensor count {num_tensors} needs at least {num_tensors * _MIN_TENSOR_INFO_BYTES} "
            f"bytes of tensor infos, {cur.left} left",
            expected="a count that fits the file",
        )
    raw: list[validate.RawTensor] = []
    names: set[str] = set()
    for index in range(num_tensors):
        record = _read_tensor_info(cur, index)
        if record.name in names:
            raise cur.fail(
                f"duplicate tensor name {record.name!r}",
                offset=record.record_offset,
                expected="unique tensor names",
                hint="the file is corrupt",
            )
        names.add(record.name)
        raw.append(record)
    return raw


def _read_alignment(cur: Cursor, meta: _Metadata) -> int:
    key = "general.alignment"
    if key not in meta.values:
        return DEFAULT_ALIGNMENT
    vtype = meta.value_types[key]
    if vtype is not GGUFValueType.UINT32:
        raise cur.fail(
            f"general.alignment must be UINT32 but is {vtype.name}",
            offset=meta.key_offsets[key],
            expected="a UINT32 alignment",
            hint="the file is corrupt",
        )
    alignment = meta.values[key]
    if alignment == 0 or alignment & (alignment - 1):
        raise cur.fail(
            f"general.alignment {alignment} is not a power of two",
            offset=meta.key_offsets[key],
            expected="a nonzero power of two",
            hint="the file is corrupt",
        )
    return alignment


def _read_header(cur: Cursor) -> tuple[int, int, int]:
    """Magic, version, tensor and kv counts; counts are bounded against the bytes left."""
    _read_magic(cur)
    version = _read_version(cur)
    num_tensors, num_kv = _read_counts(cur)
    return version, num_tensors, num_kv


def _read_magic(cur: Cursor) -> None:
    """The 4-byte magic at offset 0; InvalidModelFile when it is not b'GGUF'."""
    cur.need(4, "magic")
    magic = cur.buf[0:4]
    if magic != GGUF_MAGIC:
        raise cur.fail(
            f"bad magic {magic!r}",
            offset=0,
            expected="b'GGUF'",
            hint="this is not a GGUF file (or it is damaged)",
        )
    cur.pos = 4


def _read_version(cur: Cursor) -> int:
    """The format version (2 or 3); a big-endian file, version 1 and newer versions are refused."""
    version = cur.unpack(U32, "version")
    if version and not version & 0xFFFF:
        raise cur.fail(
            f"version reads {version:#010x}: a big-endian GGUF file",
            offset=4,
            expected="a little-endian file",
            hint="convert the model again as little-endian",
        )
    if version == 1:
        raise UnsupportedModel(
            "GGUF version 1 is not supported",
            path=cur.path,
            offset=4,
            expected="version 2 or 3",
            hint="re-convert the model with a current converter",
        )
    if version not in SUPPORTED_VERSIONS:
        if version > SUPPORTED_VERSIONS[-1]:
            raise UnsupportedModel(
                f"unsupported GGUF version {version}",
                path=cur.path,
                offset=4,
                expected="version 2 or 3",
                hint="a GGUF version newer than bitserve reads",
            )
        raise cur.fail(
            f"unsupported GGUF version {version}",
            offset=4,
            expected="version 2 or 3",
            hint="the file is corrupt",
        )
    return version


def _read_counts(cur: Cursor) -> tuple[int, int]:
    """The tensor and key-value counts, each capped, and together bounded against the bytes left."""
    counts = []
    for what, cap in (("tensor count", MAX_TENSORS), ("key-value count", MAX_KV_PAIRS)):
        start = cur.pos
        num = cur.unpack(I64, what)
        if num < 0:
            raise cur.fail(
                f"negative {what} {num}", offset=start, expected="a count >= 0", hint="the file is corrupt"
            )
        if num > cap:
            raise cur.fail(
                f"{what} {num} exceeds the limit of {cap}",
                offset=start,
                expected=f"a count <= {cap}",
                hint="the file is corrupt or hostile",
            )
        counts.append(num)
    num_tensors, num_kv = counts
    min_bytes = num_tensors * _MIN_TENSOR_INFO_BYTES + num_kv * _MIN_KV_BYTES
    if min_bytes > cur.left:
        raise cur.short(
            f"tensor count {num_tensors} and key-value count {num_kv} need at least {min_bytes} "
            f"bytes, {cur.left} left",
            offset=8,
            expected="counts that fit the file",
        )
    return num_tensors, num_kv


class GGUFFile:
    """A parsed GGUF file over a read-only mmap. Metadata is copied; tensor data are views."""

    def __init__(
        self,
        path: str,
        mm: mmap.mmap,
        file_size: int,
        max_metadata_bytes: int | None,
        fd: int | None = None,
    ) -> None:
        self.path = path
        self._mm: mmap.mmap | None = mm
        self._fd = fd  # the same open file as the mapping, for read_rows; owned (closed by close())
        self._whole: torch.Tensor | None = None  # the mapping as one torch tensor (tensor_bytes)
        self.file_size = file_size
        end = file_size if max_metadata_bytes is None else min(file_size, max_metadata_bytes)
        cur = Cursor(mm, 0, end, file_size, path)
        self.version, num_tensors, num_kv = _read_header(cur)
        meta = _read_kv_pairs(cur, num_kv)
        self.metadata: dict[str, Any] = meta.values
        self.value_types: dict[str, GGUFValueType] = meta.value_types
        self.array_types: dict[str, GGUFValueType] = meta.array_types
        self.alignment = _read_alignment(cur, meta)
        raw = _read_tensor_infos(cur, num_tensors)
        self.data_offset = pad_to(cur.pos, self.alignment)
        if raw and self.data_offset > file_size:
            raise cur.fail(
                f"file ends at byte {file_size}, before the data section at {self.data_offset}",
                offset=file_size,
                expected=f"a file of at least {self.data_offset} bytes",
            )
        self.dialect, self.tensors = self._check_tensors(raw)
        logger.debug(
            "%s: GGUF v%d, %d keys, %d tensors, data at %d",
            path,
            self.version,
            num_kv,
            num_tensors,
            self.data_offset,
        )

    def _check_tensors(self, raw: list[validate.RawTensor]) -> tuple[Dialect, dict[str, TensorInfo]]:
        data_size = max(0, self.file_size - self.data_offset)
        arch = self.metadata.get("general.architecture")
        validate.check_offsets(raw, self.alignment, data_size, self.data_offset, self.path)
        dialect = validate.detect_dialect(
            raw, arch if isinstance(arch, str) else None, self.alignment, data_size, self.path
        )
        sized = validate.size_tensors(raw, dialect, self.path)
        validate.check_extents(raw, [n for _, n in sized], data_size, self.data_offset, self.path)
        validate.log_format_hints(self.metadata, raw, dialect, self.path)
        tensors = {
            r.name: TensorInfo(
                r.name, r.shape, r.type_id, ggml_type, r.offset, self.data_offset + r.offset, nbytes
            )
            for r, (ggml_type, nbytes) in zip(raw, sized, strict=True)
        }
        return dialect, tensors

    def tensor_data(self, name: str) -> np.ndarray:
        """uint8 [nbytes], a read-only zero-copy view over the mmap."""
        if self._mm is None:
            raise RuntimeError(f"{self.path}: GGUFFile is closed")
        info = self.tensors.get(name)
        if info is None:
            raise InvalidModelFile(
                f"tensor {name!r} is not in the file",
                path=self.path,
                expected="a tensor the model needs",
                hint="the file is incomplete or was converted for another architecture",
            )
        return np.frombuffer(self._mm, dtype=np.uint8, count=info.nbytes, offset=info.file_offset)

    def tensor_bytes(self, name: str) -> torch.Tensor:
        """uint8 [nbytes] of a tensor as a torch view over the mapping. Every tensor is a slice of one
        whole-file tensor (made on first use), so weights read in place share one storage (a backend may
        stack them without a copy)."""
        from bitserve.loader.byte_views import as_uint8_tensor  # torch only for the loader, not for inspect

        if self._whole is None:
            self._whole = as_uint8_tensor(self.file_bytes())
        info = self.tensors[name]
        return self._whole[info.file_offset : info.file_offset + info.nbytes]

    def file_bytes(self) -> np.ndarray:
        """uint8 [file_size], a read-only zero-copy view of the whole mapping. Tensors sliced from one
        such view share its buffer, so a backend can address several of them through one array."""
        if self._mm is None:
            raise RuntimeError(f"{self.path}: GGUFFile is closed")
        return np.frombuffer(self._mm, dtype=np.uint8)

    def release_pages(self, name: str) -> None:
        """Drop the resident pages of a tensor the caller copied out and will not read again.

        The mapping stays valid (a later read faults the pages back in); only whole pages inside the
        tensor are released, so neighbouring tensors that are still in use keep theirs.
        """
        if self._mm is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        info = self.tensors[name]
        start = -(-info.file_offset // mmap.PAGESIZE) * mmap.PAGESIZE
        end = (info.file_offset + info.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
        if end > start:
            self._mm.madvise(mmap.MADV_DONTNEED, start, end - start)

    def read_rows(self, name: str, row_ids: Sequence[int], row_bytes: int) -> np.ndarray:
        """uint8 [len(row_ids), row_bytes]: rows of a tensor read from the file (pread), not through the
        mapping. For a table whose pages were released: a fault in the mapping maps the whole page-cache
        folio around it (measured on Linux 6.18, ext4: ~1 MB for each 5 KB row of 2B-4T's F16 table, 400
        rows -> 400 MB resident), where pread copies only the row."""
        info = self.tensors[name]
        if self._fd is None:
            raise RuntimeError(f"{self.path}: GGUFFile has no file descriptor to read rows with")
        num_rows = info.nbytes // row_bytes
        out = np.empty((len(row_ids), row_bytes), dtype=np.uint8)
        for index, row in enumerate(row_ids):
            if not 0 <= row < num_rows:
                raise IndexError(f"row {row} of {name!r} is outside [0, {num_rows})")
            data = os.pread(self._fd, row_bytes, info.file_offset + row * row_bytes)
            if len(data) != row_bytes:  # the file shrank under us
                raise InvalidModelFile(f"short read of {name!r} row {row}", path=self.path)
            out[index] = np.frombuffer(data, dtype=np.uint8)
        return out

    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str) or not arch:
            raise InvalidModelFile(
                "general.architecture is missing or not a string",
                path=self.path,
                expected="a STRING general.architecture",
                hint="the file lacks the key every GGUF model must carry",
            )
        return arch

    def close(self) -> None:
        """Release the mapping; tensor views still alive keep it mapped until they are dropped."""
        mm, self._mm = self._mm, None
        self._whole = None
        if mm is not None:
            _close_quietly(mm)
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def read_gguf(path: str | os.PathLike[str], *, max_metadata_bytes: int | None = None) -> GGUFFile:
    """Parse and validate a GGUF file. Every problem raises InvalidModelFile (UnsupportedModel if well
    formed)."""
    path_str = os.fspath(path)
    try:
        with open(path_str, "rb") as fh:
            file_size = os.fstat(fh.fileno()).st_size
            if file_size == 0:
                raise InvalidModelFile(
                    "empty file",
                    path=path_str,
                    offset=0,
                    expected="a GGUF header",
                    hint="the download or conversion did not finish",
                )
            mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            try:
                fd = os.dup(fh.fileno())
            except OSError:
                _close_quietly(mm)
                raise
    except OSError as exc:
        raise InvalidModelFile(
            f"cannot open: {exc.strerror or exc}", path=path_str, hint="check the path and its permissions"
        ) from exc
    try:
        return GGUFFile(path_str, mm, len(mm), max_metadata_bytes, fd)
    except BaseException:
        _close_quietly(mm)
        os.close(fd)
        raise


def _close_quietly(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except BufferError:
        # A view made while parsing is still referenced (e.g. by a traceback); it unmaps when freed.
        pass
