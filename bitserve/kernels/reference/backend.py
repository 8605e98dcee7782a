"""ReferenceBackend: pure-torch linear layers on any device, the oracle every fast backend must match.

Runtime layouts: ternary weights stay int8 [M, K] (Layout.TERNARY_I8) in bitnet / llamacpp-tq mode and
become f32 t * scale (Layout.DENSE) in float mode; dense weights are kept as given. It keeps no packed
block weights, fuses no groups and has no fused small ops: each says so explicitly (None).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from types import MappingProxyType

import torch

from bitserve.errors import UnsupportedModel
from bitserve.kernels.backend import FusedOps, KernelBackend, LinearMode, PreparedLinear
from bitserve.kernels.packed import Layout, PackedWeight, TernaryCodes
from bitserve.kernels.reference import ternary
from bitserve.kernels.reference.dense import check_dense_weight, dense_linear

logger = logging.getLogger(__name__)


class _DenseLinear(PreparedLinear):
    """f32 [M, K] weights (dense files, and ternary weights in float mode as t * scale): torch's BLAS."""

    __slots__ = ()

    def run(self, x: torch.Tensor, acts: object) -> torch.Tensor:
        return dense_linear(x, self.data)


class _BitnetLinear(PreparedLinear):
    """int8 codes [M, K], one scale: per-token int8 activations, f64 integer matmul, f32 epilogue."""

    __slots__ = ()
    activation_key = "int8"

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return ternary.quantize_activations(x)  # (q [T, K], s_act [T])

    def run(self, x: torch.Tensor, acts: object) -> torch.Tensor:
        q, s_act = acts  # type: ignore[misc]
        assert self.scale is not None  # invariant: ternary weights carry a scale
        return ternary.bitnet_linear_quantized(q, s_act, self.data, self.scale)


class _TqLinear(PreparedLinear):
    """int8 codes [M, K] with f16 block scales d_w [M, K // 256]: ggml's Q8_K lane-wise TQ dot product."""

    __slots__ = ()
    activation_key = "q8k"

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return ternary.quantize_q8k(x)  # (q8 [T, K], d_x [T, K // 256])

    def run(self, x: torch.Tensor, acts: object) -> torch.Tensor:
        q8, d_x = acts  # type: ignore[misc]
        lanes = ternary.tq_lane_sums(q8, self.data)  # [T, M, nb, 8]
        return ternary.tq_epilogue(lanes, d_x, self.extras["d_w"])


class ReferenceBackend(KernelBackend):
    """Obviously-exact torch implementation of docs/formats.md §3 (f64 integer matmul, step-by-step f32)."""

    name = "reference"

    def prepare_ternary(self, codes: TernaryCodes, *, mode: LinearMode) -> PreparedLinear:
        """Validate the codes and keep them in the layout `mode` runs on (see module docstring)."""
        m, k = ternary.check_ternary_codes(codes)
        mode = mode.kernel_mode  # bitnetcpp's linears are bitnet's
        if mode is LinearMode.FLOAT:
            weight = ternary.dequantize_ternary(codes.values, codes.scale)
            return _DenseLinear(m, k, Layout.DENSE, mode, weight, codes.scale.clone(), self.name)
        if mode is LinearMode.LLAMACPP_TQ:
            if k % ternary.QK_K != 0:
                raise UnsupportedModel(
                    f"llamacpp-tq mode needs in_features to be a multiple of {ternary.QK_K}, got {k}",
                    hint="use the bitnet or float linear mode for this model",
                )
            d_w = ternary.f16_block_scales(codes)  # [M, K // 256]
            extras = MappingProxyType({"d_w": d_w})
            return _TqLinear(m, k, Layout.TERNARY_I8, mode, codes.values, codes.scale, self.name, extras)
        if mode is LinearMode.BITNET:
            codes = ternary.collapse_block_scales(codes)
            return _BitnetLinear(m, k, Layout.TERNARY_I8, mode, codes.values, codes.scale, self.name)
        raise ValueError(f"unknown linear mode {mode!r}")

    def prepare_dense(self, weight: torch.Tensor) -> PreparedLinear:
        m, k = check_dense_weight(weight)
        return _DenseLinear(m, k, Layout.DENSE, None, weight.contiguous(), None, self.name)

    def prepare_block(self, weight: PackedWeight) -> PreparedLinear | None:
        """No packed block form: block weights are dequantized to f32 at load (`prepare_dense`)."""
        return None

    def fuse_group(self, weights: Sequence[PreparedLinear]) -> tuple[PreparedLinear, list[int]] | None:
        """No fusion: a group runs its weights one by one (activations still quantized once)."""
        return None

    def fused_ops(self) -> FusedOps | None:
        """No fused small ops: the layers' eager torch code is the reference."""
        return None
