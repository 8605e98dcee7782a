"""ModelSpec: the load-time facts of a model that every other part reads. Frozen.

Defined beside the models that consume it; the loader derives it from GGUF metadata
(`loader/model_spec.py`), so loader imports models and never the reverse.
"""

from __future__ import annotations

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
