"""Gemma 3 (`gemma3`; the dense Gemma 3 text models and the Gemma3 base of BitNet-embedding): the shared
layer with four norms per layer (before and after attention, before and after the FFN), per-head q/k
RMSNorms, a GELU-tanh gated FFN, token embeddings scaled by sqrt(hidden), a tied head, and sliding-window
attention on five layers of every six (their RoPE base 10000, unscaled; the others' the file's, with its
linear scaling). NEOX RoPE (llama.cpp's converter keeps HF's rotate-half rows).

llama.cpp's Gemma 3 hyper-parameters, kept because a GGUF carries only some of them: the swa pattern is 6
and the sliding layers' RoPE base 10000 unless the file says otherwise; the softmax scale is
1 / sqrt(head_dim), but 1 / sqrt(hidden / heads) for the 62-layer 27B (its query_pre_attn_scalar, 168).
transformers' Gemma3RMSNorm computes x * (1 + w): its checkpoints store w, and a GGUF 1 + w.
"""

from __future__ import annotations

import dataclasses
import math

from bitserve.layers.rotary import RopeStyle
from bitserve.models.recipe import HF_NAMES, ArchitectureRecipe

GEMMA3_27B_LAYERS = 62  # llama.cpp's LLM_TYPE_27B for gemma3, the one size scaled by hidden / heads
_HF_LAYER = "model.layers.{layer}."


def gemma3_attention_scale(num_layers: int, hidden: int, num_heads: int, head_dim: int) -> float:
    """The softmax scale llama.cpp's gemma3 graph multiplies q by (see the module docstring)."""
    if num_layers == GEMMA3_27B_LAYERS:
        return 1.0 / math.sqrt(hidden // num_heads)
    return 1.0 / math.sqrt(head_dim)


# transformers' Gemma3 names: its post_attention_layernorm is the norm after attention (the llama map's
# FFN norm is pre_feedforward_layernorm here)
GEMMA3_HF_NAMES = dataclasses.replace(
    HF_NAMES,
    attn_post_norm=_HF_LAYER + "post_attention_layernorm.weight",
    ffn_norm=_HF_LAYER + "pre_feedforward_layernorm.weight",
    ffn_post_norm=_HF_LAYER + "post_feedforward_layernorm.weight",
)

GEMMA3 = ArchitectureRecipe(
    rope_style=RopeStyle.NEOX,
    default_activation="gelu",
    sub_norms=False,
    ternary_projections=False,
    output_scales=False,
    rope_freq_factors=False,
    qk_norms=True,
    post_norms=True,
    scaled_embedding=True,
    sliding_window_period=6,
    sliding_rope_base=10000.0,
    attention_scale=gemma3_attention_scale,
    hf_norm_offset=1.0,
    hf_names=GEMMA3_HF_NAMES,
)
