"""Structure checks for a parsed GGUF tensor table: dialect detection, sizes, alignment, overlaps.

Dialect detection follows docs/formats.md §1.3.

Works on `RawTensor` records (what the file says) and decides nothing from metadata except the
architecture name; `general.file_type` and chat-template hints are only logged.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from bitserve.errors import InvalidModelFile, UnsupportedModel
from bitserve.loader.gguf_types import (
    MXFP4_FILE_ID,
    Dialect,
    GGMLType,
    pad_to,
    resolve_type,
    tensor_nbytes,
)

logger = logging.getLogger(__name__)

# Architecture names only the bitnet.cpp fork writes; they fix the fork dialect (docs/formats.md §1.3 step 2).
FORK_ARCHITECTURES = frozenset({"bitnet-b1.58", "bitnet-25"})
I8_S_FILE_ID = 37
FORK_ONLY_IDS = frozenset({36, 38})
_HINT_CORRUPT = "the file is truncated or corrupt; re-download it or re-run the converter"


@dataclass(frozen=True, slots=True)
class RawTensor:
    """One tensor-info record as stored; `record_offset` / `type_offset` are file offsets for messages."""

    name: str
    shape: tuple[int, ...]
    type_id: int
    offset: int
    record_offset: int
    type_offset: int


def sizing_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape used for sizing: a 0-dim record is a scalar, sized as ne = (1,) like ggml does."""
    return shape if shape else (1,)


def check_offsets(
    tensors: Sequence[RawTensor], alignment: int, data_size: int, data_offset: int, path: str
) -> None:
    """Alignment and start-within-data checks; they need no sizes, so they run before dialect detection."""
    for t in tensors:
        if t.offset % alignment:
            raise InvalidModelFile(
                f"tensor {t.name!r} data offset {t.offset} is not a multiple of the alignment {alignment}",
                path=path,
                offset=t.record_offset,
                expected=f"an offset divisible by {alignment}",
                hint=_HINT_CORRUPT,
            )
        if t.offset > data_size:
            raise InvalidModelFile(
                f"tensor {t.name!r} data offset {t.offset} (file offset {data_offset + t.offset}) "
                f"is past the end of the data section ({data_size} bytes)",
                path=path,
                offset=t.record_offset,
                expected=f"an offset <= {data_size}",
                hint=_HINT_CORRUPT,
            )


def _stored_extents(tensors: Sequence[RawTensor], data_size: int) -> list[tuple[int, bool]]:
    """Per tensor: bytes from its offset to the next larger stored offset (or the data end), and is-last."""
    distinct = sorted({t.offset for t in tensors})
    next_of = dict(pairwise(distinct))
    result = []
    for t in tensors:
        nxt = next_of.get(t.offset)
        result.append((data_size - t.offset, True) if nxt is None else (nxt - t.offset, False))
    return result


def _need(ggml_type: GGMLType, shape: tuple[int, ...], alignment: int) -> int | None:
    """Bytes a reading needs, rounded up to the alignment, or None when the shape cannot be that type."""
    try:
        nbytes = tensor_nbytes(ggml_type, sizing_shape(shape))
    except ValueError:
        return None
    return pad_to(nbytes, alignment) if nbytes >= 0 else None


def _fits(extent: int, is_last: bool, need: int | None) -> bool:
    if need is None:
        return False
    return extent >= need if is_last else extent == need


def detect_dialect(
    tensors: Sequence[RawTensor], architecture: str | None, alignment: int, data_size: int, path: str
) -> Dialect:
    """docs/formats.md §1.3: type 37 rejects, 36/38 or a fork arch name pick the fork, type 39 is
    decided by extents."""
    for t in tensors:
        if t.type_id == I8_S_FILE_ID:
            raise UnsupportedModel(
                f"tensor {t.name!r} has type 37 (bitnet.cpp I8_S), an activation type that is never valid "
                "in a file",
                path=path,
                offset=t.type_offset,
                expected="a weight storage type",
                hint="re-convert the model with bitnet.cpp (I2_S) or llama.cpp (TQ1_0/TQ2_0)",
            )
    if architecture in FORK_ARCHITECTURES or any(t.type_id in FORK_ONLY_IDS for t in tensors):
        return Dialect.BITNET_CPP
    extents = _stored_extents(tensors, data_size)
    type39 = [(t, ext) for t, ext in zip(tensors, extents, strict=True) if t.type_id == MXFP4_FILE_ID]
    if not type39:
        return Dialect.UPSTREAM
    verdicts = []
    for t, (extent, is_last) in type39:
        tl2_need = _need(GGMLType.TL2, t.shape, alignment)
        mx_need = _need(GGMLType.MXFP4, t.shape, alignment)
        verdict = (_fits(extent, is_last, tl2_need), _fits(extent, is_last, mx_need))
        if verdict == (False, False):
            raise InvalidModelFile(
                f"tensor {t.name!r} has type 39 and a stored extent of {extent} bytes, which fits neither "
                f"TL2 (bitnet.cpp, needs {tl2_need}) nor MXFP4 (upstream, needs {mx_need})",
                path=path,
                offset=t.record_offset,
                expected="an extent matching one reading of type 39",
                hint=_HINT_CORRUPT,
            )
        verdicts.append(verdict)
    is_tl2 = all(v[0] for v in verdicts)
    is_mxfp4 = all(v[1] for v in verdicts)
    if is_tl2 != is_mxfp4:
        logger.debug("%s: type 39 read as %s from stored extents", path, "TL2" if is_tl2 else "MXFP4")
        return Dialect.BITNET_CPP if is_tl2 else Dialect.UPSTREAM
    first = type39[0][0]
    raise InvalidModelFile(
        f"type-39 tensors (first: {first.name!r}) are ambiguous: their stored extents are consistent with "
        "both or, tensor by tensor, with different readings of TL2 (bitnet.cpp) and MXFP4 (upstream)",
        path=path,
        offset=first.record_offset,
        expected="extents that fit exactly one of TL2 or MXFP4",
        hint="the file mixes conventions or is corrupt; re-convert it",
    )


def size_tensors(tensors: Sequence[RawTensor], dialect: Dialect, path: str) -> list[tuple[GGMLType, int]]:
    """Resolve each type id under `dialect` and size it with our own formulas."""
    result = []
    for t in tensors:
        try:
            ggml_type = resolve_type(t.type_id, dialect)
        except ValueError as exc:
            raise UnsupportedModel(
                f"tensor {t.name!r}: {exc}",
                path=path,
                offset=t.type_offset,
                expected="a tensor type bitserve decodes",
                hint="re-quantize the model to a supported type (F32/F16/BF16, Q4_0..Q8_0, K-quants, "
                "TQ1_0/TQ2_0, I2_S, TL1/TL2)",
            ) from None
        if ggml_type is GGMLType.MXFP4:
            raise UnsupportedModel(
                f"tensor {t.name!r}: unsupported tensor type MXFP4 (id 39, upstream dialect)",
                path=path,
                offset=t.type_offset,
                expected="a tensor type bitserve decodes",
                hint="bitserve does not decode MXFP4; re-quantize the model",
            )
        try:
            nbytes = tensor_nbytes(ggml_type, sizing_shape(t.shape))
        except ValueError as exc:
            raise InvalidModelFile(
                f"tensor {t.name!r} ({ggml_type.name}) has shape {list(t.shape)}: {exc}",
                path=path,
                offset=t.record_offset,
                expected=f"a shape that fits {ggml_type.name}'s block size",
                hint=_HINT_CORRUPT,
            ) from None
        if nbytes < 0:
            raise InvalidModelFile(
                f"tensor {t.name!r} ({ggml_type.name}) shape {list(t.shape)} gives a negative size {nbytes}",
                path=path,
                offset=t.record_offset,
                expected="a shape the format can hold",
                hint=_HINT_CORRUPT,
            )
        result.append((ggml_type, nbytes))
    return result


def check_extents(
    tensors: Sequence[RawTensor], sizes: Sequence[int], data_size: int, data_offset: int, path: str
) -> None:
    """Every tensor inside the data section, no two overlapping; gaps are legal (TL hidden scale slots)."""
    for t, nbytes in zip(tensors, sizes, strict=True):
        if t.offset + nbytes > data_size:
            raise InvalidModelFile(
                f"tensor {t.name!r} ({nbytes} bytes at data offset {t.offset}) extends past the end of the "
                f"data section ({data_size} bytes, file ends at {data_offset + data_size})",
                path=path,
                offset=t.record_offset,
                expected=f"offset + size <= {data_size}",
                hint=_HINT_CORRUPT,
            )
    spans = sorted(
        (t.offset, t.offset + n, t.name, t.record_offset)
        for t, n in zip(tensors, sizes, strict=True)
        if n > 0
    )
    for (_, prev_end, prev_name, _), (start, _, name, record_offset) in pairwise(spans):
        if start < prev_end:
            raise InvalidModelFile(
                f"tensor {name!r} (data offset {start}) overlaps tensor {prev_name!r}, "
                f"which ends at {prev_end}",
                path=path,
                offset=record_offset,
                expected=f"a data offset >= {prev_end}",
                hint=_HINT_CORRUPT,
            )


def log_format_hints(
    metadata: Mapping[str, Any], tensors: Sequence[RawTensor], dialect: Dialect, path: str
) -> None:
    """Log what the file claims about itself; none of it decides anything (docs/formats.md §1.3)."""
    file_type = metadata.get("general.file_type")
    if file_type is not None:
        logger.info(
            "%s: general.file_type = %s (informational; ids differ between dialects)", path, file_type
        )
    template = metadata.get("tokenizer.chat_template")
    if isinstance(template, str) and "BITNET" in template:
        logger.info("%s: chat template contains the BitNet converter's 'BITNET' placeholder", path)
    if metadata.get("general.architecture") == "llama" and any(t.type_id == 36 for t in tensors):
        logger.info(
            "%s: arch 'llama' with I2_S tensors (a ternary Llama/Falcon from the fork's quantizer)", path
        )
    logger.debug("%s: dialect %s", path, dialect.value)
