"""PackedWeight: a weight matrix in one named byte layout. Data, not behaviour.

The loader produces PackedWeights in *file* layouts (exactly the GGUF bytes); a KernelBackend turns
them once, at load, into its *runtime* layout. Only `kernels/` branches on `layout`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch


class Layout(enum.Enum):
    # file layouts: `data` is the tensor's raw bytes, uint8 [nbytes]
    F32 = "F32"
    F16 = "F16"
    BF16 = "BF16"
    Q8_0 = "Q8_0"
    Q4_0 = "Q4_0"
    Q4_1 = "Q4_1"
    Q5_0 = "Q5_0"
    Q5_1 = "Q5_1"
    Q2_K = "Q2_K"
    Q3_K = "Q3_K"
    Q4_K = "Q4_K"
    Q5_K = "Q5_K"
    Q6_K = "Q6_K"
    TQ1_0 = "TQ1_0"
    TQ2_0 = "TQ2_0"
    Q1_0 = "Q1_0"  # llama.cpp: 128 sign bits + one f16 d per block: values +-d
    Q2_0 = "Q2_0"  # llama.cpp: 64 2-bit codes + one f16 d per block: values (code - 1) d, code 3 -> +2 d
    I2_S = "I2_S"
    TL1 = "TL1"
    TL2 = "TL2"
    # runtime layouts
    DENSE = "dense"  # data: float tensor [out, in]
    TERNARY_I8 = "ternary-i8"  # data: int8 [out, in] in {-1,0,1}; scales: see TernaryWeight
    # data: uint8 [out, pad128(in)/4], code t+1: I2_S variant A's bytes row by row (kernels/cpu/ternary.py)
    TERNARY_2BIT = "ternary-2bit"


TERNARY_FILE_LAYOUTS = frozenset({Layout.TQ1_0, Layout.TQ2_0, Layout.I2_S, Layout.TL1, Layout.TL2})
LOW_BIT_LAYOUTS = frozenset({Layout.Q2_0, Layout.Q1_0})  # llama.cpp's 2- and 1-bit block types


@dataclass(frozen=True, slots=True)
class PackedWeight:
    """One weight matrix.

    `shape` is (out_features, in_features) = (M, K), the PyTorch convention; GGUF's ne is (K, M).
    `params` holds layout options that the bytes do not record (I2_S packing variant, TL tile config).
    """

    data: torch.Tensor
    shape: tuple[int, int]
    layout: Layout
    source_type: str
    scales: torch.Tensor | None = None
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def is_ternary(self) -> bool:
        return self.layout in TERNARY_FILE_LAYOUTS or self.layout in (
            Layout.TERNARY_I8,
            Layout.TERNARY_2BIT,
        )


@dataclass(frozen=True, slots=True)
class TernaryCodes:
    """A decoded ternary matrix: the common form every ternary file layout decodes to.

    values: int8 [M, K] in {-1, 0, +1}.
    scale:  f32 scalar tensor (one scale per tensor: I2_S, TL1, TL2, or TQ whose blocks share one d),
            or f32 [M, K // 256] per-block scales (TQ with differing block scales).
    """

    values: torch.Tensor
    scale: torch.Tensor

    @property
    def is_per_tensor(self) -> bool:
        return self.scale.dim() == 0


def ternary_codes_of(dense: torch.Tensor) -> TernaryCodes | None:
    """If every value of dense [M, K] is in {-s, 0, +s} for one s > 0, return those codes and s."""
    scale = dense.abs().max()
    if not torch.isfinite(scale) or scale <= 0:
        return None
    values = torch.sign(dense).to(torch.int8)
    if not torch.equal(values.to(torch.float32) * scale, dense):
        return None
    return TernaryCodes(values=values, scale=scale.to(torch.float32))
