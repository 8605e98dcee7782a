"""Llama family (SmolLM2; ternary Llama3/Falcon3 files): NORM RoPE on the converter-permuted q/k,
SiLU-gated FFN, no sub-norms, separate `output.weight` when present, optional Llama-3 `rope_freqs`."""

from __future__ import annotations

import torch

from bitserve.models.decoder import DecoderModel
from bitserve.models.weights import WeightSource


class LlamaForCausalLM(DecoderModel):
    projections_may_be_ternary = False

    def rope_freq_factors(self, weights: WeightSource) -> torch.Tensor | None:
        return weights.vector("rope_freqs.weight") if weights.has("rope_freqs.weight") else None
