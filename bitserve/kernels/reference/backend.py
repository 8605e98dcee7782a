"""ReferenceBackend: pure-torch linear layers on any device, the oracle every fast backend must match.

Runtime layouts: ternary weights stay int8 [M, K] (Layout.TERNARY_I8) in bitnet / llamacpp-tq mode and
become f32 t * scale (Layout.DENSE) in float mode; dense weights are kept as given.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from types import MappingProxyType

import torch

from bitserve.errors import UnsupportedModel
from bitserve.kernels.backend import LinearMode, PreparedLinear, check_linear_input
from bitserve.kernels.packed import Layout, PackedWeight, TernaryCodes
from bitserve.kernels.reference import ternary
from bitserve.kernels.reference.dense import check_dense_weight, dense_linear

logger = logging.getLogger(__name__)


class ReferenceBackend:
    """Obviously-exact torch implementation of docs/formats.md §3 (f64 integer matmul, step-by-step f32)."""

    name = "reference"

    def prepare_ternary(self, codes: TernaryCodes, *, mode: LinearMode) -> PreparedLinear:
        """Validate the codes and keep them in the layout `mode` runs on (see module docstring)."""
        m, k = ternary.check_ternary_codes(codes)
        mode = mode.kernel_mode  # bitnetcpp's linears are bitnet's
        if mode is LinearMode.FLOAT:
            weight = ternary.dequantize_ternary(codes.values, codes.scale)
            return PreparedLinear(m, k, Layout.DENSE, mode, weight, codes.scale.clone(), self.name)
        if mode is LinearMode.LLAMACPP_TQ:
            if k % ternary.QK_K != 0:
                raise UnsupportedModel(
                    f"llamacpp-tq mode needs in_features to be a multiple of {ternary.QK_K}, got {k}",
                    hint="use the bitnet or float linear mode for this model",
                )
            d_w = ternary.f16_block_scales(codes)  # [M, K // 256]
            extras = MappingProxyType({"d_w": d_w})
            return PreparedLinear(m, k, Layout.TERNARY_I8, mode, codes.values, codes.scale, self.name, extras)
        if mode is LinearMode.BITNET:
            codes = ternary.collapse_block_scales(codes)
            return PreparedLinear(m, k, Layout.TERNARY_I8, mode, codes.values, codes.scale, self.name)
        raise ValueError(f"unknown linear mode {mode!r}")

    def prepare_block(self, weight: PackedWeight) -> PreparedLinear | None:
        """The reference keeps no packed block form: block weights are dequantized to f32 at load."""
        return None

    def prepare_dense(self, weight: torch.Tensor) -> PreparedLinear:
        m, k = check_dense_weight(weight)
        return PreparedLinear(m, k, Layout.DENSE, None, weight.contiguous(), None, self.name)

    def linear(self, x: torch.Tensor, weight: PreparedLinear) -> torch.Tensor:
        """x f32 [T, K] -> f32 [T, M]."""
        return self.linear_group(x, [weight])[0]

    def linear_group(self, x: torch.Tensor, weights: Sequence[PreparedLinear]) -> list[torch.Tensor]:
        """One f32 [T, M_i] per weight; activations are quantized once for the group (per mode)."""
        int8_acts: tuple[torch.Tensor, torch.Tensor] | None = None  # (q [T, K], s_act [T])
        q8k_acts: tuple[torch.Tensor, torch.Tensor] | None = None  # (q8 [T, K], d_x [T, K // 256])
        outputs = []
        for weight in weights:
            check_linear_input(x, weight)
            if weight.backend != self.name:
                raise ValueError(f"weight prepared by {weight.backend!r} given to the {self.name!r} backend")
            if weight.mode is LinearMode.BITNET:
                if int8_acts is None:
                    int8_acts = ternary.quantize_activations(x)
                assert weight.scale is not None  # invariant: ternary weights carry a scale
                outputs.append(ternary.bitnet_linear_quantized(*int8_acts, weight.data, weight.scale))
            elif weight.mode is LinearMode.LLAMACPP_TQ:
                if q8k_acts is None:
                    q8k_acts = ternary.quantize_q8k(x)
                q8, d_x = q8k_acts
                lanes = ternary.tq_lane_sums(q8, weight.data)  # [T, M, nb, 8]
                outputs.append(ternary.tq_epilogue(lanes, d_x, weight.extras["d_w"]))
            else:  # dense weights and float mode: both are f32 [M, K]
                outputs.append(dense_linear(x, weight.data))
        return outputs
