"""The CUDA backend's prepared weights: each PreparedLinear subclass is one runtime strategy (see
kernels/cuda/backend.py for which weight gets which). Imported by the backend and by the compiled
forward (kernels/cuda/decoder_layer.py), which calls their fused entry points.
"""

from __future__ import annotations

import torch

from bitserve.kernels.backend import PreparedLinear
from bitserve.kernels.cuda.block_layout import GEMV_MAX_TOKENS, block_tile
from bitserve.kernels.tuning import GemvOverrides


class CudaDenseLinear(PreparedLinear):
    """f32 [M, K] on the device: cuBLAS."""

    __slots__ = ()

    def run(self, x: torch.Tensor, acts: object) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.data)


class CudaBlockLinear(PreparedLinear):
    """A block weight in a block_layout form (its layout the form's name): data = codes, scale = d,
    extras["m"] (the forms with a min), and extras["dense"] f32 [M, K] for steps of more than
    GEMV_MAX_TOKENS tokens (cuBLAS)."""

    __slots__ = ()

    def run(self, x: torch.Tensor, acts: object) -> torch.Tensor:
        return self.run_fused(x)

    def run_fused(
        self,
        x: torch.Tensor,
        norm_weight: torch.Tensor | None = None,
        eps: float = 0.0,
        *,
        activation: str | None = None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """residual + W @ norm(act(x)): x f32 [T, K] ([T, 2K], gate then up, under `activation`),
        norm_weight f32 [K], residual f32 [T, M] -> f32 [T, M]. Short steps: one block_gemv launch;
        longer: the separate kernels and cuBLAS (which accumulates into `residual` in place)."""
        from bitserve.kernels.cuda.block_gemv import block_gemv
        from bitserve.kernels.cuda.elementwise import act_and_mul, rms_norm

        if x.shape[0] <= GEMV_MAX_TOKENS and block_tile(self.out_features, self.in_features) is not None:
            parts = {"codes": self.data, "d": self.scale}
            if "m" in self.extras:
                parts["m"] = self.extras["m"]
            return block_gemv(
                x, parts, self.out_features, norm_weight=norm_weight, eps=eps, activation=activation,
                residual=residual,
            )  # fmt: skip
        if activation is not None:
            x = act_and_mul(x, activation)
        if norm_weight is not None:
            x = rms_norm(x, norm_weight, eps)
        dense = self.extras["dense"]
        if residual is None:
            return torch.nn.functional.linear(x, dense)
        return residual.addmm_(x, dense.t())


class CudaTernaryLinear(PreparedLinear):
    """Packed planes uint8 [M, K // 4] and an f32 [M] row scale: int8 activations, Triton W2A8 kernel."""

    __slots__ = ()
    activation_key = "int8"

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from bitserve.kernels.cuda.quantize import norm_quantize

        return norm_quantize(x, None, 0.0)  # (q int8 [T, K], s_act f32 [T])

    def run(self, x: torch.Tensor, acts: object) -> torch.Tensor:
        q, s_act = acts  # type: ignore[misc]
        return self.run_quantized(q, s_act)

    def run_quantized(
        self,
        q: torch.Tensor,
        s_act: torch.Tensor,
        residual: torch.Tensor | None = None,
        gemv_overrides: GemvOverrides | None = None,
    ) -> torch.Tensor:
        """q int8 [T, K], s_act f32 [T] (+ residual f32 [T, M]) -> f32 [T, M], in the original row order
        also for a weight whose rows `permute_rows` reordered for a pair epilogue."""
        from bitserve.kernels.cuda.ternary_matmul import ternary_linear

        assert self.scale is not None  # invariant: ternary weights carry their row scales
        order = self.extras.get("row_order")
        if order is None:
            return ternary_linear(
                q, s_act, self.data, self.scale, residual=residual, gemv_overrides=gemv_overrides
            )
        permuted = ternary_linear(q, s_act, self.data, self.scale, gemv_overrides=gemv_overrides)
        out = torch.empty_like(permuted)
        out[:, order] = permuted
        return out if residual is None else residual + out

    def run_paired(
        self, q: torch.Tensor, s_act: torch.Tensor, pair: int, gemv_overrides: GemvOverrides | None = None
    ) -> torch.Tensor:
        """q int8 [T, K], s_act f32 [T] -> act(gate) * up f32 [T, M / 2]: a [gate | up] weight whose rows
        permute_rows interleaved (pair_epilogue.gated_row_order), through the gated pair epilogue."""
        from bitserve.kernels.cuda.ternary_matmul import ternary_linear

        assert self.scale is not None and "row_order" in self.extras  # invariant: permute_rows ran
        return ternary_linear(q, s_act, self.data, self.scale, pair=pair, gemv_overrides=gemv_overrides)

    def permute_rows(self, order: torch.Tensor) -> None:
        """Reorder the rows (row i becomes original row order[i], int64 [M]) in place, for the gated pair
        epilogue; `run_quantized` still answers in the original order."""
        if "row_order" in self.extras or order.shape != (self.out_features,):
            raise ValueError(f"a row order of {self.out_features} rows, once, got {tuple(order.shape)}")
        assert self.scale is not None  # invariant: ternary weights carry their row scales
        order = order.to(self.data.device)
        self.data = self.data[order].contiguous()
        self.scale = self.scale[order].contiguous()
        self.extras = {**self.extras, "row_order": order}
