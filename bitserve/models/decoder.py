"""The pre-norm decoder-only transformer every architecture is, built from its recipe (models/recipe.py).

`DecoderModel(spec, recipe, weights)` builds the module forward (the oracle on every backend) from the
recipe's parts and the loader's prepared weights, then lowers both to a DecoderPlan (kernels/plan.py)
that the backend compiles once into its fast forward (`KernelBackend.compile_decoder`; None: the module
forward runs every step). Forward contract, the one the engine calls: input_ids [num_tokens], positions
[num_tokens], one KV tensor per layer and AttentionMetadata -> hidden_states [num_tokens, hidden_size];
compute_logits picks sampled rows. Never names a backend or a weight class.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from bitserve.errors import UnsupportedModel
from bitserve.kernels.attention_metadata import AttentionMetadata
from bitserve.kernels.backend import FusedOps, LinearMode, PreparedLinear
from bitserve.kernels.packed import Layout
from bitserve.kernels.plan import CompiledDecoder, DecoderPlan, LayerPlan, RopeTables
from bitserve.layers.activation import GATED_ACTIVATIONS
from bitserve.layers.attention import PagedAttention
from bitserve.layers.embedding import LMHead, TokenEmbedding
from bitserve.layers.linear import Linear, LinearGroup
from bitserve.layers.norm import RMSNorm
from bitserve.layers.rotary import RopeStyle, RotaryEmbedding
from bitserve.models.recipe import ArchitectureRecipe, TensorNames
from bitserve.models.spec import ModelSpec
from bitserve.models.weights import WeightSource

GatedActivation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class _LayerBuilder:
    """What every layer of one model is built with: the recipe's names, the backend's fused ops."""

    def __init__(self, spec: ModelSpec, recipe: ArchitectureRecipe, weights: WeightSource) -> None:
        self.spec, self.recipe, self.weights = spec, recipe, weights
        self.names: TensorNames = recipe.names
        self.fused: FusedOps | None = weights.backend.fused_ops()  # None: eager torch layers
        self.ggml = weights.linear_mode.ggml_numerics  # bitnet.cpp's f32 arithmetic (layers/ggml_ops.py)

    def norm(self, name: str) -> RMSNorm:
        return RMSNorm(self.weights.vector(name), self.spec.rms_norm_eps, self.fused, self.ggml)

    def layer_norm(self, template: str, layer: int) -> RMSNorm:
        return self.norm(TensorNames.of_layer(template, layer))

    def sub_norm(self, template: str, layer: int) -> RMSNorm | None:
        """A BitNet sub-norm, None for a recipe without them."""
        return self.layer_norm(template, layer) if self.recipe.sub_norms else None

    def post_norm(self, template: str, layer: int) -> RMSNorm | None:
        """A Gemma norm on a block's output before its residual add, None for a recipe without them."""
        return self.layer_norm(template, layer) if self.recipe.post_norms else None

    def _scale(self, weight_name: str) -> float | None:
        name = TensorNames.scale_of(weight_name)
        if not self.recipe.output_scales or not self.weights.has(name):
            return None
        return float(self.weights.vector(name)[0])

    def _weight(self, name: str) -> PreparedLinear:
        return self.weights.linear(name, may_be_ternary=self.recipe.ternary_projections)

    def qkv_bias(self, layer: int) -> torch.Tensor | None:
        """q|k|v's biases side by side, f32 [(H + 2 KVH) * D] (the group's output columns), or None."""
        if not self.recipe.qkv_biases:
            return None
        names = [TensorNames.of_layer(t, layer) for t in self.names.qkv_biases]
        return torch.cat([self.weights.vector(name) for name in names])

    def qk_norms(self, layer: int) -> tuple[RMSNorm, RMSNorm] | tuple[None, None]:
        """The per-head RMSNorms of q and k (weights f32 [head_dim]), or (None, None)."""
        if not self.recipe.qk_norms:
            return None, None
        names = self.names
        return self.layer_norm(names.attn_q_norm, layer), self.layer_norm(names.attn_k_norm, layer)

    def group(self, templates: tuple[str, ...], layer: int) -> LinearGroup:
        names = [TensorNames.of_layer(t, layer) for t in templates]
        weights = [self._weight(n) for n in names]
        return LinearGroup(self.weights.backend, weights, [self._scale(n) for n in names])

    def linear(self, template: str, layer: int) -> Linear:
        name = TensorNames.of_layer(template, layer)
        return Linear(self.weights.backend, self._weight(name), self._scale(name))


class DecoderLayer(nn.Module):
    def __init__(self, build: _LayerBuilder, layer_id: int, act_and_mul: GatedActivation) -> None:
        super().__init__()
        spec, names = build.spec, build.names
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.attn_norm = build.layer_norm(names.attn_norm, layer_id)
        self.qkv = build.group(names.qkv, layer_id)
        self.qkv_bias = build.qkv_bias(layer_id)  # f32 [(H + 2 KVH) * D] or None
        self.q_norm, self.k_norm = build.qk_norms(layer_id)
        self.sliding = spec.is_sliding(layer_id)  # attends over the last spec.sliding_window positions
        self.attn = PagedAttention(
            spec.num_heads,
            spec.num_kv_heads,
            spec.head_dim,
            build.fused,
            ggml_numerics=build.ggml,
            scale=spec.attention_scale,
            sliding_window=spec.sliding_window if self.sliding else 0,
        )
        self.attn_sub_norm = build.sub_norm(names.attn_sub_norm, layer_id)
        self.o_proj = build.linear(names.attn_output, layer_id)
        self.attn_post_norm = build.post_norm(names.attn_post_norm, layer_id)
        self.ffn_norm = build.layer_norm(names.ffn_norm, layer_id)
        self.gate_up = build.group(names.gate_up, layer_id)
        self.act_and_mul = act_and_mul
        self.ffn_sub_norm = build.sub_norm(names.ffn_sub_norm, layer_id)
        self.down_proj = build.linear(names.ffn_down, layer_id)
        self.ffn_post_norm = build.post_norm(names.ffn_post_norm, layer_id)
        self.residual_scale = spec.residual_scale  # each block's output x this before its add (MiniCPM)

    def forward(
        self,
        hidden_states: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        kv_cache: torch.Tensor | None,
        attn_metadata: AttentionMetadata | None,
    ) -> torch.Tensor:
        q, k, v = self._qkv(self.attn_norm(hidden_states))
        q, k = rotary(positions, q, k)
        attn_out = self.attn(q, k, v, kv_cache, attn_metadata)  # [num_tokens, num_heads * head_dim]
        if self.attn_sub_norm is not None:
            attn_out = self.attn_sub_norm(attn_out)
        hidden_states = hidden_states + self._block_output(self.o_proj(attn_out), self.attn_post_norm)
        gate, up = self.gate_up(self.ffn_norm(hidden_states))
        ffn_out = self.act_and_mul(gate, up)  # [num_tokens, intermediate_size]
        if self.ffn_sub_norm is not None:
            ffn_out = self.ffn_sub_norm(ffn_out)
        return hidden_states + self._block_output(self.down_proj(ffn_out), self.ffn_post_norm)

    def _block_output(self, out: torch.Tensor, post_norm: RMSNorm | None) -> torch.Tensor:
        """An attention or FFN block's output [T, hidden] as it is added to the residual: post-normed
        (Gemma), scaled (MiniCPM)."""
        if post_norm is not None:
            out = post_norm(out)
        return out if self.residual_scale == 1.0 else out * self.residual_scale

    def _qkv(self, normed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """normed f32 [T, hidden] -> q [T, H, D], k and v [T, KVH, D]: biases added, heads of q and k
        normed where the recipe has them (before RoPE)."""
        num_tokens = normed.shape[0]
        q, k, v = self.qkv(normed)
        if self.qkv_bias is not None:
            q_end, k_end = q.shape[1], q.shape[1] + k.shape[1]
            bias = self.qkv_bias
            q, k, v = q + bias[:q_end], k + bias[q_end:k_end], v + bias[k_end:]
        # reshape, not view: a stacked q/k/v output is column slices (a copy only when num_tokens > 1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            # one [head_dim] weight over every head: rows of [T * heads, D]
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(num_tokens, self.num_heads, self.head_dim)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(num_tokens, self.num_kv_heads, self.head_dim)
        return q, k, v

    def plan(self) -> LayerPlan:
        def weight_of(norm: RMSNorm | None) -> torch.Tensor | None:
            return None if norm is None else norm.weight.detach()

        return LayerPlan(
            attn_norm=self.attn_norm.weight.detach(),
            qkv=self.qkv.projection,
            qkv_bias=self.qkv_bias,
            q_norm=weight_of(self.q_norm),
            k_norm=weight_of(self.k_norm),
            attn_sub_norm=weight_of(self.attn_sub_norm),
            o_proj=self.o_proj.projection,
            ffn_norm=self.ffn_norm.weight.detach(),
            gate_up=self.gate_up.projection,
            ffn_sub_norm=weight_of(self.ffn_sub_norm),
            down=self.down_proj.projection,
            attn_post_norm=weight_of(self.attn_post_norm),
            ffn_post_norm=weight_of(self.ffn_post_norm),
            sliding_window=self.attn.sliding_window,
            residual_scale=self.residual_scale,
        )


def gated_activation(spec: ModelSpec, recipe: ArchitectureRecipe, weights: WeightSource) -> GatedActivation:
    """The FFN's act(gate) * up: the backend's own where its compiled forward computes it its own way
    (KernelBackend.gated_activation), else the layers' torch function."""
    if spec.activation not in GATED_ACTIVATIONS:
        raise UnsupportedModel(
            f"FFN activation {spec.activation!r} is not supported",
            hint=f"supported: {', '.join(GATED_ACTIVATIONS)}",
        )
    backend = weights.backend
    ternary_int8 = recipe.ternary_projections and weights.linear_mode is LinearMode.BITNET
    int8_projections = ternary_int8 or backend.block_activations in ("q8", "ggml")
    own = backend.gated_activation(spec.activation, int8_projections=int8_projections)
    return own if own is not None else GATED_ACTIVATIONS[spec.activation]


class DecoderModel(nn.Module):
    """One model of any architecture: the recipe's layers, its module forward and its compiled one."""

    def __init__(self, spec: ModelSpec, recipe: ArchitectureRecipe, weights: WeightSource) -> None:
        super().__init__()
        self.spec, self.recipe = spec, recipe
        build = _LayerBuilder(spec, recipe, weights)
        names = recipe.names
        act_and_mul = gated_activation(spec, recipe, weights)
        self.embed_tokens = TokenEmbedding(weights.packed(names.token_embedding))
        self.rotary = self._rotary(build)
        self.sliding_rotary = self._sliding_rotary(build)  # the sliding layers' own RoPE, or None
        self.layers = nn.ModuleList(DecoderLayer(build, i, act_and_mul) for i in range(spec.num_layers))
        self.norm = build.norm(names.output_norm)
        head_name = names.token_embedding if spec.tie_word_embeddings else names.output
        ggml_f16_head = build.ggml and weights.packed(head_name).layout is Layout.F16
        self.lm_head = LMHead(weights.head(head_name), weights.backend, ggml_f16_head)
        read_rows = weights.file_rows(names.token_embedding)  # set when head() released a tied table's pages
        if read_rows is not None:
            self.embed_tokens.read_from_file(read_rows)
        # the backend's fast forward of the layers, compiled once (None: the module forward runs)
        self.compiled: CompiledDecoder | None = weights.backend.compile_decoder(self.plan())

    def _rotary(self, build: _LayerBuilder) -> RotaryEmbedding:
        spec, names = self.spec, self.recipe.names
        has_factors = self.recipe.rope_freq_factors and build.weights.has(names.rope_freqs)
        return RotaryEmbedding(
            spec.rope_dim,
            spec.rope_theta,
            spec.max_model_len,
            spec.rope_style,
            freq_factors=build.weights.vector(names.rope_freqs) if has_factors else None,
            position_scale=spec.rope_position_scale,
            fused=build.fused,
            ggml_numerics=build.ggml,
        )

    def _sliding_rotary(self, build: _LayerBuilder) -> RotaryEmbedding | None:
        """Sliding layers with a RoPE base of their own (Gemma 3: 10000, unscaled), else None."""
        spec = self.spec
        if not spec.sliding_layers or not spec.sliding_rope_theta:
            return None
        return RotaryEmbedding(
            spec.rope_dim,
            spec.sliding_rope_theta,
            spec.max_model_len,
            spec.rope_style,
            fused=build.fused,
            ggml_numerics=build.ggml,
        )

    def _layer_rotary(self, layer: DecoderLayer) -> RotaryEmbedding:
        return self.sliding_rotary if layer.sliding and self.sliding_rotary is not None else self.rotary

    def plan(self) -> DecoderPlan:
        """This model lowered to data for the backend to compile (kernels/plan.py)."""
        spec, rotary = self.spec, self.rotary
        sliding = self.sliding_rotary
        return DecoderPlan(
            layers=tuple(layer.plan() for layer in self.layers),
            num_heads=spec.num_heads,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            rms_norm_eps=spec.rms_norm_eps,
            activation=spec.activation,
            act_and_mul=self.layers[0].act_and_mul,
            attn_scale=self.layers[0].attn.scale,
            rope=RopeTables(rotary.cos, rotary.sin, rotary.rope_dim, rotary.style is RopeStyle.NEOX),
            ggml_numerics=self.layers[0].attn.ggml_numerics,
            embedding=self.embed_tokens.table,
            final_norm=self.norm.weight.detach(),
            head=self.lm_head.weight,
            tie_word_embeddings=spec.tie_word_embeddings,
            sliding_rope=None
            if sliding is None
            else RopeTables(sliding.cos, sliding.sin, sliding.rope_dim, sliding.style is RopeStyle.NEOX),
            embedding_scale=spec.embedding_scale,
            final_logit_softcap=spec.final_logit_softcap,
            logit_scale=spec.logit_scale,
        )

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
        hidden_states = self.embed_tokens(input_ids)
        if self.spec.embedding_scale != 1.0:
            hidden_states = hidden_states * self.spec.embedding_scale
        compiled = self.compiled
        if compiled is not None and compiled.applies(input_ids.shape[0], kv_caches, attn_metadata):
            assert kv_caches is not None  # invariant: applies() holds only with caches and metadata
            return self.norm(compiled.run_layers(hidden_states, positions, kv_caches, attn_metadata))
        for layer_id, layer in enumerate(self.layers):
            kv_cache = kv_caches[layer_id] if kv_caches is not None else None
            rotary = self._layer_rotary(layer)
            hidden_states = layer(hidden_states, positions, rotary, kv_cache, attn_metadata)
        return self.norm(hidden_states)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states [num_sampled, hidden_size] -> logits [num_sampled, vocab_size] float32."""
        logits = self.lm_head(hidden_states)
        if self.spec.logit_scale != 1.0:
            logits = logits / self.spec.logit_scale
        cap = self.spec.final_logit_softcap
        return logits if not cap else torch.tanh(logits / cap) * cap
