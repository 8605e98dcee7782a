"""Small random-init transformers checkpoints of the architectures bitserve converts (loader/hf_convert.py),
for parity tests against transformers' own forward. Needs `transformers` (a test dependency).

Norm weights and biases are drawn at random too (transformers initializes them to ones and zeros, under
which a norm or bias read from the wrong tensor, or not applied at all, would not show).
"""

from __future__ import annotations

from typing import Any

import torch

# small dims; qwen3's head_dim (32) is not hidden / heads (16), as in the real Qwen3 models
_SHAPES: dict[str, dict[str, Any]] = {
    "llama": {"head_dim": 16, "tie_word_embeddings": False},
    "qwen2": {"head_dim": 16, "tie_word_embeddings": False},
    "qwen3": {"head_dim": 32, "tie_word_embeddings": True},
}


def random_checkpoint(arch: str, vocab_size: int, seed: int = 0) -> torch.nn.Module:
    """A float32 `arch` model (llama | qwen2 | qwen3) of 2 layers, 64 wide, 4 heads over 2 KV heads, in
    eval mode, with seeded weights."""
    import transformers

    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }
    config_class, model_class = classes[arch]
    config = config_class(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        dtype=torch.float32,
        **_SHAPES[arch],
    )
    torch.manual_seed(seed)
    model = model_class(config)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.copy_(torch.rand(parameter.shape, generator=generator) + 0.5)  # [0.5, 1.5)
            elif name.endswith(".bias"):
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
    return model.eval()


def checkpoint_config(model: torch.nn.Module) -> dict[str, Any]:
    """The model's config.json contents, as save_pretrained writes them (it adds `architectures`)."""
    return model.config.to_dict() | {"architectures": [type(model).__name__]}
