"""BitNet b1.58 (`bitnet-b1.58`, `bitnet-25`: official 2B-4T) and upstream `bitnet` (1bitLLM).

Ternary projections with attn/ffn sub-norms before Wo / Wdown, NEOX RoPE, tied head. `bitnet` files
may carry a scalar `blk.N.<name>.scale` per projection, multiplied into its output (ggml's order).
"""

from __future__ import annotations

from bitserve.models.decoder import DecoderModel
from bitserve.models.weights import WeightSource


class BitNetForCausalLM(DecoderModel):
    projections_may_be_ternary = True

    def output_scale(self, weights: WeightSource, prefix: str) -> float | None:
        name = f"{prefix}.scale"
        if not weights.has(name):
            return None
        return float(weights.vector(name)[0])
