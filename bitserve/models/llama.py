"""Llama family (SmolLM2; ternary Llama3/Falcon3 files): NORM RoPE on the converter-permuted q/k,
SiLU-gated FFN, no sub-norms, separate `output.weight` when present, optional Llama-3 `rope_freqs`."""

from __future__ import annotations

from bitserve.layers.rotary import RopeStyle
from bitserve.models.recipe import ArchitectureRecipe

LLAMA = ArchitectureRecipe(
    rope_style=RopeStyle.NORM,
    default_activation="silu",
    sub_norms=False,
    ternary_projections=False,
    output_scales=False,
    rope_freq_factors=True,
)
