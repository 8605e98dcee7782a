"""The vocabulary of an architecture's declaration: a layer recipe (data) and its tensor-name map.

Every supported architecture is declared once, as an `ArchitectureRecipe` in its family's file
(models/llama.py, models/bitnet.py, models/qwen.py, models/gemma.py) and listed in
models/architectures.py. The recipe
says what the shared pre-norm decoder layer holds: which norms and where, the projections and how they
group (q|k|v and gate|up run on one input each, so a backend may stack them), q/k/v biases, per-head
q/k norms, sub-norms, the activation's default, per-projection output scales, RoPE style and frequency
factors; its two name maps give the same tensors' names in a GGUF file and in a transformers checkpoint
(loader/hf_convert.py zips them). models/decoder.py builds the module forward (the oracle) from it, and
lowers it with the loaded weights to a DecoderPlan that each backend compiles into its fast forward
(kernels/plan.py). Adding an architecture is a recipe, a name map and tests; kernel code only for an op
no backend has yet.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from bitserve.layers.rotary import RopeStyle


@dataclass(frozen=True, slots=True)
class TensorNames:
    """Tensor names in the file; per-layer names hold `{layer}`. A projection's optional output scalar
    is its weight's name with `.weight` replaced by `.scale` (the upstream `bitnet` converter's)."""

    token_embedding: str = "token_embd.weight"
    output_norm: str = "output_norm.weight"
    output: str = "output.weight"  # absent: the head is tied to token_embedding
    rope_freqs: str = "rope_freqs.weight"
    attn_norm: str = "blk.{layer}.attn_norm.weight"
    qkv: tuple[str, ...] = (
        "blk.{layer}.attn_q.weight",
        "blk.{layer}.attn_k.weight",
        "blk.{layer}.attn_v.weight",
    )
    qkv_biases: tuple[str, ...] = (
        "blk.{layer}.attn_q.bias",
        "blk.{layer}.attn_k.bias",
        "blk.{layer}.attn_v.bias",
    )
    attn_q_norm: str = "blk.{layer}.attn_q_norm.weight"  # [head_dim], shared by every head
    attn_k_norm: str = "blk.{layer}.attn_k_norm.weight"
    attn_sub_norm: str = "blk.{layer}.attn_sub_norm.weight"
    attn_output: str = "blk.{layer}.attn_output.weight"
    attn_post_norm: str = "blk.{layer}.post_attention_norm.weight"  # Gemma: on Wo's output, before the add
    ffn_norm: str = "blk.{layer}.ffn_norm.weight"
    gate_up: tuple[str, ...] = ("blk.{layer}.ffn_gate.weight", "blk.{layer}.ffn_up.weight")
    ffn_sub_norm: str = "blk.{layer}.ffn_sub_norm.weight"
    ffn_down: str = "blk.{layer}.ffn_down.weight"
    ffn_post_norm: str = "blk.{layer}.post_ffw_norm.weight"  # Gemma: on Wdown's output, before the add

    @staticmethod
    def of_layer(template: str, layer: int) -> str:
        return template.format(layer=layer)

    @staticmethod
    def scale_of(weight_name: str) -> str:
        """blk.N.attn_q.weight -> blk.N.attn_q.scale."""
        return weight_name.removesuffix(".weight") + ".scale"


GGUF_NAMES = TensorNames()  # llama.cpp's (and bitnet.cpp's) names, shared by every GGUF architecture

_HF_LAYER = "model.layers.{layer}."
# transformers' names of the same tensors (LlamaForCausalLM, Qwen2/Qwen3ForCausalLM, BitNetForCausalLM):
# field for field the GGUF map's, so a checkpoint converts by zipping the two (loader/hf_convert.py)
HF_NAMES = TensorNames(
    token_embedding="model.embed_tokens.weight",
    output_norm="model.norm.weight",
    output="lm_head.weight",
    rope_freqs="",  # HF computes Llama 3's frequency factors from config.json's rope_parameters
    attn_norm=_HF_LAYER + "input_layernorm.weight",
    qkv=tuple(_HF_LAYER + f"self_attn.{p}_proj.weight" for p in "qkv"),
    qkv_biases=tuple(_HF_LAYER + f"self_attn.{p}_proj.bias" for p in "qkv"),
    attn_q_norm=_HF_LAYER + "self_attn.q_norm.weight",
    attn_k_norm=_HF_LAYER + "self_attn.k_norm.weight",
    attn_sub_norm=_HF_LAYER + "self_attn.attn_sub_norm.weight",
    attn_output=_HF_LAYER + "self_attn.o_proj.weight",
    attn_post_norm="",  # no such part outside Gemma (its own map: models/gemma.py)
    ffn_norm=_HF_LAYER + "post_attention_layernorm.weight",
    gate_up=(_HF_LAYER + "mlp.gate_proj.weight", _HF_LAYER + "mlp.up_proj.weight"),
    ffn_sub_norm=_HF_LAYER + "mlp.ffn_sub_norm.weight",
    ffn_down=_HF_LAYER + "mlp.down_proj.weight",
    ffn_post_norm="",
)


@dataclass(frozen=True, slots=True)
class ArchitectureRecipe:
    """One architecture's decoder: the layer is norm -> q|k|v [+ biases] -> [per-head q/k RMSNorm] -> RoPE +
    KV cache -> attention (over a sliding window on some layers) ->
    [attn sub-norm] -> Wo [-> post-norm] + residual -> norm -> gate|up -> act(gate) * up -> [ffn sub-norm]
    -> Wdown [-> post-norm] + residual; the token embeddings optionally scaled before the first layer, a
    final norm and the LM head after the last. The fields say which optional parts the architecture has."""

    rope_style: RopeStyle  # NEOX halves, or NORM interleaved pairs (llama.cpp's permuted q/k)
    default_activation: str  # the FFN's gated activation when the file names none (GATED_ACTIVATIONS)
    sub_norms: bool  # BitNet's RMSNorm before Wo and before Wdown
    # float-stored projections whose values are {-s, 0, +s} run as BitLinear (int8 activations)
    ternary_projections: bool
    output_scales: bool  # optional per-projection scalars multiplied into its output (ggml's order)
    rope_freq_factors: bool  # an optional rope_freqs tensor divides each RoPE frequency (Llama 3)
    qkv_biases: bool = False  # q, k and v add a bias vector (Qwen2)
    # no activation key does not mean default_activation: the file's facts decide (loader/model_spec.py's
    # BitNet rule: upstream llama.cpp writes the 2B-4T and 1bitLLM's models as `bitnet` without one)
    activation_from_evidence: bool = False
    qk_norms: bool = False  # each head of q and of k is RMSNorm'd (one [head_dim] weight) before RoPE (Qwen3)
    post_norms: bool = False  # RMSNorms on Wo's and Wdown's outputs before each residual add (Gemma 2/3)
    scaled_embedding: bool = False  # token embeddings multiplied by sqrt(hidden) before layer 0 (Gemma)
    # a file with a sliding window but no per-layer pattern key: every `period`-th layer attends to the
    # whole context, the others to the window (llama.cpp's swa pattern; 0: no sliding layers)
    sliding_window_period: int = 0
    sliding_rope_base: float = 0.0  # the sliding layers' own unscaled RoPE base when the file names none
    # (num_layers, hidden, heads, head_dim) -> the softmax scale; None: 1 / sqrt(head_dim)
    attention_scale: Callable[[int, int, int, int], float] | None = None
    # MiniCPM's scales, read from `<arch>.embedding_scale` / `.residual_scale` / `.logit_scale` (required):
    # embeddings x embedding_scale, each block's output x residual_scale before its add, logits / logit_scale
    file_scales: bool = False
    # a transformers checkpoint stores each RMSNorm weight minus this (Gemma's x * (1 + w)); the GGUF
    # holds the full weight (llama.cpp's converter adds it)
    hf_norm_offset: float = 0.0
    names: TensorNames = field(default=GGUF_NAMES)
    hf_names: TensorNames = field(default=HF_NAMES)  # the same tensors in a transformers checkpoint
