"""config.json -> the GGUF architecture keys llama.cpp's loader reads (what its convert_hf_to_gguf.py
writes), and the refusals of configs whose model those keys cannot describe. Shared by serving a checkpoint
directory and converting it (loader/hf_checkpoint.py, loader/hf_convert.py).

RoPE: plain RoPE everywhere; Gemma 3's per-layer-type parameters (transformers 5's `rope_parameters`
{"full_attention": ..., "sliding_attention": ...}, or transformers 4's rope_theta / rope_local_base_freq /
rope_scaling) with linear scaling on the full-attention layers, as its 4B-27B checkpoints have. Anything
else scaled (Llama 3's frequency factors, YaRN, ...) is refused: ignoring it would give wrong answers past
the first few hundred tokens.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from bitserve.errors import UnsupportedModel
from bitserve.loader.gguf_types import GGUFValueType
from bitserve.models.gemma import gemma3_attention_scale

MetadataValue = tuple[GGUFValueType, Any, GGUFValueType | None]
GEMMA3_SLIDING_ROPE_BASE = 10000.0  # what llama.cpp assumes when the file has no rope.freq_base_swa
GEMMA3_PERIOD = 6  # llama.cpp's gemma3 swa pattern
_TANH_GELUS = ("gelu_pytorch_tanh", "gelu_new")  # transformers' names of the tanh GELU llama.cpp runs


def num_kv_heads(config: Mapping[str, Any]) -> int:
    return int(config.get("num_key_value_heads") or config["num_attention_heads"])


def head_dim(config: Mapping[str, Any]) -> int:
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def _rope_kind(parameters: Mapping[str, Any]) -> str:
    return str(parameters.get("rope_type", parameters.get("type", "default")) or "default")


def _layer_type_rope(config: Mapping[str, Any], layer_type: str) -> dict[str, Any]:
    """One Gemma 3 layer type's RoPE parameters, from either transformers' config layout."""
    parameters = config.get("rope_parameters") or {}
    if layer_type in parameters:
        return dict(parameters[layer_type])
    if layer_type == "sliding_attention":
        return {"rope_type": "default", "rope_theta": config.get("rope_local_base_freq", 10000.0)}
    scaling = dict(config.get("rope_scaling") or {})
    return scaling | {"rope_theta": config.get("rope_theta", 1_000_000.0)}


def check_rope(arch: str, config: Mapping[str, Any]) -> None:
    """Refuse a RoPE the written keys cannot describe (see the module docstring)."""
    if arch == "gemma3":
        full, sliding = (_layer_type_rope(config, t) for t in ("full_attention", "sliding_attention"))
        if _rope_kind(full) not in ("default", "linear") or _rope_kind(sliding) != "default":
            raise UnsupportedModel(
                f"Gemma 3 RoPE {_rope_kind(full)!r} / {_rope_kind(sliding)!r} is not converted "
                "(plain or linear on full-attention layers, plain on sliding ones)"
            )
        return
    for key in ("rope_parameters", "rope_scaling"):
        kind = _rope_kind(config.get(key) or {})
        if kind != "default":
            raise UnsupportedModel(
                f"config.json {key}.rope_type {kind!r} is not converted (plain RoPE only)",
                hint="convert it with llama.cpp's convert_hf_to_gguf.py and serve the GGUF",
            )


def check_gemma3(config: Mapping[str, Any]) -> None:
    """What a gemma3 GGUF cannot say, refused: llama.cpp derives the softmax scale and the layer pattern
    itself (models/gemma.py), and has no soft-capping for gemma3."""
    layers, hidden = int(config["num_hidden_layers"]), int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    implied = gemma3_attention_scale(layers, hidden, heads, head_dim(config))
    scalar = config.get("query_pre_attn_scalar", head_dim(config))
    problems = []
    if not isinstance(scalar, int | float) or scalar <= 0 or not math.isclose(scalar**-0.5, implied):
        problems.append(f"query_pre_attn_scalar {scalar!r} is not the {round(implied**-2)} llama.cpp implies")
    pattern = [
        "full_attention" if (i + 1) % GEMMA3_PERIOD == 0 else "sliding_attention" for i in range(layers)
    ]
    if config.get("layer_types") not in (None, pattern):
        problems.append("layer_types are not five sliding layers to one full one")
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if config.get(key):
            problems.append(f"{key} is set")
    activation = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
    if activation not in _TANH_GELUS:
        problems.append(f"hidden_activation {activation!r} is not the tanh GELU")
    if config.get("use_bidirectional_attention"):
        problems.append("use_bidirectional_attention is set (an encoder)")
    if problems:
        raise UnsupportedModel("this Gemma 3 checkpoint cannot be served as gemma3: " + "; ".join(problems))


def _rope_theta(arch: str, config: Mapping[str, Any]) -> float:
    if arch == "gemma3":
        return float(_layer_type_rope(config, "full_attention").get("rope_theta", 1_000_000.0))
    parameters = config.get("rope_parameters") or {}
    return float(parameters.get("rope_theta", config.get("rope_theta", 10000.0)))


def _gemma3_keys(config: Mapping[str, Any]) -> dict[str, MetadataValue]:
    u32, f32, string = GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.STRING
    values: dict[str, MetadataValue] = {
        "gemma3.attention.sliding_window": (u32, int(config.get("sliding_window") or 4096), None)
    }
    full = _layer_type_rope(config, "full_attention")
    if _rope_kind(full) == "linear":
        values["gemma3.rope.scaling.type"] = (string, "linear", None)
        values["gemma3.rope.scaling.factor"] = (f32, float(full["factor"]), None)
    sliding_base = float(_layer_type_rope(config, "sliding_attention").get("rope_theta", 10000.0))
    if sliding_base != GEMMA3_SLIDING_ROPE_BASE:  # newer llama.cpp reads it; older ones assume 10000
        values["gemma3.rope.freq_base_swa"] = (f32, sliding_base, None)
    return values


def _minicpm_keys(config: Mapping[str, Any]) -> dict[str, MetadataValue]:
    """MiniCPM's three scales, as llama.cpp's converter derives them from config.json."""
    f32 = GGUFValueType.FLOAT32
    try:
        scales = {
            "embedding_scale": float(config["scale_emb"]),
            "residual_scale": float(config["scale_depth"]) / math.sqrt(int(config["num_hidden_layers"])),
            "logit_scale": int(config["hidden_size"]) / float(config["dim_model_base"]),
        }
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as error:
        raise UnsupportedModel(
            f"a MiniCPM config.json needs numeric scale_emb, scale_depth and dim_model_base ({error!r})"
        ) from error
    return {f"minicpm.{key}": (f32, value, None) for key, value in scales.items()}


def gguf_metadata(arch: str, config: Mapping[str, Any]) -> dict[str, MetadataValue]:
    """The architecture keys llama.cpp's loader reads, from config.json."""
    u32, f32, string = GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.STRING
    dim = head_dim(config)
    values: dict[str, MetadataValue] = {
        "general.architecture": (string, arch, None),
        "general.name": (string, str(config.get("_name_or_path") or arch), None),
        f"{arch}.context_length": (u32, int(config.get("max_position_embeddings", 4096)), None),
        f"{arch}.embedding_length": (u32, int(config["hidden_size"]), None),
        f"{arch}.block_count": (u32, int(config["num_hidden_layers"]), None),
        f"{arch}.feed_forward_length": (u32, int(config["intermediate_size"]), None),
        f"{arch}.attention.head_count": (u32, int(config["num_attention_heads"]), None),
        f"{arch}.attention.head_count_kv": (u32, num_kv_heads(config), None),
        f"{arch}.attention.key_length": (u32, dim, None),
        f"{arch}.attention.value_length": (u32, dim, None),
        f"{arch}.attention.layer_norm_rms_epsilon": (f32, float(config.get("rms_norm_eps", 1e-6)), None),
        f"{arch}.rope.freq_base": (f32, _rope_theta(arch, config), None),
        f"{arch}.rope.dimension_count": (u32, dim, None),
        f"{arch}.vocab_size": (u32, int(config["vocab_size"]), None),
    }
    if arch == "gemma3":  # check_gemma3 passed only the tanh GELU: llama.cpp's "gelu"
        values[f"{arch}.hidden_act"] = (string, "gelu", None)
    elif config.get("hidden_act"):
        values[f"{arch}.hidden_act"] = (string, str(config["hidden_act"]), None)
    if arch == "gemma3":
        values |= _gemma3_keys(config)
    if arch == "minicpm":
        values |= _minicpm_keys(config)
    return values
