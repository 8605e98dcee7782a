"""A Hugging Face checkpoint directory (config.json + safetensors) seen through an architecture's two name
maps: each tensor under its GGUF name, transformed as llama.cpp's converter would write it. One home for
those transforms, shared by serving a directory (loader/checkpoint_file.py) and converting it
(loader/hf_convert.py), so the two cannot disagree.

The transforms:
- q/k rows permuted for a NORM-RoPE architecture (llama: HF stores rotate-half rows);
- a tied head dropped (the GGUF has no output.weight);
- Gemma's RMSNorm weights w (transformers computes x * (1 + w)) written as 1 + w, in f32;
- BitNet projections (config.json `quantization_config.quant_method = "bitnet"`: BitNetForCausalLM, and
  Llama checkpoints such as Falcon3-1.58bit) become ternary codes and one scale, exactly as transformers'
  BitNet layers compute them (integrations/bitnet.py):
  - packed (uint8 [M / 4, K], rows i*M/4 .. (i+1)*M/4 at bits 2i, code + 1) with a `weight_scale` [1]:
    `bitlinear` divides the output by it (scale = 1 / weight_scale), `autobitlinear` multiplies;
  - float master weights under `autobitlinear` + `online`: s = 1 / mean|W| (clamped at 1e-5) in W's dtype,
    codes = clamp(round(W s), -1, 1), each value codes / s (WeightQuant);
  - float weights under `offline` are used as stored: they must already be ternary codes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bitserve.errors import InvalidModelFile, UnsupportedModel
from bitserve.kernels.packed import TernaryCodes
from bitserve.layers.rotary import RopeStyle
from bitserve.loader.checkpoint_dir import read_json
from bitserve.loader.hf_config import check_gemma3, check_rope, num_kv_heads
from bitserve.loader.safetensors_dir import SafetensorsDir, StoredTensor
from bitserve.models.architectures import ARCHITECTURES
from bitserve.models.recipe import ArchitectureRecipe, TensorNames

MAX_CONFIG_BYTES = 4 * 1024 * 1024
# the sizes the name maps and the GGUF keys are built from: each must be a positive int (and bounded, so a
# hostile config cannot ask for a billion layers of names before any tensor is checked)
REQUIRED_SIZES = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "vocab_size",
)
MAX_SIZE = 1 << 24
# config.json "architectures" -> the GGUF architecture its checkpoint converts to
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "BitNetForCausalLM": "bitnet-b1.58",  # Microsoft's 2B-4T: bitnet.cpp's architecture name
    "Gemma3ForCausalLM": "gemma3",  # the text-only Gemma 3 (model_type gemma3_text)
    "MiniCPMForCausalLM": "minicpm",  # OpenBMB's remote-code class: llama's tensors, three scales
}
PROJECTION_FIELDS = ("qkv", "attn_output", "gate_up", "ffn_down")
NORM_FIELDS = (
    "output_norm",
    "attn_norm",
    "attn_q_norm",
    "attn_k_norm",
    "attn_sub_norm",
    "attn_post_norm",
    "ffn_norm",
    "ffn_sub_norm",
    "ffn_post_norm",
)
# buffers some checkpoints carry that no GGUF holds (llama.cpp's converter skips them too)
SKIPPED_SUFFIXES = (".rotary_emb.inv_freq",)
WeightValue = torch.Tensor | TernaryCodes


def gguf_architecture(config: Mapping[str, Any]) -> str:
    names = config.get("architectures") or []
    for name in names:
        if name in HF_ARCHITECTURES:
            return HF_ARCHITECTURES[name]
    raise UnsupportedModel(
        f"checkpoint architecture {names!r} has no converter",
        hint=f"supported: {', '.join(HF_ARCHITECTURES)}",
    )


def absent_parts(recipe: ArchitectureRecipe) -> set[str]:
    """The TensorNames fields naming parts this architecture does not have."""
    absent = set() if recipe.qkv_biases else {"qkv_biases"}
    absent |= set() if recipe.qk_norms else {"attn_q_norm", "attn_k_norm"}
    absent |= set() if recipe.post_norms else {"attn_post_norm", "ffn_post_norm"}
    return absent | (set() if recipe.sub_norms else {"attn_sub_norm", "ffn_sub_norm"})


def name_map(
    recipe: ArchitectureRecipe, num_layers: int, fields: tuple[str, ...] | None = None
) -> dict[str, str]:
    """HF tensor name -> GGUF tensor name for every tensor the architecture has (or only `fields`)."""
    mapping: dict[str, str] = {}
    absent = absent_parts(recipe)
    for field in dataclasses.fields(TensorNames):
        if field.name in absent or (fields is not None and field.name not in fields):
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


def read_config(directory: Path) -> dict[str, Any]:
    path = directory / "config.json"
    if not path.is_file():
        raise InvalidModelFile(
            "no config.json", path=str(directory), hint="pass a GGUF file, or a save_pretrained directory"
        )
    config = read_json(path, MAX_CONFIG_BYTES)
    if not isinstance(config, dict):
        raise InvalidModelFile("config.json is not a JSON object", path=str(path))
    for key in REQUIRED_SIZES:
        value = config.get(key)
        if type(value) is not int or not 0 < value <= MAX_SIZE:
            raise InvalidModelFile(
                f"config.json {key} is {value!r}, not a size in [1, {MAX_SIZE}]",
                path=str(path),
                hint="a transformers config.json of a decoder-only model holds it",
            )
    return config


@dataclass(frozen=True, slots=True)
class BitNetQuantization:
    """config.json's quantization_config for quant_method "bitnet" (transformers' BitNetQuantConfig)."""

    linear_class: str  # "bitlinear" (packed, output / weight_scale) or "autobitlinear"
    mode: str  # "offline" (weights stored as codes) or "online" (float masters ternarized per call)
    not_converted: tuple[str, ...]  # module names kept as plain nn.Linear

    @staticmethod
    def of(config: Mapping[str, Any]) -> BitNetQuantization | None:
        quantization = config.get("quantization_config")
        if not quantization:
            return None
        method = quantization.get("quant_method")
        if method != "bitnet":
            raise UnsupportedModel(
                f"quantization_config.quant_method {method!r} is not supported (bitnet only)"
            )
        linear_class = quantization.get("linear_class", "bitlinear")
        mode = quantization.get("quantization_mode", "offline")
        if linear_class not in ("bitlinear", "autobitlinear") or mode not in ("offline", "online"):
            raise UnsupportedModel(
                f"bitnet quantization {linear_class!r} / {mode!r} is not one transformers has"
            )
        if quantization.get("use_rms_norm"):
            raise UnsupportedModel("bitnet quantization with use_rms_norm (an RMSNorm inside each BitLinear)")
        return BitNetQuantization(linear_class, mode, tuple(quantization.get("modules_to_not_convert") or ()))

    def converts(self, module: str) -> bool:
        return not any(module == name or module.endswith("." + name) for name in self.not_converted)


def unpack_bitnet_rows(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [R, K] -> int8 [4R, K]: rows i*R .. (i+1)*R hold bits 2i .. 2i+1 of every byte, code + 1."""
    parts = [((packed >> (2 * i)) & 3).to(torch.int8) - 1 for i in range(4)]
    return torch.cat(parts, dim=0)


def online_ternary(weight: torch.Tensor) -> TernaryCodes:
    """transformers' WeightQuant, in the weight's own dtype: codes and the value one code stands for."""
    inverse_scale = 1.0 / weight.abs().mean().clamp_(min=1e-5)
    codes = (weight * inverse_scale).round().clamp(-1, 1)
    value = (torch.ones((), dtype=weight.dtype) / inverse_scale).to(torch.float32)
    return TernaryCodes(values=codes.to(torch.int8), scale=value)


def _permute_rows(rows: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[heads * D, ...] rotate-half rows -> interleaved-pair rows (llama.cpp's converter's permute)."""
    shape = rows.shape
    head_rows = shape[0] // num_heads
    return rows.reshape(num_heads, 2, head_rows // 2, *shape[1:]).transpose(1, 2).reshape(shape).contiguous()


class Checkpoint:
    """An open checkpoint directory: its config, architecture, and tensors by GGUF name (see module doc)."""

    def __init__(self, directory: str | Path, *, order: Sequence[str] | None = None) -> None:
        """`order`: the HF names in the order to write them (a state dict's); default the files' order."""
        self.directory = Path(directory)
        self.config = read_config(self.directory)
        self.architecture = gguf_architecture(self.config)
        self.recipe = ARCHITECTURES[self.architecture]
        check_rope(self.architecture, self.config)
        if self.architecture == "gemma3":
            check_gemma3(self.config)
        self.quantization = BitNetQuantization.of(self.config)
        self.num_layers = int(self.config["num_hidden_layers"])
        self.store = SafetensorsDir(self.directory)
        try:
            self._sources = self._map_names(order or list(self.store.tensors))
        except BaseException:
            self.store.close()
            raise
        self._permuted = self._permuted_heads()
        self._projections = set(name_map(self.recipe, self.num_layers, PROJECTION_FIELDS).values())
        # RMSNorm weights stored minus the recipe's offset (Gemma's 1 + w): written with it added
        offset = self.recipe.hf_norm_offset
        self._offset_norms = (
            set(name_map(self.recipe, self.num_layers, NORM_FIELDS).values()) if offset else set()
        )

    def _map_names(self, order: Sequence[str]) -> dict[str, str]:
        """GGUF name -> HF name for every stored tensor; a stored tensor without a GGUF name is refused."""
        mapping = name_map(self.recipe, self.num_layers)
        tied = bool(self.config.get("tie_word_embeddings", False))
        if sorted(order) != sorted(self.store.tensors):
            raise ValueError("order must name every stored tensor once")
        sources: dict[str, str] = {}
        for hf_name in order:
            if (tied and hf_name == self.recipe.hf_names.output) or hf_name.endswith(SKIPPED_SUFFIXES):
                continue
            if self.quantization is not None and hf_name.endswith(".weight_scale"):
                continue  # read with its weight
            if hf_name not in mapping:
                raise InvalidModelFile(
                    f"checkpoint tensor {hf_name!r} has no GGUF name in the {self.architecture} recipe",
                    path=str(self.directory),
                    hint="the checkpoint holds a part the architecture does not declare (models/recipe.py)",
                )
            sources[mapping[hf_name]] = hf_name
        return sources

    def _permuted_heads(self) -> dict[str, int]:
        if self.recipe.rope_style is not RopeStyle.NORM:
            return {}
        q_name, k_name = self.recipe.names.qkv[0], self.recipe.names.qkv[1]
        heads = {q_name: int(self.config["num_attention_heads"]), k_name: num_kv_heads(self.config)}
        return {
            template.format(layer=layer): count
            for template, count in heads.items()
            for layer in range(self.num_layers)
        }

    @property
    def gguf_names(self) -> list[str]:
        return list(self._sources)

    def is_projection(self, gguf_name: str) -> bool:
        """q, k, v, o, gate, up, down: the layers' matrices (BitLinear in a BitNet model)."""
        return gguf_name in self._projections

    def is_ternary(self, gguf_name: str) -> bool:
        """True for a projection the checkpoint's BitNet quantization turns into ternary codes."""
        if self.quantization is None or gguf_name not in self._projections:
            return False
        return self.quantization.converts(self._sources[gguf_name].removesuffix(".weight"))

    def source_name(self, gguf_name: str) -> str:
        """The checkpoint's (transformers') name of a GGUF-named tensor."""
        return self._sources[gguf_name]

    def stored(self, gguf_name: str) -> StoredTensor:
        return self.store.tensors[self._sources[gguf_name]]

    def matrix_shape(self, gguf_name: str) -> tuple[int, ...]:
        """The tensor's PyTorch shape once transformed (a packed BitNet weight holds 4 rows a stored row)."""
        stored = self.stored(gguf_name)
        if self.is_ternary(gguf_name) and stored.dtype == torch.uint8:
            return (4 * stored.shape[0], *stored.shape[1:])
        return stored.shape

    def is_view(self, gguf_name: str) -> bool:
        """True when value() is the stored bytes themselves (no transform, no copy)."""
        return not (
            self.is_ternary(gguf_name) or gguf_name in self._permuted or gguf_name in self._offset_norms
        )

    def value(self, gguf_name: str) -> WeightValue:
        """The tensor as the GGUF holds it: a view over the mapping, a permuted copy, or ternary codes."""
        hf_name = self._sources[gguf_name]
        stored = self.store.tensor(hf_name)
        if gguf_name in self._offset_norms:  # f32: a bf16 1 + w would round w away
            return stored.to(torch.float32) + self.recipe.hf_norm_offset
        value: WeightValue = self._ternary(hf_name, stored) if self.is_ternary(gguf_name) else stored
        heads = self._permuted.get(gguf_name)
        if heads is None:
            return value
        if isinstance(value, TernaryCodes):
            return TernaryCodes(values=_permute_rows(value.values, heads), scale=value.scale)
        return _permute_rows(value, heads)

    def _ternary(self, hf_name: str, weight: torch.Tensor) -> TernaryCodes:
        assert self.quantization is not None
        scale_name = hf_name.removesuffix(".weight") + ".weight_scale"
        if self.quantization.mode == "online" and weight.dtype != torch.uint8:
            return online_ternary(weight)
        if scale_name not in self.store.tensors:
            raise InvalidModelFile(f"{hf_name!r} has no {scale_name!r}", path=str(self.directory))
        weight_scale = self.store.tensor(scale_name).to(torch.float32).reshape(-1)
        if weight_scale.numel() != 1 or not torch.isfinite(weight_scale).all() or weight_scale.item() == 0:
            raise InvalidModelFile(
                f"{scale_name!r} is not one finite non-zero value", path=str(self.directory)
            )
        if weight.dtype == torch.uint8:
            codes = unpack_bitnet_rows(weight)
        elif bool(((weight == -1) | (weight == 0) | (weight == 1)).all()):
            codes = weight.to(torch.int8)
        else:
            raise InvalidModelFile(
                f"{hf_name!r} is stored offline (as codes) but holds values other than -1, 0, +1",
                path=str(self.directory),
            )
        scale = 1.0 / weight_scale[0] if self.quantization.linear_class == "bitlinear" else weight_scale[0]
        return TernaryCodes(values=codes, scale=scale.to(torch.float32))

    def close(self) -> None:
        self.store.close()
