"""A transformers checkpoint (its config.json as a dict and its state dict) -> a GGUF file bitserve and
llama.cpp load, by the architecture's two name maps (models/recipe.py: `names` and `hf_names` hold the
same tensors field for field).

What llama.cpp's converter does to the tensors, this does too: q/k rows permuted for a NORM-RoPE
architecture (llama: HF stores rotate-half rows, llama.cpp's `llama` graph rotates interleaved pairs),
the head dropped when tied, norms and biases kept as F32. Projections are written as F32, F16, Q8_0
(ggml's reference rounding, loader/requantize.py), or llama.cpp's Q1_0 / Q2_0 (loader/low_bit_quantize.py,
bytes equal to llama.cpp's). The tokenizer keys come from the caller, as GGUF
metadata (a tokenizer.json converter is not part of this module). Every tensor of the state dict must
have a GGUF name (nothing is dropped silently); one the recipe needs and the checkpoint lacks fails when
the GGUF is loaded, by name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bitserve.errors import InvalidModelFile, UnsupportedModel
from bitserve.kernels.packed import Layout, PackedWeight
from bitserve.layers.rotary import RopeStyle
from bitserve.loader.gguf_types import GGMLType, GGUFValueType
from bitserve.loader.gguf_writer import GGUFBuilder
from bitserve.loader.low_bit_quantize import QUANTIZERS
from bitserve.loader.requantize import quantize_q8_0
from bitserve.models.architectures import ARCHITECTURES
from bitserve.models.recipe import ArchitectureRecipe, TensorNames

# config.json "architectures" -> the GGUF architecture its checkpoint converts to
HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
WEIGHT_TYPES = {
    "F32": GGMLType.F32,
    "F16": GGMLType.F16,
    "Q8_0": GGMLType.Q8_0,
    "Q1_0": GGMLType.Q1_0,
    "Q2_0": GGMLType.Q2_0,
}
MetadataValue = tuple[GGUFValueType, Any, GGUFValueType | None]


def gguf_architecture(config: Mapping[str, Any]) -> str:
    names = config.get("architectures") or []
    for name in names:
        if name in HF_ARCHITECTURES:
            return HF_ARCHITECTURES[name]
    raise UnsupportedModel(
        f"checkpoint architecture {names!r} has no converter",
        hint=f"supported: {', '.join(HF_ARCHITECTURES)}",
    )


def _absent_parts(recipe: ArchitectureRecipe) -> set[str]:
    """The TensorNames fields naming parts this architecture does not have."""
    absent = set() if recipe.qkv_biases else {"qkv_biases"}
    absent |= set() if recipe.qk_norms else {"attn_q_norm", "attn_k_norm"}
    return absent | (set() if recipe.sub_norms else {"attn_sub_norm", "ffn_sub_norm"})


def name_map(recipe: ArchitectureRecipe, num_layers: int) -> dict[str, str]:
    """HF tensor name -> GGUF tensor name for every tensor the architecture has (the two maps' per-layer
    templates expanded)."""
    mapping: dict[str, str] = {}
    absent = _absent_parts(recipe)
    for field in dataclasses.fields(TensorNames):
        if field.name in absent:
            continue
        gguf_side, hf_side = getattr(recipe.names, field.name), getattr(recipe.hf_names, field.name)
        pairs = (
            zip(gguf_side, hf_side, strict=True) if isinstance(gguf_side, tuple) else [(gguf_side, hf_side)]
        )
        for gguf_template, hf_template in pairs:
            if not hf_template:
                continue  # no HF counterpart (rope_freqs)
            layers = range(num_layers) if "{layer}" in hf_template else [0]
            for layer in layers:
                mapping[hf_template.format(layer=layer)] = gguf_template.format(layer=layer)
    return mapping


def _head_dim(config: Mapping[str, Any]) -> int:
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def _num_kv_heads(config: Mapping[str, Any]) -> int:
    return int(config.get("num_key_value_heads") or config["num_attention_heads"])


def _rope_theta(config: Mapping[str, Any]) -> float:
    parameters = config.get("rope_parameters") or {}
    return float(parameters.get("rope_theta", config.get("rope_theta", 10000.0)))


def gguf_metadata(arch: str, config: Mapping[str, Any]) -> dict[str, MetadataValue]:
    """The architecture keys llama.cpp's loader reads, from config.json."""
    u32, f32, string = GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.STRING
    head_dim = _head_dim(config)
    values: dict[str, MetadataValue] = {
        "general.architecture": (string, arch, None),
        "general.name": (string, str(config.get("_name_or_path") or arch), None),
        f"{arch}.context_length": (u32, int(config.get("max_position_embeddings", 4096)), None),
        f"{arch}.embedding_length": (u32, int(config["hidden_size"]), None),
        f"{arch}.block_count": (u32, int(config["num_hidden_layers"]), None),
        f"{arch}.feed_forward_length": (u32, int(config["intermediate_size"]), None),
        f"{arch}.attention.head_count": (u32, int(config["num_attention_heads"]), None),
        f"{arch}.attention.head_count_kv": (u32, _num_kv_heads(config), None),
        f"{arch}.attention.key_length": (u32, head_dim, None),
        f"{arch}.attention.value_length": (u32, head_dim, None),
        f"{arch}.attention.layer_norm_rms_epsilon": (f32, float(config.get("rms_norm_eps", 1e-6)), None),
        f"{arch}.rope.freq_base": (f32, _rope_theta(config), None),
        f"{arch}.rope.dimension_count": (u32, head_dim, None),
        f"{arch}.vocab_size": (u32, int(config["vocab_size"]), None),
    }
    if config.get("hidden_act"):
        values[f"{arch}.hidden_act"] = (string, str(config["hidden_act"]), None)
    return values


def _permute_for_norm_rope(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[heads * D, K] rotate-half rows -> interleaved-pair rows (llama.cpp's converter's permute)."""
    rows, cols = weight.shape
    return weight.reshape(num_heads, 2, rows // num_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def _encoded(name: str, tensor: torch.Tensor, weight_type: str) -> tuple[str, tuple[int, ...], int, bytes]:
    """(name, ggml shape, type id, bytes): matrices in weight_type, vectors (norms, biases) F32."""
    values = tensor.detach().to(torch.float32).contiguous()
    shape = tuple(reversed(values.shape))  # ggml order: ne[0] is the row length
    if values.dim() == 1 or weight_type == "F32":
        return name, shape, int(GGMLType.F32), values.numpy().tobytes()
    if weight_type == "F16":
        return name, shape, int(GGMLType.F16), values.to(torch.float16).numpy().tobytes()
    if weight_type in QUANTIZERS:  # llama.cpp's 1- and 2-bit types, its reference rounding
        return name, shape, int(WEIGHT_TYPES[weight_type]), QUANTIZERS[weight_type](values.numpy()).tobytes()
    rows, cols = values.shape
    packed = PackedWeight(values.view(torch.uint8).reshape(-1), (rows, cols), Layout.F32, "F32")
    return name, shape, int(GGMLType.Q8_0), quantize_q8_0(packed).data.numpy().tobytes()


def gguf_tensors(
    recipe: ArchitectureRecipe, config: Mapping[str, Any], state: Mapping[str, torch.Tensor], weight_type: str
) -> Iterator[tuple[str, tuple[int, ...], int, bytes]]:
    """Every tensor of `state` under its GGUF name (see the module docstring), the token embedding F32."""
    num_layers = int(config["num_hidden_layers"])
    mapping = name_map(recipe, num_layers)
    tied = bool(config.get("tie_word_embeddings", False))
    permuted = {}
    if recipe.rope_style is RopeStyle.NORM:
        q_name, k_name = recipe.hf_names.qkv[0], recipe.hf_names.qkv[1]
        for layer in range(num_layers):
            permuted[q_name.format(layer=layer)] = int(config["num_attention_heads"])
            permuted[k_name.format(layer=layer)] = _num_kv_heads(config)
    for hf_name, tensor in state.items():
        if tied and hf_name == recipe.hf_names.output:
            continue  # the GGUF head is tied: no output.weight
        if hf_name not in mapping:
            raise InvalidModelFile(
                f"checkpoint tensor {hf_name!r} has no GGUF name in this architecture's recipe",
                hint="the checkpoint holds a part the architecture does not declare (models/recipe.py)",
            )
        if hf_name in permuted:
            tensor = _permute_for_norm_rope(tensor, permuted[hf_name])
        is_embedding = hf_name == recipe.hf_names.token_embedding
        yield _encoded(mapping[hf_name], tensor, "F32" if is_embedding else weight_type)


def write_gguf(
    path: str | Path,
    config: Mapping[str, Any],
    state: Mapping[str, torch.Tensor],
    tokenizer: Mapping[str, MetadataValue],
    *,
    weight_type: str = "F32",
) -> Path:
    """Write the checkpoint as a GGUF of its architecture (gguf_architecture) with `tokenizer`'s keys."""
    if weight_type not in WEIGHT_TYPES:
        raise ValueError(f"weight_type {weight_type!r}: one of {', '.join(WEIGHT_TYPES)}")
    arch = gguf_architecture(config)
    recipe = ARCHITECTURES[arch]
    builder = GGUFBuilder()
    for key, (value_type, value, array_type) in (gguf_metadata(arch, config) | dict(tokenizer)).items():
        builder.add_kv(key, value_type, value, array_type)
    for name, shape, type_id, data in gguf_tensors(recipe, config, state, weight_type):
        builder.add_tensor(name, shape, type_id, np.frombuffer(data, dtype=np.uint8))
    return builder.write(path)
