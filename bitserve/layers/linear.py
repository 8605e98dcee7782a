"""Linear layers: prepared weights, each already bound to its kernel; same contract as nn.Linear.

`LinearGroup` runs several weights on one input, bound once at construction (`backend.bind_group`):
the backend may stack them into one weight, and activations are quantized once per kind (q/k/v share
the attention input, gate/up the FFN input). An optional per-output scalar multiplier is the upstream
`bitnet` arch's `blk.N.<name>.scale` tensor, applied after the matmul as ggml does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from bitserve.kernels.backend import KernelBackend, PreparedLinear


class LinearGroup(nn.Module):
    """y_i = w_i(x) * output_scale_i for each weight; x f32 [num_tokens, in_features]."""

    def __init__(
        self,
        backend: KernelBackend,
        weights: Sequence[PreparedLinear],
        output_scales: Sequence[float | None] | None = None,
    ) -> None:
        super().__init__()
        self.kernel = backend.bind_group(weights)
        self.weights = self.kernel.weights  # the weights that run: one when the backend stacked them
        self.row_offsets = self.kernel.row_offsets
        self.out_features = [weight.out_features for weight in weights]
        self.output_scales = list(output_scales) if output_scales is not None else [None] * len(weights)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        outputs = self.kernel(x)
        return [
            out if scale is None else out * scale
            for out, scale in zip(outputs, self.output_scales, strict=True)
        ]


class Linear(nn.Module):
    """A single prepared weight: forward returns one tensor [num_tokens, out_features]."""

    def __init__(
        self, backend: KernelBackend, weight: PreparedLinear, output_scale: float | None = None
    ) -> None:
        super().__init__()
        backend.check_owner(weight)
        self.weight = weight
        self.weights = [weight]
        self.out_features = weight.out_features
        self.output_scale = output_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.weight(x)  # [num_tokens, out_features]
        return out if self.output_scale is None else out * self.output_scale
