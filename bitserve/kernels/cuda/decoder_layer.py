"""One decoder layer of the CUDA backend's compiled forward (kernels/cuda/decoder.py), from its LayerPlan.

Each projection's path is chosen once, at load, from the weight the backend prepared: ternary (norm +
int8 quantization in one `norm_quantize` launch, then the W2A8 kernel adding the residual), block-
quantized (norm, activation and residual in the block GEMV), plain dense (Triton norm, cuBLAS, residual
via addmm), or the projection's own call (output scales, reference fallbacks). Where the layer has a
post-norm (Gemma: an RMSNorm of Wo's and of Wdown's output before each residual add) the projection runs
without its residual epilogue and one rms_norm launch normalizes its output and adds the residual.
"""

from __future__ import annotations

import torch

from bitserve.errors import UnsupportedModel
from bitserve.kernels.backend import PreparedLinear
from bitserve.kernels.cuda.elementwise import ACTIVATIONS, act_and_mul, rms_norm
from bitserve.kernels.cuda.linears import CudaBlockLinear, CudaDenseLinear, CudaTernaryLinear
from bitserve.kernels.cuda.pair_epilogue import GATED_PAIRS, gated_row_order
from bitserve.kernels.cuda.quantize import norm_quantize
from bitserve.kernels.plan import LayerPlan, Projection
from bitserve.kernels.tuning import KernelTuning

# GATED_ACTIVATIONS names that norm_quantize computes in its prologue
_FUSED_ACTIVATIONS = {"relu2": "relu2", "relu_sqr": "relu2", "silu": "silu"}


def _single_weight(projection: Projection, kind: type[PreparedLinear]) -> PreparedLinear | None:
    """The one (stacked) weight a projection runs, when it is a `kind` and no per-output scalar
    multiplies its output; else None (the projection's own call runs it)."""
    weight = projection.stacked_weight()
    if isinstance(weight, kind) and not projection.has_output_scales:
        return weight
    return None


def _fold_output_scales(projection: Projection) -> None:
    """A ternary projection's `.scale` multipliers (the upstream `bitnet` arch's) folded into its weight's
    f32 [M] row scales, once at load, so the fused kernels run it: f32(D / s_act * (scale * s)) for ggml's
    f32(f32(D / s_act * scale) * s), one rounding fewer (within an ulp of each output). The plan then
    holds no output scales, so every path (this decoder, the module forward) computes the same."""
    weight = projection.stacked_weight()
    if not isinstance(weight, CudaTernaryLinear) or not projection.has_output_scales:
        return
    assert weight.scale is not None  # invariant: ternary weights carry their row scales
    weight.scale = (weight.scale * projection.row_output_scales().to(weight.scale.device)).contiguous()
    projection.output_scales = [None] * len(projection.output_scales)


def _to(norm: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if norm is None else norm.to(device)


class CudaLayer:
    """One layer's weights on the device, each projection's path chosen once (see the module docstring)."""

    def __init__(
        self,
        layer: LayerPlan,
        heads: tuple[int, int, int],
        activation: str,
        device: torch.device,
        options: tuple[float, KernelTuning],
    ) -> None:
        num_heads, num_kv_heads, head_dim = heads
        self.eps, tuning = options  # the model's RMSNorm epsilon and kernel knobs
        self.gemv_overrides = tuning.gemv_overrides() or None  # sweeps' tiles (None in use)
        if activation not in ACTIVATIONS:  # at load, not at the first step
            raise UnsupportedModel(f"FFN activation {activation!r} has no CUDA kernel")
        self.activation = activation
        self.attn_norm, self.attn_sub_norm = _to(layer.attn_norm, device), _to(layer.attn_sub_norm, device)
        self.ffn_norm, self.ffn_sub_norm = _to(layer.ffn_norm, device), _to(layer.ffn_sub_norm, device)
        self.qkv_bias = _to(layer.qkv_bias, device)  # f32 [(H + 2 KVH) * D] (Qwen2) or None
        self.q_norm, self.k_norm = _to(layer.q_norm, device), _to(layer.k_norm, device)  # [D] (Qwen3)
        # [hidden] (Gemma): RMSNorm of Wo's / Wdown's output before the residual add, or None
        self.attn_post_norm = _to(layer.attn_post_norm, device)
        self.ffn_post_norm = _to(layer.ffn_post_norm, device)
        self.residual_scale = layer.residual_scale  # MiniCPM: each block's output x this before its add
        self.window = layer.sliding_window  # > 0: attends to its last that many positions (Gemma)
        fused_act = _FUSED_ACTIVATIONS.get(activation)
        self.projections = {"qkv": layer.qkv, "o": layer.o_proj, "gate_up": layer.gate_up, "down": layer.down}
        for projection in self.projections.values():
            _fold_output_scales(projection)
        self.ternary = {name: _single_weight(p, CudaTernaryLinear) for name, p in self.projections.items()}
        self.block = {name: _single_weight(p, CudaBlockLinear) for name, p in self.projections.items()}
        dense = {name: _single_weight(p, CudaDenseLinear) for name, p in self.projections.items()}
        self.dense = {name: None if w is None else w.data for name, w in dense.items()}  # f32 [M, K]
        if fused_act is None:
            self.ternary["down"] = None  # the gated activation runs before Wdown, not in its prologue
        self.fused_act = fused_act
        self.q_width = num_heads * head_dim
        self.kv_width = num_kv_heads * head_dim
        self.gate_pair = self._pair_gate_up()

    def _pair_gate_up(self) -> int | None:
        """Ternary gate/up feeding a ternary Wdown: rows interleaved so the kernel's epilogue writes
        act(gate) * up (pair_epilogue.py), and Wdown's norm_quantize reads I values, not 2I. The weight
        still answers in the original row order everywhere else (CudaTernaryLinear.permute_rows)."""
        weight, widths = self.ternary["gate_up"], self.projections["gate_up"].out_features
        if weight is None or self.ternary["down"] is None or len(widths) != 2 or widths[0] != widths[1]:
            return None
        weight.permute_rows(gated_row_order(widths[0]))  # type: ignore[attr-defined]
        return GATED_PAIRS[self.activation]

    def _project(
        self, name: str, x: torch.Tensor, norm: torch.Tensor | None, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """norm(x) through projection `name` (+ residual): f32 [T, M] (a group's outputs side by side)."""
        ternary, dense, block = self.ternary[name], self.dense[name], self.block[name]
        if ternary is not None:
            return self._norm_linear(ternary, x, norm, residual=residual)  # type: ignore[arg-type]
        if block is not None:
            return block.run_fused(x, norm, self.eps, residual=residual)  # type: ignore[attr-defined]
        x = x if norm is None else rms_norm(x, norm, self.eps)
        if dense is not None:
            if residual is None:
                return torch.nn.functional.linear(x, dense)
            # in place: the residual stream tensor is this layer's own (nothing else reads it after),
            # and cuBLAS then accumulates into it instead of first copying it to a fresh output
            return residual.addmm_(x, dense.t())
        out = self.projections[name].concatenated(x)
        return out if residual is None else residual + out

    def qkv_out(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden f32 [T, hidden] -> q|k|v f32 [T, (H + 2 KVH) * D] (columns in that order), biases
        added where the model has them."""
        out = self._project("qkv", hidden, self.attn_norm)
        return out if self.qkv_bias is None else out.add_(self.qkv_bias)  # the projection's own tensor

    def normed_heads(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q f32 [T, H, D], k [T, KVH, D] (column views of qkv_out) -> each head RMSNorm'd with the
        layer's [D] weight, before RoPE, where the model has q/k norms (new tensors); else q, k."""
        if self.q_norm is None or self.k_norm is None:
            return q, k
        head_dim = q.shape[2]
        q_normed = rms_norm(q.reshape(-1, head_dim), self.q_norm, self.eps).view(q.shape)
        return q_normed, rms_norm(k.reshape(-1, head_dim), self.k_norm, self.eps).view(k.shape)

    def attn_out(self, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """attn f32 [T, H * D] -> residual + post_norm(Wo(sub_norm(attn))) (no post-norm: the residual
        added in Wo's epilogue)."""
        post_norm = self.attn_post_norm
        fused_add = post_norm is None and self.residual_scale == 1.0  # the residual in Wo's epilogue
        out = self._project("o", attn, self.attn_sub_norm, residual if fused_add else None)
        return out if fused_add else self._block_output(out, post_norm, residual)

    def ffn(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden f32 [T, hidden] -> hidden + post_norm(Wdown(sub_norm(act(gate) * up))) (no post-norm:
        the residual added in Wdown's epilogue)."""
        post_norm = self.ffn_post_norm
        fused_add = post_norm is None and self.residual_scale == 1.0
        out = self._ffn_down(hidden, hidden if fused_add else None)  # [T, hidden]
        return out if fused_add else self._block_output(out, post_norm, hidden)

    def _block_output(
        self, out: torch.Tensor, post_norm: torch.Tensor | None, residual: torch.Tensor
    ) -> torch.Tensor:
        """A block's output f32 [T, hidden] -> residual + rms_norm(out) (Gemma: one launch), or
        residual + out * residual_scale (MiniCPM), in the module forward's order."""
        if self.residual_scale == 1.0:
            assert post_norm is not None  # invariant: the callers fused the plain add
            return rms_norm(out, post_norm, self.eps, residual=residual)
        if post_norm is not None:
            out = rms_norm(out, post_norm, self.eps)
        return residual + out * self.residual_scale

    def _ffn_down(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """hidden f32 [T, hidden] -> Wdown(sub_norm(act(gate) * up)) f32 [T, hidden] (+ residual)."""
        down, sub_norm = self.ternary["down"], self.ffn_sub_norm
        if self.gate_pair is not None:
            gate_up = self.ternary["gate_up"]
            assert gate_up is not None and down is not None  # invariant: _pair_gate_up's condition
            ffn_act = self._norm_linear(gate_up, hidden, self.ffn_norm, pair=self.gate_pair)  # type: ignore[arg-type]
            return self._norm_linear(down, ffn_act, sub_norm, residual=residual)  # type: ignore[arg-type]
        gate_up_out = self._project("gate_up", hidden, self.ffn_norm)  # [T, 2 * I]
        if down is not None:
            return self._norm_linear(
                down,
                gate_up_out,
                sub_norm,
                residual=residual,
                activation=self.fused_act,  # type: ignore[arg-type]
            )
        block_down = self.block["down"]
        if block_down is not None:  # act(gate) * up, sub-norm and residual in the GEMV (or its fallback)
            return block_down.run_fused(  # type: ignore[attr-defined]
                gate_up_out, sub_norm, self.eps, activation=self.activation, residual=residual
            )
        ffn_out = act_and_mul(gate_up_out, self.activation)  # [T, I]
        return self._project("down", ffn_out, sub_norm, residual)

    def _norm_linear(
        self,
        weight: CudaTernaryLinear,
        x: torch.Tensor,
        norm_weight: torch.Tensor | None,
        *,
        residual: torch.Tensor | None = None,
        activation: str | None = None,
        pair: int | None = None,
    ) -> torch.Tensor:
        """Two launches: act/norm + int8 quantization of x, then the W2A8 kernel (+ residual), or with a
        gated `pair` the kernel's pair epilogue (a permuted gate/up weight -> act(gate) * up)."""
        q, s_act = norm_quantize(x, norm_weight, self.eps, activation=activation)
        if pair is not None:
            return weight.run_paired(q, s_act, pair, self.gemv_overrides)
        return weight.run_quantized(q, s_act, residual, self.gemv_overrides)
