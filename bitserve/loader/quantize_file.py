"""`bitserve quantize`: a GGUF's projections rewritten in llama.cpp's Q1_0 or Q2_0 (PrismML's Bonsai types),
every other tensor and every metadata key copied as they are.

Each projection (blk.N.attn_q / attn_k / attn_v / attn_output / ffn_gate / ffn_up / ffn_down) is decoded
to f32 by the reference decoders (kernels/reference/dequant.py: bit-exact with ggml's dequantize_row_*,
as llama.cpp's llama_model_quantize decodes a quantized source) and written by loader/low_bit_quantize.py
(ggml's quantize_row_q1_0_ref / quantize_row_q2_0_ref, bytes equal to llama.cpp's). So each rewritten
tensor is the bytes llama.cpp writes for it. Not llama.cpp's whole mix: its Q2_0 ftype also re-encodes the
embedding as Q4_K and the head as Q8_0, and falls back to Q4_0 for rows that are not whole blocks; here
those tensors keep their own type (listed in the result), so nothing is re-encoded twice.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bitserve.errors import UnsupportedModel
from bitserve.kernels.reference.dequant import dequantize
from bitserve.loader.decode import DecodeOptions, make_packed_weight
from bitserve.loader.gguf_reader import TensorInfo, read_gguf
from bitserve.loader.gguf_types import BLOCK_FORMATS, GGMLType
from bitserve.loader.gguf_writer import GGUFBuilder
from bitserve.loader.low_bit_quantize import QUANTIZERS

# llama.cpp's llama_ftype numbers for the files it writes in these types (llama.h: MOSTLY_Q1_0 / _Q2_0)
FILE_TYPES = {"Q1_0": 40, "Q2_0": 41}
PROJECTION = re.compile(r"^blk\.\d+\.(attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down)\.weight$")


@dataclass
class QuantizeResult:
    path: Path
    rewritten: list[str] = field(default_factory=list)  # tensors now in the target type
    kept: dict[str, str] = field(default_factory=dict)  # name -> why it kept its type


Encoder = Callable[[str, TensorInfo, np.ndarray], "tuple[int, bytes] | None"]


def rewrite_gguf(
    source: str | os.PathLike[str], target_path: str | os.PathLike[str], encode: Encoder, file_type: int
) -> None:
    """Write `target_path`: `source`'s keys (general.file_type set to `file_type`) and tensors, each as
    encode(name, info, bytes) gives it (type id, bytes), or as it is where encode returns None."""
    with read_gguf(source) as gguf:
        builder = GGUFBuilder(gguf.alignment)
        for key, value in gguf.metadata.items():
            if key in ("general.alignment", "general.file_type"):
                continue  # the builder writes the alignment where it is not 32; the file type below
            builder.add_kv(key, gguf.value_types[key], value, gguf.array_types.get(key))
        builder.add_uint32("general.file_type", file_type)
        for name, info in gguf.tensors.items():
            data = gguf.tensor_data(name)
            encoded = encode(name, info, data)
            type_id, payload = (info.type_id, data) if encoded is None else encoded
            builder.add_tensor(name, info.shape, type_id, payload)
        builder.write(Path(target_path))


def quantize_gguf(
    source: str | os.PathLike[str], target_path: str | os.PathLike[str], target: str
) -> QuantizeResult:
    """Write `target_path`: `source` with its projections in `target` ("Q1_0" or "Q2_0")."""
    if target not in QUANTIZERS:
        raise ValueError(f"target type {target!r}: one of {', '.join(QUANTIZERS)}")
    block = BLOCK_FORMATS[GGMLType[target]].block_size
    result = QuantizeResult(Path(target_path))
    with read_gguf(source) as gguf:
        for name, info in gguf.tensors.items():
            reason = _why_kept(name, info.shape, info.ggml_type, block, target)
            if reason:
                result.kept[name] = reason
            else:
                result.rewritten.append(name)
    if not result.rewritten:
        raise UnsupportedModel(
            f"{source}: no projection could be written as {target}",
            hint=f"{target} needs projections whose rows are whole {block}-value blocks",
        )
    rewritten = set(result.rewritten)

    def encode(name: str, info: TensorInfo, data: np.ndarray) -> tuple[int, bytes] | None:
        if name not in rewritten:
            return None
        values = dequantize(make_packed_weight(info, data, options=DecodeOptions())).numpy()  # f32 [M, K]
        return int(GGMLType[target]), QUANTIZERS[target](values).tobytes()

    rewrite_gguf(source, result.path, encode, FILE_TYPES[target])
    return result


def _why_kept(name: str, shape: tuple[int, ...], ggml_type: GGMLType, block: int, target: str) -> str | None:
    """Why a tensor keeps its type, or None when it is rewritten."""
    if not PROJECTION.match(name):
        return "not a projection"
    if len(shape) != 2:
        return f"{len(shape)}-d"
    if shape[0] % block:
        return f"rows of {shape[0]} values are not whole {block}-value {target} blocks"
    if ggml_type.name == target:
        return f"already {target}"
    return None
