"""A loaded model lowered to data, for a backend to compile (`KernelBackend.compile_decoder`).

models/ declares each architecture once (a recipe and a tensor-name map, models/recipe.py) and builds
its module forward from it: the oracle every backend runs. The same recipe, with the weights the loader
prepared, is handed to the backend as a `DecoderPlan`: per layer the norm vectors and the `Projection`s
in the recipe's order (norm -> q|k|v [+ biases, per-head q/k norms] -> RoPE + cache -> attention ->
sub-norm -> Wo + residual -> norm -> gate|up -> act * up -> sub-norm -> Wdown + residual), and the
model-wide facts (heads, activation, RoPE tables, head), with Gemma's post-norms, sliding windows and
scales where the recipe has them. A backend compiles it into its fast forward (the cpu backend's one-call
numba layer loop, the cuda backend's fused Triton chain) or declines (None): then the module forward runs. So
neither fast forward reaches into nn.Modules, and models/ never names a backend or a weight class.

Imports only torch and kernels/ records (no layers/, no models/).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from bitserve.kernels.attention_metadata import AttentionMetadata
from bitserve.kernels.packed import PackedWeight
from bitserve.kernels.prepared_linear import LinearKernelGroup, PreparedLinear


class Projection:
    """Weights run on one input (q|k|v, gate|up, or a single Wo / Wdown), bound once by the backend
    (`KernelBackend.bind_group`), with the upstream `bitnet` arch's per-weight output scalar
    (`blk.N.<name>.scale`, applied after the matmul as ggml does; None: no multiply)."""

    def __init__(self, kernel: LinearKernelGroup, output_scales: Sequence[float | None]) -> None:
        if len(output_scales) != len(kernel.out_features):
            raise ValueError("one output scale (or None) per weight of the projection")
        self.kernel = kernel
        self.weights = kernel.weights  # the weights that run: one when the backend stacked them
        self.row_offsets = kernel.row_offsets  # where each weight's rows start in a stacked output
        self.out_features = list(kernel.out_features)  # each original weight's rows
        self.output_scales = list(output_scales)

    @property
    def has_output_scales(self) -> bool:
        return any(scale is not None for scale in self.output_scales)

    def row_output_scales(self) -> torch.Tensor:
        """The output scales per output row (None: 1.0), f32 [sum M_i], in the stacked output's order."""
        rows = [
            torch.full((size,), 1.0 if scale is None else scale, dtype=torch.float32)
            for scale, size in zip(self.output_scales, self.out_features, strict=True)
        ]
        return torch.cat(rows)

    def stacked_weight(self) -> PreparedLinear | None:
        """The one weight that runs this projection, when the backend stacked it into one (or it is a
        single weight); None where several run side by side."""
        return self.weights[0] if len(self.weights) == 1 else None

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x f32 [T, K] -> one f32 [T, M_i] per original weight, its output scale applied."""
        outputs = self.kernel(x)
        return [
            out if scale is None else out * scale
            for out, scale in zip(outputs, self.output_scales, strict=True)
        ]

    def concatenated(self, x: torch.Tensor) -> torch.Tensor:
        """x f32 [T, K] -> f32 [T, sum M_i]: the weights' outputs side by side, in order."""
        outputs = self(x)
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)


@dataclass(frozen=True, slots=True)
class LayerPlan:
    """One decoder layer's weights in the recipe's order (norm weights f32 [N], on the model's device)."""

    attn_norm: torch.Tensor  # [hidden]
    qkv: Projection  # q, k, v rows (columns of its output in that order)
    qkv_bias: torch.Tensor | None  # [(H + 2 KVH) * D]: added to q|k|v's output (Qwen2)
    q_norm: torch.Tensor | None  # [head_dim]: RMSNorm of each head of q, after the bias, before RoPE (Qwen3)
    k_norm: torch.Tensor | None  # [head_dim]: the same for k
    attn_sub_norm: torch.Tensor | None  # [num_heads * head_dim] (BitNet), before Wo
    o_proj: Projection
    ffn_norm: torch.Tensor  # [hidden]
    gate_up: Projection  # gate, up rows
    ffn_sub_norm: torch.Tensor | None  # [intermediate] (BitNet), before Wdown
    down: Projection
    attn_post_norm: torch.Tensor | None = None  # [hidden] (Gemma): RMSNorm of Wo's output before the add
    ffn_post_norm: torch.Tensor | None = None  # [hidden] (Gemma): RMSNorm of Wdown's output before the add
    sliding_window: int = 0  # > 0: attends to the last that many positions only (its RoPE: sliding_rope)
    residual_scale: float = 1.0  # each block's output x this before its residual add (MiniCPM)

    @property
    def beyond_llama(self) -> bool:
        """Parts past the llama / qwen / bitnet layer (Gemma's, MiniCPM's): a fast forward without them
        declines."""
        gemma = self.attn_post_norm is not None or self.ffn_post_norm is not None or self.sliding_window > 0
        return gemma or self.residual_scale != 1.0


@dataclass(frozen=True, slots=True)
class RopeTables:
    cos: torch.Tensor  # f32 [max_positions, rope_dim / 2]
    sin: torch.Tensor
    rope_dim: int  # the rotated leading dims of each head (partial rotary: the rest pass through)
    is_neox: bool  # NEOX (halves) rotation; False: interleaved pairs (llama.cpp's NORM)


@dataclass(frozen=True, slots=True)
class DecoderPlan:
    """A whole model for a backend to compile (see the module docstring)."""

    layers: tuple[LayerPlan, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    activation: str  # the gated FFN activation's name ("silu", "relu2", ...)
    # the module forward's act(gate) * up: a fast forward computes the same function or declines
    act_and_mul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    attn_scale: float  # softmax scale, 1 / sqrt(head_dim)
    rope: RopeTables
    ggml_numerics: bool  # bitnet.cpp's rounding in RoPE / attention / F16 head (LinearMode.BITNETCPP)
    embedding: PackedWeight  # token table [vocab, hidden] in its file layout
    final_norm: torch.Tensor  # [hidden]
    head: PreparedLinear | torch.Tensor  # the LM head: prepared weight, or float matrix [vocab, hidden]
    tie_word_embeddings: bool
    sliding_rope: RopeTables | None = None  # the sliding layers' RoPE where it differs from `rope`
    embedding_scale: float = 1.0  # embeddings x this before layer 0 (the caller of run_layers applies it)
    final_logit_softcap: float = 0.0  # logits = cap * tanh(logits / cap) where > 0
    logit_scale: float = 1.0  # logits divided by it before the softcap (MiniCPM)

    def layer_rope(self, layer: LayerPlan) -> RopeTables:
        return self.sliding_rope if layer.sliding_window and self.sliding_rope is not None else self.rope


class CompiledDecoder(Protocol):
    """A backend's fast forward of one model's layers (what `compile_decoder` returns)."""

    def applies(
        self, num_tokens: int, kv_caches: list[torch.Tensor] | None, metadata: AttentionMetadata | None
    ) -> bool:
        """Whether this step (its token count, caches and attention metadata) runs here; False: the
        module forward runs it."""
        ...

    def run_layers(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """hidden f32 [T, hidden] (the tokens' embeddings), positions int64 [T] -> the last layer's
        output f32 [T, hidden], before the final norm; KV of this step written to the caches."""
        ...
