"""Linear layers: a prepared weight plus the KernelBackend that runs it; same contract as nn.Linear.

`LinearGroup` runs several weights on one input so a ternary backend quantizes the activations once
(q/k/v share the attention input, gate/up the FFN input). An optional per-output scalar multiplier
is the upstream `bitnet` arch's `blk.N.<name>.scale` tensor, applied after the matmul as ggml does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from bitserve.kernels.backend import KernelBackend, PreparedLinear


class LinearGroup(nn.Module):
    """y_i = backend.linear(x, w_i) * output_scale_i for each weight; x f32 [num_tokens, in_features]."""

    def __init__(
        self,
        backend: KernelBackend,
        weights: Sequence[PreparedLinear],
        output_scales: Sequence[float | None] | None = None,
    ) -> None:
        super().__init__()
        self.backend = backend
        self.weights = list(weights)
        self.output_scales = list(output_scales) if output_scales is not None else [None] * len(weights)
        # When the backend can stack the group into one weight, run that and slice its output rows.
        self.out_features = [weight.out_features for weight in self.weights]
        self.row_offsets: list[int] | None = None
        fuse = getattr(backend, "fuse_group", None)
        fused = fuse(self.weights) if fuse is not None else None
        if fused is not None:
            stacked, self.row_offsets = fused
            self.weights = [stacked]

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        if self.row_offsets is not None:
            stacked = self.backend.linear(x, self.weights[0])  # [num_tokens, stacked rows]
            outputs = [stacked[:, start : start + size] for start, size in zip(self.row_offsets, self.out_features, strict=True)]
        elif len(self.weights) == 1:
            outputs = [self.backend.linear(x, self.weights[0])]
        else:
            outputs = self.backend.linear_group(x, self.weights)
        return [out if scale is None else out * scale for out, scale in zip(outputs, self.output_scales, strict=True)]


class Linear(LinearGroup):
    """A single prepared weight: forward returns one tensor [num_tokens, out_features]."""

    def __init__(self, backend: KernelBackend, weight: PreparedLinear, output_scale: float | None = None) -> None:
        super().__init__(backend, [weight], [output_scale])

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x)[0]
