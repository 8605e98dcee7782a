"""ModelSpec: the load-time facts of a model that every other part reads. Frozen.

Defined beside the models that consume it; the loader derives it from GGUF metadata
(`loader/model_spec.py`), so loader imports models and never the reverse.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from bitserve.layers.rotary import RopeStyle


@dataclass(frozen=True, slots=True)
class ModelSpec:
    architecture: str
    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_model_len: int
    rope_dim: int
    rope_theta: float
    rope_style: RopeStyle
    rope_position_scale: float
    rms_norm_eps: float
    activation: str
    has_sub_norms: bool
    tie_word_embeddings: bool
    activation_reason: str = "the architecture's default"  # why `activation` (inspect and the load log)
    embedding_scale: float = 1.0  # token embeddings are multiplied by it before layer 0 (Gemma: sqrt(hidden))
    attention_scale: float = 0.0  # the softmax scale; 0: 1 / sqrt(head_dim)
    sliding_window: int = 0  # a sliding layer's token attends to the last that many positions (its own incl.)
    sliding_layers: tuple[int, ...] = ()  # the layers attending over the window; the others see everything
    sliding_rope_theta: float = 0.0  # the sliding layers' RoPE base, unscaled (0: rope_theta, scaled)
    final_logit_softcap: float = 0.0  # logits = cap * tanh(logits / cap) where > 0 (Gemma 2)
    residual_scale: float = 1.0  # each block's output x this before its residual add (MiniCPM)
    logit_scale: float = 1.0  # logits are divided by it (MiniCPM: hidden / dim_model_base)

    @property
    def softmax_scale(self) -> float:
        """The attention softmax scale in effect: `attention_scale`, or 1 / sqrt(head_dim) where unset."""
        return self.attention_scale or 1.0 / math.sqrt(self.head_dim)  # PagedAttention's own expression

    def is_sliding(self, layer: int) -> bool:
        return self.sliding_window > 0 and layer in self.sliding_layers
