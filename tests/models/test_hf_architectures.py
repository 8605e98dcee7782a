"""The architectures beyond llama and bitnet against transformers' own modeling: a random-init
checkpoint (bitserve/testing/hf_checkpoints.py, seeded norms and biases) converted to GGUF by
loader/hf_convert.py through the recipes' two name maps, then bitserve's forward on it against the
transformers forward of the same model: logits over every prompt position, on the reference and cpu
backends. qwen2 adds q/k/v biases, qwen3 per-head q/k RMSNorms and a head_dim that is not hidden/heads;
llama checks the converter's q/k permutation for NORM RoPE; gemma3 its four norms a layer (stored as w,
run as 1 + w), scaled embedding, GELU-tanh and sliding-window layers with their own RoPE base."""

from __future__ import annotations

import pytest
import torch

from bitserve.llm import LLM
from bitserve.loader.hf_checkpoint import name_map
from bitserve.models.architectures import ARCHITECTURES

pytest.importorskip("transformers")

PROMPTS = ["The capital of France is Paris, and", "def add(a, b):\n    return", "émigré 東京 🙂 1 2 3"]
# Both sides compute in f32 from the same f32 weights; only summation order differs (~3e-7 of a max
# logit ~1 seen). A missing bias or q/k norm moves logits by > 1e-2 (checked below), a permuted q/k more.
MAX_DIFF_FRACTION = 1e-5


def _hf_logits(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([token_ids])).logits[0]  # [T, vocab]


def _bitserve_logits(llm: LLM, token_ids: list[int]) -> torch.Tensor:
    model = llm.instance.loaded.model
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(token_ids), torch.arange(len(token_ids))))


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama", "gemma3"])
def test_logits_equal_transformers(hf_gguf, arch: str, backend: str) -> None:  # noqa: ANN001
    hf_model, path = hf_gguf(arch)
    llm = LLM(str(path), backend=backend)
    try:
        assert llm.instance.loaded.model.spec.architecture == arch
        for prompt in PROMPTS:
            token_ids = llm.encode(prompt)
            expected, actual = _hf_logits(hf_model, token_ids), _bitserve_logits(llm, token_ids)
            max_logit = expected.abs().max().item()
            assert expected.std().item() > 0.05  # not degenerate: these weights give logits of std ~0.2
            diff = (expected - actual).abs().max().item()
            assert diff <= MAX_DIFF_FRACTION * max_logit, f"{arch} {prompt!r}: max |diff| {diff:.3g}"
            assert torch.equal(expected.argmax(-1), actual.argmax(-1))
    finally:
        llm.close()


@pytest.mark.parametrize(
    ("arch", "part"),
    [
        ("qwen2", "self_attn.q_proj.bias"),
        ("qwen3", "self_attn.k_norm"),
        ("gemma3", "post_attention_layernorm"),
        ("gemma3", "post_feedforward_layernorm"),
    ],
)
def test_the_new_parts_change_the_logits(hf_gguf, arch: str, part: str) -> None:  # noqa: ANN001
    """The comparison above could not pass by ignoring a bias or a q/k norm: dropping one (in transformers'
    model) moves the logits by far more than the tolerance."""
    hf_model, _ = hf_gguf(arch)
    token_ids = list(range(100, 120))
    expected = _hf_logits(hf_model, token_ids)
    module = hf_model.get_submodule(f"model.layers.0.{part.removesuffix('.bias')}")
    saved = {name: value.clone() for name, value in module.state_dict().items()}
    with torch.no_grad():
        if part.endswith(".bias"):
            module.bias.zero_()
        else:
            module.weight.fill_(1.0)
    try:
        moved = (_hf_logits(hf_model, token_ids) - expected).abs().max().item()
    finally:
        module.load_state_dict(saved)
    assert moved > 100 * MAX_DIFF_FRACTION * expected.abs().max().item()


def test_every_checkpoint_tensor_has_a_gguf_name() -> None:
    """The HF map names each tensor the GGUF map does (field for field): qwen3's norms, qwen2's biases."""
    qwen3 = name_map(ARCHITECTURES["qwen3"], num_layers=2)
    assert qwen3["model.layers.1.self_attn.q_norm.weight"] == "blk.1.attn_q_norm.weight"
    assert "model.layers.0.self_attn.v_proj.bias" not in qwen3  # qwen3 has no biases: refused, not written
    mapping = name_map(ARCHITECTURES["qwen2"], num_layers=2)
    assert mapping["model.layers.0.self_attn.v_proj.bias"] == "blk.0.attn_v.bias"
    assert "model.layers.0.self_attn.q_norm.weight" not in mapping
    assert mapping["model.layers.0.mlp.up_proj.weight"] == "blk.0.ffn_up.weight"
    assert mapping["lm_head.weight"] == "output.weight"
    assert len(set(mapping.values())) == len(mapping)  # one GGUF name for one HF name


def test_a_tensor_the_recipe_does_not_declare_is_refused(hf_gguf, tmp_path) -> None:  # noqa: ANN001
    from bitserve.errors import InvalidModelFile
    from bitserve.loader.hf_convert import write_gguf
    from bitserve.testing.hf_checkpoints import checkpoint_config

    hf_model, _ = hf_gguf("qwen3")
    state = dict(hf_model.state_dict()) | {"model.layers.0.self_attn.q_proj.bias": torch.zeros(128)}
    with pytest.raises(InvalidModelFile, match="q_proj.bias"):
        write_gguf(tmp_path / "x.gguf", checkpoint_config(hf_model), state, {})
