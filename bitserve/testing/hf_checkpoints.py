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

# small dims; qwen3's head_dim (32) is not hidden / heads (16), as in the real Qwen3 models
_SHAPES: dict[str, dict[str, Any]] = {
    "llama": {"head_dim": 16, "tie_word_embeddings": False},
    "qwen2": {"head_dim": 16, "tie_word_embeddings": False},
    "qwen3": {"head_dim": 32, "tie_word_embeddings": True},
}


def random_checkpoint(
    arch: str,
    vocab_size: int,
    seed: int = 0,
    *,
    wide: bool = False,
    num_layers: int = 2,
    width: int | None = None,
) -> torch.nn.Module:
    """A float32 `arch` model (llama | qwen2 | qwen3) of `num_layers` layers, 64 wide (wide: 128, every
    projection's input a multiple of 128 as Q1_0 needs), 4 heads over 2 KV heads, in eval mode, with
    seeded weights. `width` (a multiple of 4) sets the hidden size instead, the intermediate size 2 x width
    and head_dim width / 4: 256 makes every projection's input whole K-quant super-blocks."""
    import transformers

    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }
    config_class, model_class = classes[arch]
    config = config_class(
        vocab_size=vocab_size,
        hidden_size=width or (128 if wide else 64),
        intermediate_size=2 * width if width else (256 if wide else 160),
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        dtype=torch.float32,
        **(_SHAPES[arch] | ({"head_dim": 32} if wide else {}) | ({"head_dim": width // 4} if width else {})),
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


def checkpoint_config(model: torch.nn.Module) -> dict[str, Any]:
    """The model's config.json contents, as save_pretrained writes them (it adds `architectures`)."""
    return model.config.to_dict() | {"architectures": [type(model).__name__]}


def hf_gguf_case(
    arch: str, weight_type: str, tokenizer_source: Path, folder: Path
) -> tuple[torch.nn.Module, Path]:
    """(the random-init `arch` model with the vocabulary of the GGUF `tokenizer_source`, its checkpoint
    converted to `folder`/<arch>-<weight_type>.gguf): what tests and scripts/make_coverage_golden.py share."""
    from bitserve.loader.hf_convert import write_gguf
    from bitserve.testing.synthetic import tokenizer_metadata

    tokenizer = tokenizer_metadata(tokenizer_source)
    vocab_size = len(tokenizer["tokenizer.ggml.tokens"][1])
    model = random_checkpoint(arch, vocab_size, wide=weight_type in WIDE_TYPES)
    path = Path(folder) / f"{arch}-{weight_type}.gguf"
    write_gguf(path, checkpoint_config(model), model.state_dict(), tokenizer, weight_type=weight_type)
    return model, path
