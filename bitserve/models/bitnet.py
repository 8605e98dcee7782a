"""BitNet b1.58: Microsoft's `bitnet-b1.58` / `bitnet-25` (the official 2B-4T, ReLU²) and upstream
llama.cpp's `bitnet` (1bitLLM, SiLU unless the file says otherwise).

Ternary projections with attn/ffn sub-norms before Wo / Wdown, NEOX RoPE, tied head. `bitnet` files may
carry a scalar `blk.N.<name>.scale` per projection, multiplied into its output (ggml's order).
"""

from __future__ import annotations

import dataclasses

from bitserve.layers.rotary import RopeStyle
from bitserve.models.recipe import ArchitectureRecipe

BITNET_B158 = ArchitectureRecipe(
    rope_style=RopeStyle.NEOX,
    default_activation="relu2",
    sub_norms=True,
    ternary_projections=True,
    output_scales=True,
    rope_freq_factors=False,
)

# upstream llama.cpp's `bitnet` converter writes the same layer; its default activation is SiLU
BITNET = dataclasses.replace(BITNET_B158, default_activation="silu", activation_from_evidence=True)
