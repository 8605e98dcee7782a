"""GGUF tensor bytes -> PackedWeight in its file layout: shape, layout tag and the options the bytes omit.

Wraps the bytes without copying; decoding proper lives in `bitserve.kernels.reference.dequant` (the reference)
and in each backend's `prepare_weight`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from bitserve.errors import InvalidModelFile, UnsupportedModel
from bitserve.kernels.packed import Layout, PackedWeight
from bitserve.kernels.reference.dequant import I2S_VARIANTS, i2s_geometry_error, tl_geometry_error
from bitserve.loader.byte_views import as_uint8_tensor  # noqa: F401 - re-exported
from bitserve.loader.tl_config import TLConfigTable

if TYPE_CHECKING:
    from bitserve.loader.gguf_reader import TensorInfo

logger = logging.getLogger(__name__)

_TL_HINT = (
    "pass a kernel_config.ini sidecar (<model>.kernel_config.ini) or a preset name; TL files do not record "
    "their tiling"
)


@dataclass(frozen=True, slots=True)
class DecodeOptions:
    """What the bytes do not say: the I2_S packing variant ('A', 'B' or 'C') and the TL tile table."""

    i2s_variant: str = "A"
    tl_configs: TLConfigTable | None = None

    def __post_init__(self) -> None:
        if self.i2s_variant not in I2S_VARIANTS:
            raise ValueError(f"i2s_variant must be one of {I2S_VARIANTS}, got {self.i2s_variant!r}")


def matrix_shape(ggml_shape: tuple[int, ...]) -> tuple[int, int]:
    """(M, K) from ggml ne: (K, M) -> (M, K); (n,) -> (1, n); () -> (1, 1); (K, a, b, ...) -> (a*b*..., K).

    Higher dims fold into rows, which is how the row-major data lies; callers reshape.
    """
    if not ggml_shape:
        return (1, 1)
    num_rows = 1
    for dim in ggml_shape[1:]:
        num_rows *= dim
    return (num_rows, ggml_shape[0])


def _tl_params(info: TensorInfo, shape: tuple[int, int], options: DecodeOptions) -> dict[str, int]:
    kind = info.ggml_type.name
    table = options.tl_configs
    source = table.source if table is not None else "(no TL config given)"
    tile = table.get(shape) if table is not None else None
    if tile is None:
        raise InvalidModelFile(
            f"{kind} tensor {info.name} has shape (M,K)={shape} with no tile config in {source}",
            hint=_TL_HINT,
        )
    problem = tl_geometry_error(kind, shape[0], shape[1], tile.BM, tile.BK, tile.bm)
    if problem:
        raise InvalidModelFile(
            f"{kind} tensor {info.name}: tile config {tile} from {source} does not fit: {problem}",
            hint=_TL_HINT,
        )
    return {"BM": tile.BM, "BK": tile.BK, "bm": tile.bm}


def make_packed_weight(
    info: TensorInfo, raw: np.ndarray | torch.Tensor, *, options: DecodeOptions
) -> PackedWeight:
    """Wrap one tensor's bytes (uint8 [info.nbytes], numpy or torch, zero-copy) as a PackedWeight in its
    file layout.

    Checks what can be checked without decoding: byte count, block geometry, the I2_S variant's shape rule and
    the TL tile config. Code-level checks (I2_S code 3, TL ranges) happen when the weight is unpacked.
    """
    type_name = info.ggml_type.name
    try:
        layout = Layout[type_name]
    except KeyError:
        raise UnsupportedModel(
            f"tensor {info.name} has storage type {type_name}, which bitserve cannot decode",
            hint="requantize the model to a supported type (Q8_0, Q4_K, TQ2_0, I2_S, ...)",
        ) from None
    data = raw if isinstance(raw, torch.Tensor) else as_uint8_tensor(raw)
    if data.dtype != torch.uint8 or data.dim() != 1 or data.numel() != info.nbytes:
        raise InvalidModelFile(
            f"tensor {info.name} ({type_name}) got {data.numel()} bytes", expected=f"{info.nbytes} bytes"
        )
    shape = matrix_shape(tuple(info.shape))
    params: dict[str, object] = {}
    if layout is Layout.I2_S:
        problem = i2s_geometry_error(options.i2s_variant, *shape)
        if problem:
            raise InvalidModelFile(
                f"I2_S tensor {info.name} of shape (M,K)={shape}: {problem}",
                hint="pick the I2_S variant the file was written with (A, B or C)",
            )
        params["i2s_variant"] = options.i2s_variant
    elif layout in (Layout.TL1, Layout.TL2):
        params.update(_tl_params(info, shape, options))
    return PackedWeight(data=data, shape=shape, layout=layout, source_type=type_name, params=params)
