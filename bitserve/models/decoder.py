"""A pre-norm decoder-only transformer over a flat token batch and a paged KV cache.

Shared by every supported architecture; the differences (sub-norms, activation, RoPE style, tied
head, per-matmul scales) come from ModelSpec and the subclass's weight names. Forward contract, the
one the engine calls: input_ids [num_tokens], positions [num_tokens], one KV tensor per layer and
AttentionMetadata -> hidden_states [num_tokens, hidden_size]; compute_logits picks sampled rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from bitserve.errors import UnsupportedModel
from bitserve.kernels.backend import FusedOps, LinearMode
from bitserve.kernels.packed import Layout
from bitserve.layers.activation import GATED_ACTIVATIONS, relu2_and_mul
from bitserve.layers.attention import AttentionMetadata, PagedAttention
from bitserve.layers.embedding import LMHead, TokenEmbedding
from bitserve.layers.linear import Linear, LinearGroup
from bitserve.layers.norm import RMSNorm
from bitserve.layers.rotary import RotaryEmbedding
from bitserve.models.spec import ModelSpec
from bitserve.models.weights import WeightSource

if TYPE_CHECKING:
    from bitserve.models.cpu_fast_decode import FastCpuDecode


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, weights: WeightSource, layer_id: int, model: DecoderModel) -> None:
        super().__init__()
        prefix = f"blk.{layer_id}"
        ternary = model.projections_may_be_ternary
        eps = spec.rms_norm_eps
        fused = model.fused  # the backend's fused ops, looked up once per model
        ggml = weights.linear_mode.ggml_numerics  # bitnet.cpp's f32 arithmetic (layers/ggml_ops.py)
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.attn_norm = RMSNorm(weights.vector(f"{prefix}.attn_norm.weight"), eps, fused, ggml)
        self.qkv = LinearGroup(
            weights.backend,
            [weights.linear(f"{prefix}.attn_{n}.weight", may_be_ternary=ternary) for n in ("q", "k", "v")],
            [model.output_scale(weights, f"{prefix}.attn_{n}") for n in ("q", "k", "v")],
        )
        self.attn = PagedAttention(
            spec.num_heads,
            spec.num_kv_heads,
            spec.head_dim,
            fused,
            ggml_numerics=weights.linear_mode.ggml_numerics,
        )
        self.attn_sub_norm = self._sub_norm(spec, weights, f"{prefix}.attn_sub_norm.weight", fused)
        self.o_proj = Linear(
            weights.backend,
            weights.linear(f"{prefix}.attn_output.weight", may_be_ternary=ternary),
            model.output_scale(weights, f"{prefix}.attn_output"),
        )
        self.ffn_norm = RMSNorm(weights.vector(f"{prefix}.ffn_norm.weight"), eps, fused, ggml)
        self.gate_up = LinearGroup(
            weights.backend,
            [weights.linear(f"{prefix}.ffn_{n}.weight", may_be_ternary=ternary) for n in ("gate", "up")],
            [model.output_scale(weights, f"{prefix}.ffn_{n}") for n in ("gate", "up")],
        )
        self.act_and_mul = model.gated_activation(weights, spec.activation)
        self.ffn_sub_norm = self._sub_norm(spec, weights, f"{prefix}.ffn_sub_norm.weight", fused)
        self.down_proj = Linear(
            weights.backend,
            weights.linear(f"{prefix}.ffn_down.weight", may_be_ternary=ternary),
            model.output_scale(weights, f"{prefix}.ffn_down"),
        )

    @staticmethod
    def _sub_norm(
        spec: ModelSpec, weights: WeightSource, name: str, fused: FusedOps | None
    ) -> RMSNorm | None:
        if not spec.has_sub_norms:
            return None
        return RMSNorm(weights.vector(name), spec.rms_norm_eps, fused, weights.linear_mode.ggml_numerics)

    def forward(
        self,
        hidden_states: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        kv_cache: torch.Tensor | None,
        attn_metadata: AttentionMetadata | None,
    ) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        q, k, v = self.qkv(self.attn_norm(hidden_states))
        # reshape, not view: a stacked q/k/v output is column slices (a copy only when num_tokens > 1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)  # [num_tokens, num_heads, head_dim]
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)  # [num_tokens, num_kv_heads, head_dim]
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = rotary(positions, q, k)
        attn_out = self.attn(q, k, v, kv_cache, attn_metadata)  # [num_tokens, num_heads * head_dim]
        if self.attn_sub_norm is not None:
            attn_out = self.attn_sub_norm(attn_out)
        hidden_states = hidden_states + self.o_proj(attn_out)
        gate, up = self.gate_up(self.ffn_norm(hidden_states))
        ffn_out = self.act_and_mul(gate, up)  # [num_tokens, intermediate_size]
        if self.ffn_sub_norm is not None:
            ffn_out = self.ffn_sub_norm(ffn_out)
        return hidden_states + self.down_proj(ffn_out)


class DecoderModel(nn.Module):
    """Base class; subclasses set the class attributes and may override the hooks."""

    # float-stored projections whose values are {-s,0,+s} run as BitLinear (bitnet family only)
    projections_may_be_ternary: bool = False

    def __init__(self, spec: ModelSpec, weights: WeightSource) -> None:
        super().__init__()
        if spec.activation not in GATED_ACTIVATIONS:
            raise UnsupportedModel(
                f"FFN activation {spec.activation!r} is not supported",
                hint=f"supported: {', '.join(GATED_ACTIVATIONS)}",
            )
        self.spec = spec
        self.fused = fused = weights.backend.fused_ops()  # once per model; None: eager torch layers
        # the cpu backend's int8 block-weight numerics (kernels/cpu/blockdot.py): the fast step's SiLU
        self.q8_blocks = weights.backend.name == "cpu" and weights.backend.block_activations == "q8"
        self.embed_tokens = TokenEmbedding(weights.packed("token_embd.weight"))
        self.rotary = RotaryEmbedding(
            spec.rope_dim,
            spec.rope_theta,
            spec.max_model_len,
            spec.rope_style,
            freq_factors=self.rope_freq_factors(weights),
            position_scale=spec.rope_position_scale,
            fused=fused,
            ggml_numerics=weights.linear_mode.ggml_numerics,
        )
        self.layers = nn.ModuleList(DecoderLayer(spec, weights, i, self) for i in range(spec.num_layers))
        self.norm = RMSNorm(
            weights.vector("output_norm.weight"), spec.rms_norm_eps, fused, weights.linear_mode.ggml_numerics
        )
        head_name = "token_embd.weight" if spec.tie_word_embeddings else "output.weight"
        ggml_f16_head = weights.linear_mode.ggml_numerics and weights.packed(head_name).layout is Layout.F16
        self.lm_head = LMHead(weights.head(head_name), weights.backend, ggml_f16_head)
        read_rows = weights.file_rows("token_embd.weight")  # set when head() released a tied table's pages
        if read_rows is not None:
            self.embed_tokens.read_from_file(read_rows)
        self.fast_decode = self._fast_decode(weights)

    def _fast_decode(self, weights: WeightSource) -> FastCpuDecode | None:
        """The cpu backend's lean decode step (models/cpu_fast_decode.py) where this model qualifies."""
        if weights.backend.name != "cpu":
            return None
        from bitserve.models.cpu_fast_decode import FastCpuDecode  # NOTE: deferred, imports numba kernels

        return FastCpuDecode.build(self, weights.backend)  # type: ignore[arg-type]

    def gated_activation(
        self, weights: WeightSource, name: str
    ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """The FFN's act(gate) * up. On the cpu backend the fast decode step's numba functions where it may
        run (cpu_fast_decode.py), so both forwards agree to the bit: SiLU in the q8 block mode and for
        ternary models in bitnet mode (the `bitnet` arch; rounded unlike torch's, so such a model's SiLU
        differs from the reference backend's in last bits), relu2 always (rounded as torch's, so the
        reference backend agrees too)."""
        backend = weights.backend
        ternary_int8 = self.projections_may_be_ternary and weights.linear_mode is LinearMode.BITNET
        if backend.name == "cpu" and name == "silu" and (self.q8_blocks or ternary_int8):
            return backend.silu_and_mul  # type: ignore[attr-defined]
        if backend.name == "cpu" and GATED_ACTIVATIONS[name] is relu2_and_mul:
            return backend.relu2_and_mul  # type: ignore[attr-defined]
        return GATED_ACTIVATIONS[name]

    def rope_freq_factors(self, weights: WeightSource) -> torch.Tensor | None:
        return None

    def output_scale(self, weights: WeightSource, prefix: str) -> float | None:
        return None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor] | None = None,
        attn_metadata: AttentionMetadata | None = None,
    ) -> torch.Tensor:
        """input_ids, positions [num_tokens] -> hidden_states [num_tokens, hidden_size] (final norm applied).

        Without kv_caches / attn_metadata the batch is one sequence from position 0 (golden path).
        """
        fast = self.fast_decode
        if fast is not None and fast.applies(input_ids.shape[0], kv_caches, attn_metadata):
            return fast.forward(input_ids, positions, kv_caches, attn_metadata)  # type: ignore[arg-type]
        hidden_states = self.embed_tokens(input_ids)
        for layer_id, layer in enumerate(self.layers):
            kv_cache = kv_caches[layer_id] if kv_caches is not None else None
            hidden_states = layer(hidden_states, positions, self.rotary, kv_cache, attn_metadata)
        return self.norm(hidden_states)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states [num_sampled, hidden_size] -> logits [num_sampled, vocab_size] float32."""
        return self.lm_head(hidden_states)
