"""Serving and converting Hugging Face checkpoint directories (loader/hf_checkpoint.py, checkpoint_file.py,
hf_convert.py) against transformers' own forward of the same checkpoint.

Each case is a random-init model (bitserve/testing/hf_checkpoints.py) written as save_pretrained lays a
directory out: config.json, model.safetensors, tokenizer.json and tokenizer_config.json. bitserve serves the
directory itself (`LLM(DIR)`) and the GGUF `bitserve convert` writes from it; both must give transformers'
logits and greedy tokens. BitNet is checked in both published layouts: float master weights ternarized at
load as AutoBitLinear (online) does, and 2B-4T's packed uint8 codes with BitLinear's weight_scale, against
transformers' own BitLinear / AutoBitLinear modules."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bitserve.llm import LLM

pytest.importorskip("transformers")

PROMPTS = ["The capital of France is Paris, and", "def add(a, b):\n    return", "émigré 東京 🙂 1 2 3"]
# both sides compute in f32 from the same weights; only summation order differs (~6e-7 of a max logit
# ~1 seen); a wrong q/k permutation, a missing norm or a BitNet scale applied the wrong way moves logits
# by far more, at every position
MAX_DIFF_FRACTION = 1e-5
# BitNet's int8 activation codes round f32 values: where one lies within an ulp of a rounding midpoint the
# two sides may round it apart, and every later position moves (measured on this model: scaling each
# weight_scale by 1 + 1e-6 moved 1 of 30 positions by 0.4% of the max logit; one split at the first
# position moves them all). So a ternary model must match within MAX_DIFF_FRACTION at half of all its
# positions (no systematic error does), and within BITNET_FLIP_FRACTION everywhere.
BITNET_FLIP_FRACTION = 5e-2
BITNET_EXACT_POSITIONS = 0.5
# ("llama", "packed"): Falcon3-1.58bit's layout, a LlamaForCausalLM with BitNet's quantization_config (its
# ternary q/k codes permuted for NORM RoPE)
CASES = [
    ("llama", None),
    ("qwen3", None),
    ("qwen2", None),
    ("gemma3", None),
    ("bitnet", "online"),
    ("bitnet", "packed"),
    ("llama", "packed"),
]


def _hf_logits(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    with torch.inference_mode(), torch._dynamo.config.patch(disable=True):  # BitLinear's torch.compile
        return model(torch.tensor([token_ids])).logits[0]  # [T, vocab]


def _bitserve_logits(llm: LLM, token_ids: list[int]) -> torch.Tensor:
    model = llm.instance.loaded.model
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(token_ids), torch.arange(len(token_ids))))


def _assert_matches(reference: torch.nn.Module, llm: LLM, ternary: bool, what: str) -> None:
    exact_positions: list[bool] = []
    for prompt in PROMPTS:
        token_ids = llm.encode(prompt)
        expected, actual = _hf_logits(reference, token_ids), _bitserve_logits(llm, token_ids)
        assert expected.std().item() > 0.05  # not degenerate
        per_position = (expected - actual).abs().max(dim=-1).values / expected.abs().max()  # [T]
        bound = BITNET_FLIP_FRACTION if ternary else MAX_DIFF_FRACTION
        assert per_position.max().item() <= bound, f"{what} {prompt!r}: max |diff| {per_position.max():.3g}"
        exact_positions += (per_position <= MAX_DIFF_FRACTION).tolist()
        top2 = expected.topk(2, dim=-1).values
        decisive = (top2[:, 0] - top2[:, 1]) > 0.01 * (expected.max(-1).values - expected.min(-1).values)
        assert torch.equal(expected.argmax(-1)[decisive], actual.argmax(-1)[decisive]), what
    assert sum(exact_positions) >= BITNET_EXACT_POSITIONS * len(exact_positions), what


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize(("arch", "layout"), CASES)
def test_served_directory_equals_transformers(
    hf_checkpoint_dir, arch: str, layout: str | None, backend: str
) -> None:  # noqa: ANN001
    reference, folder = hf_checkpoint_dir(arch, layout)
    llm = LLM(str(folder), backend=backend)
    try:
        loaded = llm.instance.loaded
        expected_arch = "bitnet-b1.58" if arch == "bitnet" else arch
        assert loaded.spec.architecture == expected_arch
        assert loaded.unused_tensors == []
        if layout is not None:
            assert {
                loaded.gguf.tensors[f"blk.0.{p}.weight"].ggml_type.name for p in ("attn_q", "ffn_down")
            } == {"I2_S"}
            assert loaded.spec.activation == ("relu2" if arch == "bitnet" else "silu")
        _assert_matches(reference, llm, layout is not None, f"{arch}/{layout} {backend}")
    finally:
        llm.close()


@pytest.mark.parametrize(
    ("arch", "layout", "weight_type"),
    [
        ("llama", None, "F32"),
        ("qwen3", None, "F16"),
        ("gemma3", None, "F32"),
        ("minicpm", None, "F32"),  # no transformers class: llama.cpp checks its GGUF (test_coverage_golden)
        ("bitnet", "online", "I2_S"),
        ("bitnet", "packed", "TQ2_0"),
    ],
)
def test_converted_gguf_gives_the_directory_tokens(
    hf_checkpoint_dir, tmp_path: Path, arch: str, layout: str | None, weight_type: str
) -> None:  # noqa: ANN001
    """`bitserve convert` of the directory, served: over the directory's greedy continuation of each prompt,
    the same logits where the file holds the same values (F32; I2_S is how the directory's BitNet weights
    are served), and the same argmax at every decisive position where it rounds them (F16, TQ2_0's f16
    scale)."""
    from bitserve.loader.hf_convert import convert_checkpoint
    from bitserve.sampling_params import SamplingParams

    _, folder = hf_checkpoint_dir(arch, layout)
    path = convert_checkpoint(folder, tmp_path / f"{arch}.gguf", weight_type=weight_type)
    directory, converted = LLM(str(folder), backend="cpu"), LLM(str(path), backend="cpu")
    try:
        assert converted.instance.loaded.unused_tensors == []
        params = SamplingParams(max_tokens=12, temperature=0.0)
        for prompt in PROMPTS:
            token_ids = directory.encode(prompt)
            continuation = directory.generate([token_ids], params)[0].outputs[0].token_ids
            sequence = token_ids + list(continuation)
            expected, actual = _bitserve_logits(directory, sequence), _bitserve_logits(converted, sequence)
            if weight_type in ("F32", "I2_S"):
                assert torch.equal(expected, actual), prompt
            top2 = expected.topk(2, dim=-1).values
            decisive = (top2[:, 0] - top2[:, 1]) > 0.01 * (expected.max(-1).values - expected.min(-1).values)
            assert torch.equal(expected.argmax(-1)[decisive], actual.argmax(-1)[decisive]), prompt
    finally:
        directory.close()
        converted.close()


def test_a_non_ternary_checkpoint_is_refused_as_i2s(hf_checkpoint_dir, tmp_path: Path) -> None:  # noqa: ANN001
    from bitserve.errors import InvalidModelFile
    from bitserve.loader.hf_convert import convert_checkpoint

    _, folder = hf_checkpoint_dir("llama", None)
    with pytest.raises(InvalidModelFile, match=r"model\.layers\.0\.\S+_proj\.weight is not ternary"):
        convert_checkpoint(folder, tmp_path / "x.gguf", weight_type="I2_S")
    assert not (tmp_path / "x.gguf").exists()


def test_cli_converts_and_inspects_a_directory(hf_checkpoint_dir, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    import json

    from bitserve.cli.main import main
    from bitserve.loader.gguf_reader import read_gguf

    _, folder = hf_checkpoint_dir("bitnet", "packed")
    target = tmp_path / "b158.gguf"
    assert main(["convert", str(folder), str(target), "--type", "I2_S", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["path"] == str(target) and summary["bytes"] == target.stat().st_size
    with read_gguf(target) as gguf:
        assert gguf.metadata["general.architecture"] == "bitnet-b1.58"
        assert gguf.metadata["bitnet-b1.58.hidden_act"] == "relu2"
        assert gguf.tensors["blk.1.ffn_up.weight"].ggml_type.name == "I2_S"
    assert main(["inspect", str(folder), "--json"]) == 0
    inspected = json.loads(capsys.readouterr().out)
    assert inspected["format"] == "hf-checkpoint"
    assert inspected["hyperparameters"]["activation"] == "relu2"
    assert inspected["tensor_types"]["I2_S"]["count"] == 14  # 7 projections x 2 layers


def test_directory_version_hashes_its_files(hf_checkpoint_dir, tmp_path: Path) -> None:  # noqa: ANN001
    """A served directory's version (the admin API's and /v1/models') changes when any of its files does."""
    import shutil

    from bitserve.lifecycle.model_files import ModelFiles, file_sha256

    _, folder = hf_checkpoint_dir("qwen3", None)
    copy = tmp_path / "Qwen3-tiny.v2"
    shutil.copytree(folder, copy)
    before = file_sha256(copy)
    assert before == file_sha256(folder)
    config = (copy / "tokenizer_config.json").read_text()
    (copy / "tokenizer_config.json").write_text(config.replace("}", ', "add_eos_token": false}', 1))
    assert file_sha256(copy) != before
    files = ModelFiles(roots=[tmp_path])
    assert "Qwen3-tiny.v2" in files.names  # discovered in the root
    resolved = files.resolve("Qwen3-tiny.v2")
    assert resolved.path == copy.resolve() and resolved.name == "Qwen3-tiny.v2"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_hidden_layers": 10**9}, "num_hidden_layers"),
        ({"hidden_size": "576"}, "hidden_size"),
        ({"architectures": ["MambaForCausalLM"]}, "has no converter"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn'"),
        ({"quantization_config": {"quant_method": "gptq"}}, "gptq"),
        ({"quantization_config": {"quant_method": "bitnet", "use_rms_norm": True}}, "use_rms_norm"),
    ],
)
def test_configs_it_cannot_serve_are_refused_by_name(
    hf_checkpoint_dir, tmp_path: Path, change: dict, message: str
) -> None:  # noqa: ANN001
    """A config.json bitserve cannot honour fails the load with its key named, before any weight is read,
    never silently ignored (a scaled RoPE or a per-projection norm would give wrong answers)."""
    _assert_refused(hf_checkpoint_dir, "qwen3", tmp_path, change, message)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"query_pre_attn_scalar": 7}, "query_pre_attn_scalar 7"),
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
        ({"layer_types": ["full_attention"] * 6}, "layer_types"),
        ({"hidden_activation": "gelu"}, "tanh GELU"),
        (
            {"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 8.0}}},
            "Gemma 3 RoPE 'yarn'",
        ),
    ],
)
def test_gemma3_configs_it_cannot_serve_are_refused_by_name(
    hf_checkpoint_dir, tmp_path: Path, change: dict, message: str
) -> None:  # noqa: ANN001
    """What a gemma3 GGUF cannot carry (llama.cpp derives the softmax scale and the layer pattern itself)."""
    _assert_refused(hf_checkpoint_dir, "gemma3", tmp_path, change, message)


def _assert_refused(hf_checkpoint_dir, arch: str, tmp_path: Path, change: dict, message: str) -> None:  # noqa: ANN001
    import json
    import shutil

    from bitserve.errors import BitserveError

    _, folder = hf_checkpoint_dir(arch, None)
    copy = tmp_path / "ck"
    shutil.copytree(folder, copy)
    config = json.loads((copy / "config.json").read_text()) | change
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(BitserveError, match=message):
        LLM(str(copy), backend="cpu")
