"""Small random-init transformers checkpoints of the architectures bitserve converts (loader/hf_convert.py),
for parity tests against transformers' own forward. Needs `transformers` (a test dependency).

Every parameter is drawn here, from one seeded torch.Generator in name order: matrices N(0, 0.02), norm
weights U[0.5, 1.5), biases N(0, 0.25). So the bytes depend on torch's generator only, not on the init code
of the installed transformers (the golden fixtures hold the converted files' sha256), and a norm or bias
read from the wrong tensor, or not applied, shows (transformers' own init makes them ones and zeros).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# weight types whose blocks need every projection's input a multiple of 128 values (random_checkpoint wide)
WIDE_TYPES = ("Q1_0", "Q2_0")

# MiniCPM (OpenBMB's remote code, no transformers class): a Llama checkpoint with its three scales in
# config.json, saved as MiniCPMForCausalLM; llama.cpp is its reference
_MINICPM_SCALES = {"scale_emb": 0.5, "scale_depth": 8.0, "dim_model_base": 32}
# small dims; qwen3's head_dim (32) is not hidden / heads (16), as in the real Qwen3 models
_SHAPES: dict[str, dict[str, Any]] = {
    "llama": {"head_dim": 16, "tie_word_embeddings": False},
    "qwen2": {"head_dim": 16, "tie_word_embeddings": False},
    "qwen3": {"head_dim": 32, "tie_word_embeddings": True},
    "bitnet": {"head_dim": 32, "tie_word_embeddings": True, "hidden_act": "relu2"},  # 2B-4T's: tied, ReLU²
    # 1bitLLM's activation: llama.cpp's `bitnet` graph runs SiLU whatever the file says, so this is the
    # BitNet llama.cpp can check (the 2B-4T's ReLU² is checked against transformers and bitnet.cpp)
    "bitnet-silu": {"head_dim": 32, "tie_word_embeddings": True, "hidden_act": "silu"},
    "minicpm": {"head_dim": 16, "tie_word_embeddings": True} | _MINICPM_SCALES,
    # Gemma 3: tied; a window of 5 positions, shorter than the tests' prompts, so sliding layers differ
    # from full ones; its sliding layers' RoPE base 10000, the full layer's 1e6 (the real models')
    "gemma3": {
        "head_dim": 16,
        "tie_word_embeddings": True,
        "query_pre_attn_scalar": 16,
        "sliding_window": 5,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
        },
    },
}
# layers when the caller names none: Gemma 3's pattern needs six for one full-attention layer
_DEFAULT_LAYERS = {"gemma3": 6}


def random_checkpoint(
    arch: str,
    vocab_size: int,
    seed: int = 0,
    *,
    wide: bool = False,
    num_layers: int | None = None,
    width: int | None = None,
) -> torch.nn.Module:
    """A float32 `arch` model (llama | qwen2 | qwen3 | bitnet | bitnet-silu | gemma3 | minicpm: plain float
    linears) of
    `num_layers` layers (default 2, gemma3 6), 64 wide (wide: 128, every
    projection's input a multiple of 128 as Q1_0 needs), 4 heads over 2 KV heads, in eval mode, with
    seeded weights. `width` (a multiple of 4) sets the hidden size instead, the intermediate size 2 x width
    and head_dim width / 4: 256 makes every projection's input whole K-quant super-blocks."""
    import transformers

    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "bitnet": (transformers.BitNetConfig, transformers.BitNetForCausalLM),
        "bitnet-silu": (transformers.BitNetConfig, transformers.BitNetForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
        "minicpm": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    }
    config_class, model_class = classes[arch]
    config = config_class(
        vocab_size=vocab_size,
        hidden_size=width or (128 if wide else 64),
        intermediate_size=2 * width if width else (256 if wide else 160),
        num_hidden_layers=num_layers or _DEFAULT_LAYERS.get(arch, 2),
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        dtype=torch.float32,
        **(
            {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
            | _SHAPES[arch]
            | _head_dim(arch, wide, width)
        ),
    )
    model = model_class(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in sorted(model.named_parameters()):  # a tied head is the embedding's
            if name.endswith("norm.weight"):
                values = torch.rand(parameter.shape, generator=generator) + 0.5
            elif name.endswith(".bias"):
                values = torch.randn(parameter.shape, generator=generator) * 0.25
            else:
                values = torch.randn(parameter.shape, generator=generator) * 0.02
            parameter.copy_(values)
    return model.eval()


def _head_dim(arch: str, wide: bool, width: int | None) -> dict[str, int]:
    """The head_dim override of a wide / `width` model (and Gemma's query_pre_attn_scalar, kept equal)."""
    dim = width // 4 if width else 32 if wide else None
    if dim is None:
        return {}
    return {"head_dim": dim} | ({"query_pre_attn_scalar": dim} if arch == "gemma3" else {})


def checkpoint_config(model: torch.nn.Module) -> dict[str, Any]:
    """The model's config.json contents, as save_pretrained writes them (it adds `architectures`); a
    Llama carrying MiniCPM's scales is saved as MiniCPMForCausalLM."""
    config = model.config.to_dict()
    name = "MiniCPMForCausalLM" if "scale_emb" in config else type(model).__name__
    return config | {"architectures": [name]}


def hf_gguf_case(
    arch: str, weight_type: str, tokenizer_source: Path, folder: Path
) -> tuple[torch.nn.Module, Path]:
    """(the random-init `arch` model with the vocabulary of the GGUF `tokenizer_source`, its checkpoint
    converted to `folder`/<arch>-<weight_type>.gguf): what tests and scripts/make_coverage_golden.py share."""
    from bitserve.loader.hf_convert import write_gguf
    from bitserve.testing.synthetic import tokenizer_metadata

    tokenizer = tokenizer_metadata(tokenizer_source)
    vocab_size = len(tokenizer["tokenizer.ggml.tokens"][1])
    config: dict[str, Any] = {}
    if arch.startswith("bitnet"):  # 256 wide: whole TQ2_0 blocks; float masters ternarized as transformers'
        model = random_checkpoint(arch, vocab_size, width=256)
        config["quantization_config"] = BITNET_LAYOUTS["online"]
    else:
        model = random_checkpoint(arch, vocab_size, wide=weight_type in WIDE_TYPES)
    path = Path(folder) / f"{arch}-{weight_type}.gguf"
    config = checkpoint_config(model) | config
    write_gguf(path, config, model.state_dict(), tokenizer, weight_type=weight_type)
    return model, path


# BitNet checkpoint layouts: config.json's quantization_config, and how the projections are stored
BITNET_LAYOUTS = {
    # float master weights, ternarized in every forward (microsoft/bitnet-b1.58-2B-4T-bf16's layout)
    "online": {"quant_method": "bitnet", "linear_class": "autobitlinear", "quantization_mode": "online"},
    # uint8 [M / 4, K] codes + 1 and a weight_scale (microsoft/bitnet-b1.58-2B-4T's), output / weight_scale
    "packed": {"quant_method": "bitnet", "linear_class": "bitlinear", "quantization_mode": "offline"},
}


def _is_projection(name: str) -> bool:
    return name.endswith("_proj.weight") and name.startswith("model.layers.")


def bitnet_state(model: torch.nn.Module, layout: str) -> dict[str, torch.Tensor]:
    """The state dict a BitNet checkpoint of `layout` stores for `model`'s float weights: for "packed",
    each projection ternarized as transformers' WeightQuant does, packed with transformers' own pack_weights,
    and its weight_scale (1 / mean |W|, which BitLinear divides the output by)."""
    from transformers.integrations.bitnet import pack_weights

    state = dict(model.state_dict())
    if layout == "online":
        return state
    for name in [name for name in state if _is_projection(name)]:
        weight = state[name]
        inverse_scale = 1.0 / weight.abs().mean().clamp(min=1e-5)
        codes = (weight * inverse_scale).round().clamp(-1, 1)
        state[name] = pack_weights(codes)  # it stores codes + 1
        state[name.removesuffix(".weight") + ".weight_scale"] = inverse_scale.reshape(1).to(weight.dtype)
    return state


def bitnet_reference(model: torch.nn.Module, layout: str) -> torch.nn.Module:
    """transformers' own quantized BitNet model for `layout`: its BitLinear / AutoBitLinear modules
    (replace_with_bitnet_linear, as from_pretrained would build them) holding bitnet_state's tensors."""
    import copy

    from transformers.integrations.bitnet import replace_with_bitnet_linear
    from transformers.utils.quantization_config import BitNetQuantConfig

    reference = copy.deepcopy(model)
    settings = {k: v for k, v in BITNET_LAYOUTS[layout].items() if k != "quant_method"}
    replace_with_bitnet_linear(reference, ["lm_head"], BitNetQuantConfig(**settings))
    reference.load_state_dict(bitnet_state(model, layout), strict=False, assign=True)
    reference.tie_weights()
    return reference.eval()


def save_checkpoint_dir(
    model: torch.nn.Module, folder: Path, tokenizer_source: Path, *, bitnet_layout: str | None = None
) -> Path:
    """`model` written as a Hugging Face checkpoint directory: config.json, model.safetensors (as
    save_pretrained lays it out; a BitNet model in `bitnet_layout`), and tokenizer.json +
    tokenizer_config.json rebuilt from the GGUF `tokenizer_source`'s vocabulary and chat template."""
    import json

    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    config = checkpoint_config(model)
    state = model.state_dict()
    if bitnet_layout is not None:
        config["quantization_config"] = BITNET_LAYOUTS[bitnet_layout]
        state = bitnet_state(model, bitnet_layout)
    if config.get("tie_word_embeddings"):
        state = {name: value for name, value in state.items() if name != "lm_head.weight"}
    save_file({name: value.contiguous() for name, value in state.items()}, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(config, indent=2, default=str))
    write_tokenizer_files(tokenizer_source, folder)
    return folder


def write_tokenizer_files(tokenizer_source: Path, folder: Path) -> None:
    """tokenizer.json (a byte-level BPE built from the GGUF's tokens, merges and pre-tokenizer) and a
    tokenizer_config.json with its special tokens and chat template, as save_pretrained writes them."""
    import json

    from bitserve.loader.gguf_reader import read_gguf
    from bitserve.tokenizer.backends import build_byte_level_bpe, pre_tokenizer_spec

    with read_gguf(tokenizer_source) as gguf:
        metadata = gguf.metadata
        tokens = [str(token) for token in metadata["tokenizer.ggml.tokens"]]
        merges = [str(merge) for merge in metadata["tokenizer.ggml.merges"]]
        spec = pre_tokenizer_spec(str(metadata["tokenizer.ggml.pre"]))
        bos, eos = int(metadata["tokenizer.ggml.bos_token_id"]), int(metadata["tokenizer.ggml.eos_token_id"])
        template = metadata.get("tokenizer.chat_template")
        types = list(metadata["tokenizer.ggml.token_type"])
    from tokenizers import AddedToken, decoders

    backend = build_byte_level_bpe(tokens, merges, spec)
    backend.decoder = decoders.ByteLevel()  # as transformers' byte-level tokenizer.json files have it

    backend.add_special_tokens(
        [AddedToken(tokens[i], special=True) for i, kind in enumerate(types) if kind == 3]
    )
    backend.save(str(folder / "tokenizer.json"))
    tokenizer_config = {"bos_token": tokens[bos], "eos_token": tokens[eos], "add_bos_token": False}
    if template:
        tokenizer_config["chat_template"] = str(template)
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))


def converted_bitnet_i2s(tokenizer_source: Path, folder: Path) -> Path:
    """A random-init BitNet checkpoint in the 2B-4T release's layout (packed uint8 codes + weight_scale,
    ReLU², tied F16 embedding) saved as a directory in `folder`, then `bitserve convert`ed to I2_S
    (bitnet.cpp's `bitnet-b1.58`): the file scripts/make_converted_bitnetcpp_golden.py runs bitnet.cpp on."""
    from bitserve.loader.gguf_reader import read_gguf
    from bitserve.loader.hf_convert import convert_checkpoint

    with read_gguf(tokenizer_source) as gguf:
        vocab_size = len(gguf.metadata["tokenizer.ggml.tokens"])
    model = random_checkpoint("bitnet", vocab_size, width=256)  # whole I2_S blocks
    model.model.embed_tokens.to(torch.float16)  # an F16 tied head, as bitnet.cpp's 2B-4T files have
    directory = save_checkpoint_dir(
        model, Path(folder) / "bitnet-packed", tokenizer_source, bitnet_layout="packed"
    )
    return convert_checkpoint(directory, Path(folder) / "bitnet-packed-I2_S.gguf", weight_type="I2_S")
