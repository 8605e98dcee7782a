"""Qwen family: `qwen2` (Qwen2 / Qwen2.5: biases on q, k and v) and `qwen3` (Qwen3, PrismML's Bonsai:
an RMSNorm over each head of q and k before RoPE, no biases). Both NEOX RoPE (llama.cpp's converter keeps
HF's rotate-half q/k rows), SiLU-gated FFN, no sub-norms; the head is tied where the file has no
`output.weight`. head_dim comes from `attention.key_length` (Qwen3's 128 is not hidden / heads in general).
"""

from __future__ import annotations

import dataclasses

from bitserve.layers.rotary import RopeStyle
from bitserve.models.recipe import ArchitectureRecipe

QWEN2 = ArchitectureRecipe(
    rope_style=RopeStyle.NEOX,
    default_activation="silu",
    sub_norms=False,
    ternary_projections=False,
    output_scales=False,
    rope_freq_factors=False,
    qkv_biases=True,
)

# Qwen3: the same layer without biases, with per-head q/k norms
QWEN3 = dataclasses.replace(QWEN2, qkv_biases=False, qk_norms=True)
