"""GGUF metadata -> ModelSpec (models/spec.py): the load-time facts every other part reads. Derived once.

An unsupported architecture fails here with the list of supported ones (the keys of
models.architectures.ARCHITECTURES).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from bitserve.errors import InvalidModelFile, UnsupportedModel
from bitserve.models.architectures import ARCHITECTURES
from bitserve.models.minicpm import LONGROPE_TENSORS
from bitserve.models.recipe import ArchitectureRecipe
from bitserve.models.spec import ModelSpec

SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)


def _require(metadata: Mapping[str, Any], key: str, path: str | None) -> Any:
    if key not in metadata:
        raise InvalidModelFile(
            f"missing metadata key {key!r}",
            path=path,
            hint="the file was not written by a complete GGUF converter",
        )
    return metadata[key]


def _positive_int(metadata: Mapping[str, Any], key: str, path: str | None, default: int | None = None) -> int:
    value = metadata.get(key, default) if default is not None else _require(metadata, key, path)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidModelFile(f"metadata {key!r} = {value!r}", path=path, expected="a positive integer")
    return value


def _activation(
    metadata: Mapping[str, Any], arch: str, recipe: ArchitectureRecipe, heads: tuple[int, int]
) -> tuple[str, str]:
    """The FFN's gated activation and why: the file's key, else (a recipe with activation_from_evidence:
    `bitnet`) the evidence, else the architecture's default."""
    for key in (f"{arch}.hidden_act", f"{arch}.hidden_activation"):
        value = metadata.get(key)
        if isinstance(value, str):
            return value.lower(), f"{key} in the file"
    if recipe.activation_from_evidence:
        return _bitnet_activation(metadata, *heads)
    return recipe.default_activation, f"the {arch} default"


def _bitnet_activation(metadata: Mapping[str, Any], num_heads: int, num_kv_heads: int) -> tuple[str, str]:
    """Upstream llama.cpp's converter writes both BitNet families as `bitnet` without an activation key:
    1bitLLM's bitnet_b1_58 models (SiLU, multi-head attention, a SentencePiece Llama-2 vocabulary) and
    Microsoft's b1.58 2B-4T (ReLU², 20 query heads over 5 KV heads, a byte-level BPE Llama-3
    vocabulary). SiLU on the 2B-4T is silently wrong (wikitext perplexity 99.8 against 17.1 with ReLU²,
    llama.cpp #25885), so the file's own facts decide."""
    name = str(metadata.get("general.name", "")) + " " + str(metadata.get("general.basename", ""))
    if "2b-4t" in name.lower():
        return "relu2", "general.name names BitNet b1.58 2B-4T, trained with ReLU²"
    byte_level = metadata.get("tokenizer.ggml.model") == "gpt2"
    if num_kv_heads < num_heads and byte_level:
        return "relu2", (
            "grouped KV heads and a byte-level BPE vocabulary: the 2B-4T family (ReLU²); "
            "1bitLLM's SiLU models have neither (--hidden-act overrides)"
        )
    return "silu", "no grouped KV heads or no byte-level BPE vocabulary: 1bitLLM's bitnet_b1_58 (SiLU)"


def _rope_position_scale(metadata: Mapping[str, Any], arch: str, path: str | None) -> float:
    scaling = metadata.get(f"{arch}.rope.scaling.type", "none")
    factor = float(
        metadata.get(f"{arch}.rope.scaling.factor", metadata.get(f"{arch}.rope.scale_linear", 1.0))
    )
    if scaling in ("none", "linear") and factor > 0:
        return 1.0 / factor if scaling == "linear" else 1.0
    raise UnsupportedModel(
        f"rope scaling {scaling!r} (factor {factor}) is not supported",
        path=path,
        hint="supported: none, linear",
    )


def _sliding_layers(
    metadata: Mapping[str, Any], arch: str, recipe: ArchitectureRecipe, num_layers: int, path: str | None
) -> tuple[int, tuple[int, ...]]:
    """(window, the layers attending over it) of a recipe with sliding layers: the window from
    `<arch>.attention.sliding_window` (required there, as llama.cpp requires it), the layers from
    `<arch>.attention.sliding_window_pattern` (a period, or a bool per layer) else the recipe's period:
    layer i slides unless (i + 1) % period == 0."""
    if not recipe.sliding_window_period:
        return 0, ()
    window = _positive_int(metadata, f"{arch}.attention.sliding_window", path)
    pattern = metadata.get(f"{arch}.attention.sliding_window_pattern", recipe.sliding_window_period)
    if isinstance(pattern, list | tuple):
        if len(pattern) != num_layers or not all(isinstance(flag, bool) for flag in pattern):
            raise InvalidModelFile(
                f"metadata {arch}.attention.sliding_window_pattern is not one bool per layer", path=path
            )
        return window, tuple(i for i, sliding in enumerate(pattern) if sliding)
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern <= 0:
        raise InvalidModelFile(
            f"metadata {arch}.attention.sliding_window_pattern = {pattern!r}", path=path, expected="a period"
        )
    return window, tuple(i for i in range(num_layers) if (i + 1) % pattern)


def _refuse_attention_softcap(metadata: Mapping[str, Any], arch: str, path: str | None) -> None:
    """Soft-capped attention scores (Gemma 2's tanh inside the softmax) have no kernel: refused, never
    ignored."""
    cap = metadata.get(f"{arch}.attn_logit_softcapping")
    if cap:
        raise UnsupportedModel(
            f"attention logit soft-capping ({arch}.attn_logit_softcapping = {cap}) is not supported",
            path=path,
        )


def _file_scales(
    metadata: Mapping[str, Any],
    arch: str,
    recipe: ArchitectureRecipe,
    tensor_names: set[str],
    path: str | None,
) -> tuple[float, float, float]:
    """(embedding, residual, logit) scales of a recipe that reads them from the file (MiniCPM), each a
    finite positive float as llama.cpp requires the keys; (1, 1, 1) otherwise."""
    if not recipe.file_scales:
        return 1.0, 1.0, 1.0
    longrope = [name for name in LONGROPE_TENSORS if name in tensor_names]
    if longrope:
        raise UnsupportedModel(f"LongRoPE ({', '.join(longrope)}) is not supported", path=path)
    scales = []
    for key in ("embedding_scale", "residual_scale", "logit_scale"):
        value = _require(metadata, f"{arch}.{key}", path)
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
            raise InvalidModelFile(
                f"metadata {arch}.{key} = {value!r}", path=path, expected="a positive float"
            )
        scales.append(float(value))
    return scales[0], scales[1], scales[2]


def spec_from_metadata(
    metadata: Mapping[str, Any], *, tensor_names: set[str], path: str | None = None
) -> ModelSpec:
    """Build a ModelSpec from GGUF metadata. `tensor_names` decides tied embeddings (no output.weight)."""
    arch = _require(metadata, "general.architecture", path)
    if arch not in ARCHITECTURES:
        raise UnsupportedModel(
            f"unsupported architecture {arch!r}",
            path=path,
            hint=f"bitserve supports: {', '.join(SUPPORTED_ARCHITECTURES)}",
        )
    recipe = ARCHITECTURES[arch]
    hidden_size = _positive_int(metadata, f"{arch}.embedding_length", path)
    num_heads = _positive_int(metadata, f"{arch}.attention.head_count", path)
    num_kv_heads = _positive_int(metadata, f"{arch}.attention.head_count_kv", path, default=num_heads)
    head_dim = _positive_int(metadata, f"{arch}.attention.key_length", path, default=hidden_size // num_heads)
    tokens = metadata.get("tokenizer.ggml.tokens")
    vocab_default = len(tokens) if tokens is not None else None
    activation, activation_reason = _activation(metadata, arch, recipe, (num_heads, num_kv_heads))
    if num_heads % num_kv_heads:
        raise InvalidModelFile(
            f"head_count {num_heads} is not a multiple of head_count_kv {num_kv_heads}", path=path
        )
    _refuse_attention_softcap(metadata, arch, path)
    num_layers = _positive_int(metadata, f"{arch}.block_count", path)
    window, sliding_layers = _sliding_layers(metadata, arch, recipe, num_layers, path)
    scale_of = recipe.attention_scale
    embedding_scale, residual_scale, logit_scale = _file_scales(metadata, arch, recipe, tensor_names, path)
    if recipe.scaled_embedding:
        embedding_scale = math.sqrt(hidden_size)
    return ModelSpec(
        architecture=arch,
        name=str(metadata.get("general.name", arch)),
        num_layers=num_layers,
        hidden_size=hidden_size,
        intermediate_size=_positive_int(metadata, f"{arch}.feed_forward_length", path),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        vocab_size=_positive_int(metadata, f"{arch}.vocab_size", path, default=vocab_default),
        max_model_len=_positive_int(metadata, f"{arch}.context_length", path, default=4096),
        rope_dim=_positive_int(metadata, f"{arch}.rope.dimension_count", path, default=head_dim),
        rope_theta=float(metadata.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_style=recipe.rope_style,
        rope_position_scale=_rope_position_scale(metadata, arch, path),
        rms_norm_eps=float(metadata.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        activation=activation,
        activation_reason=activation_reason,
        has_sub_norms=recipe.sub_norms,
        tie_word_embeddings="output.weight" not in tensor_names,
        embedding_scale=embedding_scale,
        residual_scale=residual_scale,
        logit_scale=logit_scale,
        attention_scale=scale_of(num_layers, hidden_size, num_heads, head_dim) if scale_of else 0.0,
        sliding_window=window,
        sliding_layers=sliding_layers,
        sliding_rope_theta=float(metadata.get(f"{arch}.rope.freq_base_swa", recipe.sliding_rope_base)),
        final_logit_softcap=float(metadata.get(f"{arch}.final_logit_softcapping", 0.0) or 0.0),
    )
