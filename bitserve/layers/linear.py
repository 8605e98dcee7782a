"""Linear layers: prepared weights, each already bound to its kernel; same contract as nn.Linear.

`LinearGroup` runs several weights on one input, bound once at construction (`backend.bind_group`):
the backend may stack them into one weight, and activations are quantized once per kind (q/k/v share
the attention input, gate/up the FFN input). Both wrap a `Projection` (kernels/plan.py): the weights
that run plus the upstream `bitnet` arch's optional per-output scalar (`blk.N.<name>.scale`), which is
also what a backend's compiled forward reads.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from bitserve.kernels.backend import KernelBackend, LinearKernelGroup, PreparedLinear
from bitserve.kernels.plan import Projection


class LinearGroup(nn.Module):
    """y_i = w_i(x) * output_scale_i for each weight; x f32 [num_tokens, in_features]."""

    def __init__(
        self,
        backend: KernelBackend,
        weights: Sequence[PreparedLinear],
        output_scales: Sequence[float | None] | None = None,
    ) -> None:
        super().__init__()
        scales = list(output_scales) if output_scales is not None else [None] * len(weights)
        self.projection = Projection(backend.bind_group(weights), scales)
        self.weights = self.projection.weights  # the weights that run: one when the backend stacked them
        self.row_offsets = self.projection.row_offsets
        self.out_features = self.projection.out_features
        self.output_scales = self.projection.output_scales

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return self.projection(x)


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
        self.projection = Projection(LinearKernelGroup([weight], [weight.out_features]), [output_scale])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.weight(x)  # [num_tokens, out_features]: the weight's own call, no group bookkeeping
        return out if self.output_scale is None else out * self.output_scale
