"""The safetensors files of a Hugging Face checkpoint directory, mapped read-only: tensors are torch views
over the mappings (no copy), found by name across shards (`model.safetensors`, or the shards a
`model.safetensors.index.json` names).

The format is an 8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets}}
and the data section; offsets are relative to the data section. The header is parsed here rather than
through the `safetensors` library because that library copies every tensor it returns (a 2B checkpoint
would then sit in memory twice); every field is checked as a hostile file's would be (sizes, bounds,
overlaps, shard names), and tests compare the tensors with `safetensors.torch.load_file`'s.
"""

from __future__ import annotations

import json
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import torch

from bitserve.loader.byte_views import as_uint8_tensor
from bitserve.loader.checkpoint_dir import fail as _fail
from bitserve.loader.checkpoint_dir import shard_names

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own bound
DTYPES: dict[str, torch.dtype] = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F64": torch.float64,
}


@dataclass(frozen=True, slots=True)
class StoredTensor:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    shard: int  # index into SafetensorsDir's shards
    start: int  # absolute byte offset in the shard file
    nbytes: int


@dataclass
class _Shard:
    path: Path
    mm: mmap.mmap
    fd: int
    whole: torch.Tensor  # uint8 [file size] over the mapping: tensors are slices of it


def _check_entry(
    path: Path, name: str, entry: Any, data_size: int
) -> tuple[torch.dtype, tuple[int, ...], int, int]:
    """One header entry -> (dtype, shape, begin, end) relative to the data section, every field checked."""
    if not isinstance(entry, dict):
        raise _fail(path, f"header entry {name!r} is not an object")
    dtype = DTYPES.get(entry.get("dtype"))  # type: ignore[arg-type]
    if dtype is None:
        raise _fail(path, f"tensor {name!r}: dtype {entry.get('dtype')!r} is not one of {', '.join(DTYPES)}")
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not isinstance(shape, list) or not all(isinstance(d, int) and 0 <= d < 1 << 40 for d in shape):
        raise _fail(path, f"tensor {name!r}: shape {shape!r} is not a list of sizes")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
        raise _fail(path, f"tensor {name!r}: data_offsets {offsets!r} is not [begin, end]")
    begin, end = offsets
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if not 0 <= begin <= end <= data_size or end - begin != count * dtype.itemsize:
        raise _fail(
            path,
            f"tensor {name!r}: bytes [{begin}, {end}) do not hold {shape} {entry['dtype']} values inside the "
            f"{data_size}-byte data section",
        )
    return dtype, tuple(shape), begin, end


def _parse_header(path: Path, mm: mmap.mmap, shard: int) -> dict[str, StoredTensor]:
    if len(mm) < 8:
        raise _fail(path, "shorter than the 8-byte header length")
    header_bytes = int.from_bytes(mm[:8], "little")
    if header_bytes > min(MAX_HEADER_BYTES, len(mm) - 8):
        raise _fail(
            path, f"header of {header_bytes} bytes does not fit the file (or the {MAX_HEADER_BYTES} bound)"
        )
    try:
        header = json.loads(mm[8 : 8 + header_bytes])
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _fail(path, f"malformed header JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise _fail(path, "the header is not a JSON object")
    data_start = 8 + header_bytes
    tensors: dict[str, StoredTensor] = {}
    spans: list[tuple[int, int, str]] = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, begin, end = _check_entry(path, name, entry, len(mm) - data_start)
        tensors[name] = StoredTensor(name, dtype, shape, shard, data_start + begin, end - begin)
        spans.append((begin, end, name))
    spans.sort()
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:], strict=False):
        if begin < end:
            raise _fail(path, f"tensors {first!r} and {second!r} overlap")
    return tensors


class SafetensorsDir:
    """Every tensor of a checkpoint directory's safetensors shards, by name; close() unmaps them."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self._shards: list[_Shard] = []
        self.tensors: dict[str, StoredTensor] = {}
        try:
            for index, name in enumerate(shard_names(self.directory)):
                self._open_shard(self.directory / name, index)
        except BaseException:
            self.close()
            raise

    def _open_shard(self, path: Path, index: int) -> None:
        try:
            with open(path, "rb") as handle:
                if os.fstat(handle.fileno()).st_size == 0:
                    raise _fail(path, "empty file")
                mm = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
                fd = os.dup(handle.fileno())
        except OSError as exc:
            raise _fail(
                path, f"cannot open: {exc.strerror or exc}", "check the path and its permissions"
            ) from exc
        whole = as_uint8_tensor(np.frombuffer(mm, dtype=np.uint8))  # read-only view; never written
        self._shards.append(_Shard(path, mm, fd, whole))
        for name, stored in _parse_header(path, mm, index).items():
            if name in self.tensors:
                raise _fail(
                    path, f"tensor {name!r} is also in {self._shards[self.tensors[name].shard].path.name}"
                )
            self.tensors[name] = stored

    def raw(self, name: str) -> torch.Tensor:
        """uint8 [nbytes]: the tensor's bytes, a view over the mapping."""
        stored = self.tensors[name]
        return self._shards[stored.shard].whole[stored.start : stored.start + stored.nbytes]

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor in its stored dtype and shape, a view over the mapping (do not write to it)."""
        stored = self.tensors[name]
        return self.raw(name).view(stored.dtype).reshape(stored.shape)

    def release_pages(self, name: str) -> None:
        """Give back the resident pages wholly inside the tensor (see GGUFFile.release_pages)."""
        stored = self.tensors[name]
        shard = self._shards[stored.shard]
        start = -(-stored.start // mmap.PAGESIZE) * mmap.PAGESIZE
        end = (stored.start + stored.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
        if end > start and hasattr(mmap, "MADV_DONTNEED"):
            shard.mm.madvise(mmap.MADV_DONTNEED, start, end - start)

    def pread(self, name: str, offset: int, count: int) -> bytes:
        """count bytes of the tensor from offset, read from the file (not through the mapping)."""
        stored = self.tensors[name]
        if not 0 <= offset <= offset + count <= stored.nbytes:
            raise IndexError(f"bytes [{offset}, {offset + count}) are outside {name!r}")
        data = os.pread(self._shards[stored.shard].fd, count, stored.start + offset)
        if len(data) != count:
            raise _fail(self._shards[stored.shard].path, f"short read of {name!r}")
        return data

    def close(self) -> None:
        shards, self._shards = self._shards, []
        for shard in shards:
            del shard.whole
            try:
                shard.mm.close()
            except BufferError:
                pass  # a view is still referenced; the mapping goes when it is freed
            os.close(shard.fd)

    def __enter__(self) -> SafetensorsDir:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
