"""RMSNorm in float32, the norm of every supported architecture (attn/ffn norms and BitNet sub-norms)."""

from __future__ import annotations

import torch
from torch import nn

from bitserve.kernels.backend import FusedOps
from bitserve.layers import ggml_ops


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in float32.

    NOTE: ggml accumulates the sum of squares in double; we do the same so that logits stay as
    close to llama.cpp as the rest of the graph allows (cheap: one reduction per row).
    """

    def __init__(
        self, weight: torch.Tensor, eps: float, fused: FusedOps | None = None, ggml_numerics: bool = False
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.to(torch.float32).reshape(-1), requires_grad=False)
        self.eps = eps
        # the backend's one-call kernel (bit-identical), when it has one; ggml numerics square in f32
        # before the f64 sum, as ggml does (a different last bit on ~1% of rows otherwise)
        self.fused = None if ggml_numerics else fused
        self.ggml_numerics = ggml_numerics

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, width]
        if self.ggml_numerics:
            return x * ggml_ops.rms_norm_inverse(x, self.eps) * self.weight
        if self.fused is not None and x.dtype == torch.float32 and x.dim() == 2:
            return self.fused.rms_norm(x, self.weight, self.eps)
        mean_square = x.to(torch.float64).square().mean(dim=-1, keepdim=True)
        inv_rms = torch.rsqrt(mean_square.to(torch.float32) + self.eps)
        return x * inv_rms * self.weight
