"""MiniCPM (`minicpm`; OpenBMB's MiniCPM and the ternary BitCPM4): the llama layer (NORM RoPE on the
converter-permuted q/k, SiLU-gated FFN, tied head) with three scales from the file, as llama.cpp's graph
applies them: token embeddings x `minicpm.embedding_scale` (config scale_emb), each attention and FFN
output x `minicpm.residual_scale` (scale_depth / sqrt(layers)) before its residual add, and the logits
divided by `minicpm.logit_scale` (hidden / dim_model_base). LongRoPE files (rope_factors_long / _short
tensors, MiniCPM 3 / 4 at long context) are refused at load (loader/model_spec.py).
"""

from __future__ import annotations

import dataclasses

from bitserve.models.llama import LLAMA

MINICPM = dataclasses.replace(LLAMA, rope_freq_factors=False, file_scales=True)
LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")
